// LowLatencyBuffer: the tensor-facing entry of the EP buffer's low-latency mode (with
// normal_buffer.h, the only EP code that sees torch). Validates every argument before any
// launch, owns the GPU buffer and the peers' mappings, and launches the kernels of
// low_latency_kernels.h on the current stream. Collective: every rank of the group constructs it with the same arguments.
//
// Files: low_latency_buffer.cpp (set-up, paths, membership), low_latency_calls.cpp (dispatch,
// combine and their receive halves), kernels/low_latency_{dispatch,combine}.cu.
//
// Paths per peer, chosen at construction: "local" (this rank), "nvlink" (same host, CUDA
// IPC mapping), "proxy" (another host, or another virtual host under
// MOELINK_EP_RANKS_PER_HOST=n, which groups ranks [0, n), [n, 2n), ... into hosts: GPU
// writes into mapped host memory carried by a CPU proxy over the transfer engine; see
// proxy.h), "ibgda" (another host, both ends with an mlx5 NIC that IBGDA can use, or the
// emulated NIC under MOELINK_EP_IBGDA=emulate: GPU threads post RDMA WRITEs on a queue pair
// per peer; see ibgda/nic.h). MOELINK_EP_IBGDA=off keeps other hosts on the proxy.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "moelink/ep/low_latency_kernels.h"
#include "moelink/ep/layout.h"

namespace moelink::ep {

class EpProxy;
namespace ibgda {
class Nic;
}

struct DispatchOutputs {
  at::Tensor recv_x;       // bf16 or e4m3 [local, ranks*max_tokens, hidden]
  at::Tensor recv_scales;  // float [local, ranks*max_tokens, hidden/128] (FP8 only)
  at::Tensor recv_count;   // int32 [local]
  at::Tensor src_info;     // int32 [local, ranks*max_tokens]
  at::Tensor src_slot;     // int32 [local, ranks*max_tokens]
  at::Tensor layout_range; // int64 [local, ranks]: (begin << 32) | count
  int64_t half = 0;
  int64_t num_tokens = 0, num_topk = 0;  // the routing's shape (combine must match it)
};

class LowLatencyBuffer {
 public:
  // `active`: the group's mask (1 = active; empty: every rank).
  LowLatencyBuffer(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, const std::string& key,
           int64_t max_tokens, int64_t hidden, int64_t num_experts, const std::vector<int64_t>& active = {});
  ~LowLatencyBuffer();

  // Sends (and, unless launch_recv is false, receives) one dispatch round.
  DispatchOutputs dispatch(const at::Tensor& x, const at::Tensor& topk_idx, bool use_fp8,
                           bool round_scale, int64_t timeout_us,
                           const std::optional<at::Tensor>& active_ranks, bool launch_recv);
  // The receive half of dispatch() (for return_recv_hook).
  void dispatchRecv(DispatchOutputs& out, bool use_fp8, int64_t timeout_us,
                    const std::optional<at::Tensor>& active_ranks);
  // Sends expert outputs back; unless launch_recv is false, also reduces into `out`.
  at::Tensor combine(const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                     const DispatchOutputs& handle, const std::optional<at::Tensor>& out,
                     int64_t timeout_us, const std::optional<at::Tensor>& active_ranks, bool launch_recv);
  void combineRecv(const at::Tensor& topk_idx, const at::Tensor& topk_weights, const DispatchOutputs& handle,
                   at::Tensor& out, int64_t timeout_us, const std::optional<at::Tensor>& active_ranks);

  // This buffer's identity (random, non-zero), published with its IPC handle.
  int64_t nonce() const { return static_cast<int64_t>(nonce_); }
  // How the ranks reach each other (per pair: NVLink, proxy or IBGDA) as a number; the ranks
  // of one buffer agree on it unless a replacement process found another arrangement.
  int64_t pairsHash() const { return static_cast<int64_t>(pairs_hash_); }
  // Membership change, in two steps that every active rank takes, with a barrier between
  // them (buffer.py's update_members):
  // settle(): waits for this rank's kernels and for what its CPU proxy still carries, and
  //   destroys its IBGDA queue pairs (a NIC may hold WRITEs no kernel waited for), masking
  //   those peers out until they are connected again; once every rank has settled, nothing
  //   more lands in any rank's buffer or inbox.
  // updateMembers(): connects every active rank whose process this buffer has not connected
  //   (`nonces[r]`: the identity of rank r's buffer, 0 for inactive ranks): maps its buffer
  //   (NVLink, emulated NIC), opens its proxy inbox, and connects new IBGDA queue pairs to
  //   every IBGDA peer (`generation`: a number the ranks agree on, new at each call); then
  //   clears the buffer and inbox, restarts at half 0 and takes `mask` as the active ranks.
  // A process that joins a running buffer (it replaces a failed rank) connects nobody in its
  // constructor; its updateMembers() connects every peer.
  void settle();
  void updateMembers(const std::vector<int64_t>& mask, const std::vector<int64_t>& nonces, int64_t generation);

  std::string transportOf(int rank) const;
  // The transfer-engine transport under a proxy peer ("shm" or "tcp"); "" for others.
  std::string proxyTransportOf(int rank) const;
  at::Tensor activeRanks() const { return active_; }
  // Benchmark aid: an int64 CUDA tensor of numSms() * kernels::kTracePoints entries that
  // later launches fill with per-block phase timestamps (ns); None stops it.
  void setTrace(const std::optional<at::Tensor>& trace);
  int numSms() const { return num_sms_; }
  const EpLayout& layout() const { return layout_; }
  int rank() const { return rank_; }

 private:
  // The constructor's steps (low_latency_buffer.cpp).
  void allocate();
  std::vector<std::string> publish(const std::vector<bool>& on);
  std::string choosePaths(const std::vector<std::string>& hosts, const std::vector<bool>& on,
                          const std::string& ib_mode);
  void connect(const std::vector<std::string>& hosts, const std::vector<bool>& on, bool joining,
               const std::string& ib_why);
  void finishSetup(const std::vector<bool>& on);
  kernels::Common common(int half, int64_t timeout_us, const std::optional<at::Tensor>& active_ranks, int phases) const;
  // proxy[a][b] / ibgda[a][b]: how rank a reaches rank b (neither: CUDA IPC).
  void drainIbgda() noexcept;
  void buildRoutes(const std::vector<std::vector<bool>>& proxy, const std::vector<std::vector<bool>>& ibgda);
  // IBGDA: the staging area, its registration, the queue-pair memory for the GPU, this
  // buffer's published registration (no queue pair yet).
  void prepareIbgda(const std::vector<std::vector<bool>>& ibgda);
  // Creates and connects queue pairs to `peers` (their identities in peer_nonce_): publishes
  // this end of each first, then reads the other ends (the peers do the same).
  void connectIbgda(const std::vector<int>& peers, int64_t generation);
  // Opens rank r's published buffer (its IPC handle) and records its identity; `expect` (if
  // non-zero) is the identity it must carry.
  void mapPeer(int r, uint64_t expect);
  // What rank r published of its buffer: its IPC handle and identity.
  struct IpcRecord {
    cudaIpcMemHandle_t handle;
    uint64_t nonce = 0;
  };
  IpcRecord ipcRecord(int r) const;
  // Clears, in the active mask, the entries of those of `ranks` that are not connected.
  void maskUnconnected(const std::vector<int>& ranks);
  // "nvlink", "proxy" or "ibgda": how this rank reaches active rank r.
  std::string pathTo(int r) const;

  int rank_, size_, device_;
  EpLayout layout_;
  char* buffer_ = nullptr;
  uint64_t buffer_bytes_ = 0;  // the layout's size, rounded up to 2 MiB (registrable as a dma-buf)
  int* scratch_ = nullptr;
  c10::intrusive_ptr<c10d::Store> store_;
  std::string key_;
  int ranks_per_host_ = 0;            // MOELINK_EP_RANKS_PER_HOST (0: real hosts only)
  uint64_t nonce_ = 0;
  std::vector<uint64_t> peer_nonce_;  // the identity of the buffer connected per peer
  std::vector<bool> connected_;       // per peer: its route is set up (for peer_nonce_'s process)
  uint64_t pairs_hash_ = 0;
  std::vector<std::vector<bool>> proxy_pairs_, ibgda_pairs_;
  std::vector<char*> peers_;           // NVLink peers' buffers (IPC mappings), own buffer
  kernels::PeerRoute* routes_dev_ = nullptr;  // [2][size]
  std::unique_ptr<EpProxy> proxy_;
  // IBGDA: the NIC, this rank's staging area ([half][peer] windows, registered), the queue
  // pairs (device memory, one per IBGDA peer, with their posting counters) and what the
  // peers published of their buffers.
  struct RemoteBuffer {
    uint64_t base = 0, bytes = 0;
    uint32_t rkey = 0;
  };
  struct EmulatedRemotes;
  std::unique_ptr<ibgda::Nic> nic_;
  std::shared_ptr<EmulatedRemotes> emulated_;
  std::vector<int> ibgda_peers_;
  std::vector<RemoteBuffer> remote_;
  char* staging_ = nullptr;
  uint64_t staging_bytes_ = 0;
  uint32_t staging_lkey_ = 0;
  uint32_t buffer_rkey_ = 0;
  ibgda::QueuePair* qps_dev_ = nullptr;
  char* qp_counters_ = nullptr;
  std::vector<std::string> transports_;
  at::Tensor active_;
  int num_sms_ = 0;
  int64_t round_ = 0;
  int64_t default_timeout_us_;
  bool use_tma_ = false;
  at::Tensor trace_;
};

}  // namespace moelink::ep
