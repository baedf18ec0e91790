#include "moelink/ep/low_latency_buffer.h"

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>

#include <unistd.h>

#include "cuda_check.h"
#include "moelink/common/error.h"
#include "moelink/common/settings.h"
#include "moelink/torch/c10d_store.h"
#include "moelink/ep/ibgda/nic.h"
#include "moelink/ep/ibgda/probe.h"
#include "moelink/ep/proxy.h"
#include "moelink/transfer/metadata_store.h"
#include "moelink/transfer/transfer_engine.h"

namespace moelink::ep {

namespace {

std::vector<uint8_t> bytesOf(const std::string& s) { return {s.begin(), s.end()}; }

uint64_t align(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// Where one source's messages land in a buffer half or inbox half, as offsets, in the order of
// the PeerRoute field lists below: its dispatch rows, slot entries and count column, the combine
// region and flags (shared by all sources), its route entries and route flag.
using Landing = std::array<uint64_t, 7>;

constexpr char* kernels::PeerRoute::*kRecvFields[] = {
    &kernels::PeerRoute::dispatch_recv, &kernels::PeerRoute::index_recv, &kernels::PeerRoute::count_recv,
    &kernels::PeerRoute::combine_recv,  &kernels::PeerRoute::flag_recv,  &kernels::PeerRoute::route_recv,
    &kernels::PeerRoute::route_flag_recv};
constexpr char* kernels::PeerRoute::*kSendFields[] = {
    &kernels::PeerRoute::dispatch_send, &kernels::PeerRoute::index_send, &kernels::PeerRoute::count_send,
    &kernels::PeerRoute::combine_send,  &kernels::PeerRoute::flag_send,  &kernels::PeerRoute::route_send,
    &kernels::PeerRoute::route_flag_send};
constexpr uint64_t kernels::PeerRoute::*kRemoteFields[] = {
    &kernels::PeerRoute::dispatch_remote, &kernels::PeerRoute::index_remote, &kernels::PeerRoute::count_remote,
    &kernels::PeerRoute::combine_remote,  &kernels::PeerRoute::flag_remote,  &kernels::PeerRoute::route_remote,
    &kernels::PeerRoute::route_flag_remote};

// Sets the route's fields to base + the landing's offsets.
template <typename Field, typename Base>
void place(kernels::PeerRoute& pr, const Field (&fields)[7], Base base, const Landing& at) {
  for (size_t i = 0; i < at.size(); ++i) pr.*fields[i] = base + at[i];
}

// Source s in a GPU buffer half.
Landing bufferLanding(const EpLayout& L, int s) {
  return {L.off_dispatch_x + s * L.dispatch_col_bytes,  L.off_dispatch_index + s * L.index_col_bytes,
          L.off_dispatch_count + s * L.countColBytes(), L.off_combine_x,
          L.off_combine_flag,                           L.off_combine_route + s * L.routeColBytes(),
          L.off_route_flag + s * kSignalBytes};
}

// Where things live in one half of a rank's proxy inbox, for `sources` proxy sources:
// their dispatch rows and slot entries, one combine_x region (rows from any proxy source),
// their count columns, the combine flags, their combine route entries and route flags.
struct InboxLayout {
  uint64_t off_index = 0, off_combine = 0, off_count = 0, off_flag = 0, off_route = 0, off_route_flag = 0, half = 0;
  InboxLayout(const EpLayout& L, int sources) {
    off_index = align(sources * L.dispatch_col_bytes, 128);
    off_combine = align(off_index + sources * L.index_col_bytes, 128);
    off_count = align(off_combine + L.combineRegionBytes(), 128);
    off_flag = align(off_count + sources * L.countColBytes(), 128);
    off_route = align(off_flag + L.flagRegionBytes(), 128);
    off_route_flag = align(off_route + sources * L.routeColBytes(), 128);
    half = align(off_route_flag + static_cast<uint64_t>(sources) * kSignalBytes, 4096);
  }
  // Proxy source j (the j-th of the rank's proxy sources) in a half.
  Landing of(const EpLayout& L, int j) const {
    return {j * L.dispatch_col_bytes,        off_index + j * L.index_col_bytes,
            off_count + j * L.countColBytes(), off_combine,
            off_flag,                          off_route + j * L.routeColBytes(),
            off_route_flag + j * kSignalBytes};
  }
};

// One half of a rank's outbox: per proxy peer, the dispatch rows, slot entries, combine_x
// region and combine route entries that the peer's inbox receives from this rank.
uint64_t outboxWindow(const EpLayout& L) {
  return align(L.dispatch_col_bytes + L.index_col_bytes + L.combineRegionBytes() + L.routeColBytes(), 128);
}

int indexOf(const std::vector<bool>& row, int r) {
  int i = 0;
  for (int q = 0; q < r; ++q) i += row[q];
  return i;
}

int countOf(const std::vector<bool>& row) { return indexOf(row, static_cast<int>(row.size())); }

}  // namespace

// What the emulated NIC needs to carry a WRITE: every IBGDA peer's CUDA IPC mapping and the
// address range and key it published.
struct LowLatencyBuffer::EmulatedRemotes {
  struct Peer {
    char* map = nullptr;
    uint64_t base = 0, bytes = 0;
  };
  std::vector<Peer> peers;
  explicit EmulatedRemotes(int size) : peers(size) {}
  void* resolve(uint32_t rkey, uint64_t addr, uint64_t bytes) const {
    const uint64_t r = rkey - ibgda::kEmulatedKeyBase;
    if (r >= peers.size() || peers[r].map == nullptr) return nullptr;
    const Peer& p = peers[r];
    if (addr < p.base || addr + bytes > p.base + p.bytes) return nullptr;
    return p.map + (addr - p.base);
  }
};

LowLatencyBuffer::LowLatencyBuffer(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                   const std::string& key, int64_t max_tokens, int64_t hidden, int64_t num_experts,
                                   const std::vector<int64_t>& active)
    : rank_(rank), size_(size), store_(store), key_(key) {
  TORCH_CHECK_VALUE(active.empty() || static_cast<int>(active.size()) == size, "moelink Buffer: the active mask has ",
                    active.size(), " entries for a group of ", size);
  std::vector<bool> on(size, true);
  for (int r = 0; r < static_cast<int>(active.size()); ++r) on[r] = active[r] != 0;
  TORCH_CHECK_VALUE(on[rank], "moelink Buffer: rank ", rank, " is not active in the group");
  try {
    layout_ = EpLayout::make(size, static_cast<int>(num_experts), static_cast<int>(max_tokens),
                             static_cast<int>(hidden));
  } catch (const std::exception& e) {
    TORCH_CHECK_VALUE(false, "moelink Buffer: ", e.what());
  }
  std::string ib_mode;
  try {
    // How long a receiver waits for a source before masking it out when the call passes
    // timeout_us=-1; dispatch messages to NVLink peers go as bulk copies (TMA), measured faster
    // than warp stores (docs/PERF.md), unless MOELINK_EP_TMA=0.
    default_timeout_us_ = static_cast<int64_t>(settings::number("MOELINK_EP_TIMEOUT_US"));
    use_tma_ = settings::flag("MOELINK_EP_TMA");
    ranks_per_host_ = static_cast<int>(settings::number("MOELINK_EP_RANKS_PER_HOST"));
    ib_mode = settings::text("MOELINK_EP_IBGDA");
  } catch (const moelink::Error& e) {
    TORCH_CHECK_VALUE(false, "moelink Buffer: ", e.what());
  }
  allocate();
  // A buffer that the active ranks created before this rank's process existed (this process
  // replaces a failed rank): no rank can count itself mapped before every rank has published,
  // so a count already there means this rank joins. It connects to nobody here and waits for
  // nobody: its update_members() (with the others') connects every pair.
  const bool joining = store->check({key + "/mapped"}) && store->add(key + "/mapped", 0) > 0;
  const std::vector<std::string> hosts = publish(on);
  std::string ib_why = choosePaths(hosts, on, ib_mode);
  connect(hosts, on, joining, ib_why);
  finishSetup(on);
}

// The device memory: the buffer (both halves) and the kernels' scratch, zeroed.
void LowLatencyBuffer::allocate() {
  cudaCheck(cudaGetDevice(&device_), "cudaGetDevice");
  try {
    kernels::preloadDispatch();  // not at a first launch that could wait for running kernels
    kernels::preloadCombine();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "moelink Buffer: ", e.what());
  }
  cudaCheck(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device_), "SM count");
  buffer_bytes_ = align(layout_.totalBytes(), 2u << 20);
  cudaCheck(cudaMalloc(&buffer_, buffer_bytes_), "cudaMalloc(buffer)");
  cudaCheck(cudaMemset(buffer_, 0, buffer_bytes_), "cudaMemset(buffer)");
  int scratch = kernels::scratchInts(layout_);
  cudaCheck(cudaMalloc(&scratch_, scratch * sizeof(int)), "cudaMalloc(scratch)");
  cudaCheck(cudaMemset(scratch_, 0, scratch * sizeof(int)), "cudaMemset(scratch)");

}

// Publishes this rank's buffer (CUDA IPC handle, with a nonce naming this process's buffer) and
// host id through the group's store; returns the active ranks' host ids.
std::vector<std::string> LowLatencyBuffer::publish(const std::vector<bool>& on) {
  const int size = size_, rank = rank_;
  const std::string& key = key_;
  const c10::intrusive_ptr<c10d::Store>& store = store_;
  {
    std::random_device rd;
    while (nonce_ == 0)
      nonce_ = ((static_cast<uint64_t>(rd()) << 32 | rd()) ^ static_cast<uint64_t>(getpid())) & ((1ull << 62) - 1);
  }
  cudaIpcMemHandle_t handle;
  cudaCheck(cudaIpcGetMemHandle(&handle, buffer_), "cudaIpcGetMemHandle");
  std::string mine(reinterpret_cast<const char*>(&handle), sizeof handle);
  mine.append(reinterpret_cast<const char*>(&nonce_), sizeof nonce_);
  store->set(key + "/ipc/" + std::to_string(rank), bytesOf(mine));
  store->set(key + "/host/" + std::to_string(rank), bytesOf(transfer::localHostId()));
  std::vector<std::string> hosts(size);
  for (int r = 0; r < size; ++r) {
    if (!on[r]) continue;
    auto h = store->get(key + "/host/" + std::to_string(r));
    hosts[r] = std::string(h.begin(), h.end());
  }
  return hosts;
}

// Which path each pair of active ranks takes: NVLink on one (virtual) host; across hosts IBGDA
// where both ends have a NIC it can use (agreed through the store), else the CPU proxy. Sets
// proxy_pairs_ and ibgda_pairs_; returns why this rank's cross-host pairs do not take IBGDA.
std::string LowLatencyBuffer::choosePaths(const std::vector<std::string>& hosts, const std::vector<bool>& on,
                                          const std::string& ib_mode) {
  const int size = size_, rank = rank_, rph = ranks_per_host_;
  const std::string& key = key_;
  const c10::intrusive_ptr<c10d::Store>& store = store_;
  // proxy[a][b]: a and b are different active ranks on different (possibly virtual) hosts;
  // such a pair takes IBGDA instead (ibgda[a][b]) when both ends have a NIC for it.
  std::vector<std::vector<bool>> proxy(size, std::vector<bool>(size, false));
  for (int a = 0; a < size; ++a)
    for (int b = 0; b < size; ++b)
      proxy[a][b] = a != b && on[a] && on[b] && (hosts[a] != hosts[b] || (rph > 0 && a / rph != b / rph));
  // MOELINK_EP_IBGDA: auto (the mlx5 NIC when there is one), off, or emulate (the emulated
  // NIC, for testing the GPU side of IBGDA on one host).
  bool cross = false;
  for (int r = 0; r < size; ++r) cross = cross || proxy[rank][r];
  std::string ib_why = ib_mode == "off" ? "MOELINK_EP_IBGDA=off" : "";
  if (cross && ib_mode == "emulate") {
    for (int r = 0; r < size; ++r)
      TORCH_CHECK_VALUE(hosts[r] == hosts[rank], "moelink Buffer: MOELINK_EP_IBGDA=emulate needs every rank on one "
                        "host (the emulated NIC writes through CUDA IPC), but rank ", r, " is on another");
    emulated_ = std::make_shared<EmulatedRemotes>(size);
    auto remotes = emulated_;
    nic_ = ibgda::makeEmulatedNic(device_, rank, [remotes](uint32_t rkey, uint64_t addr, uint64_t bytes) {
      return remotes->resolve(rkey, addr, bytes);
    });
  } else if (cross && ib_mode == "auto") {
    nic_ = ibgda::openVerbsNic(device_, &ib_why);
  }
  if (nic_) {
    // Registering GPU memory is what most often fails (no dma-buf support, no
    // nvidia_peermem): try it before telling the peers, so that this rank falls back to
    // the proxy instead of failing the buffer.
    try {
      buffer_rkey_ = nic_->registerMemory(buffer_, buffer_bytes_).rkey;
    } catch (const std::exception& e) {
      ib_why = e.what();
      nic_.reset();
      emulated_.reset();
    }
  }
  // Collective: a pair takes IBGDA only if both ends can.
  store->set(key + "/ibgda_ok/" + std::to_string(rank), bytesOf(nic_ ? "1" : "0"));
  std::vector<std::vector<bool>> ibgda(size, std::vector<bool>(size, false));
  {
    std::vector<bool> ok(size);
    for (int r = 0; r < size; ++r) {
      if (!on[r]) continue;
      auto v = store->get(key + "/ibgda_ok/" + std::to_string(r));
      ok[r] = v.size() == 1 && v[0] == '1';
    }
    for (int a = 0; a < size; ++a)
      for (int b = 0; b < size; ++b)
        if (proxy[a][b] && ok[a] && ok[b]) {
          ibgda[a][b] = true;
          proxy[a][b] = false;
        }
    for (int r = 0; r < size; ++r)
      if (proxy[rank][r] && !ok[r] && ib_why.empty()) ib_why = "rank " + std::to_string(r) + " has no IBGDA NIC";
  }
  bool any_ibgda = false;
  for (int r = 0; r < size; ++r) any_ibgda = any_ibgda || ibgda[rank][r];
  if (!any_ibgda) {  // no peer could take it up
    nic_.reset();
    emulated_.reset();
  }
  proxy_pairs_ = proxy;
  ibgda_pairs_ = ibgda;
  pairs_hash_ = 1469598103934665603ull;  // FNV-1a over the pairs' paths
  for (int a = 0; a < size; ++a)
    for (int b = 0; b < size; ++b) pairs_hash_ = (pairs_hash_ ^ (proxy[a][b] + 2u * ibgda[a][b])) * 1099511628211ull;
  pairs_hash_ &= (1ull << 62) - 1;
  return ib_why;
}

// Maps (or readies) every active peer on its path: NVLink peers over CUDA IPC, IBGDA peers'
// queue pairs, the CPU proxy's engine (every rank takes part in its rendezvous).
void LowLatencyBuffer::connect(const std::vector<std::string>& hosts, const std::vector<bool>& on, bool joining,
                               const std::string& ib_why) {
  const int size = size_, rank = rank_;
  const std::string& key = key_;
  const c10::intrusive_ptr<c10d::Store>& store = store_;
  const auto& proxy = proxy_pairs_;
  const auto& ibgda = ibgda_pairs_;
  bool any_proxy = false, any_ibgda = false;
  for (int a = 0; a < size; ++a)
    for (int b = 0; b < size; ++b) any_proxy = any_proxy || proxy[a][b];
  for (int r = 0; r < size; ++r) any_ibgda = any_ibgda || ibgda[rank][r];
  peers_.assign(size, nullptr);
  peer_nonce_.assign(size, 0);
  connected_.assign(size, false);
  transports_.assign(size, "");
  for (int r = 0; r < size; ++r) {
    if (r == rank) {
      peers_[r] = buffer_;
      peer_nonce_[r] = nonce_;
      connected_[r] = true;
      transports_[r] = "local";
    } else if (!on[r] || joining) {
      transports_[r] = "inactive";  // unconnected until updateMembers() finds it active
    } else {
      transports_[r] = pathTo(r);
      if (proxy[rank][r] || (ibgda[rank][r] && !emulated_)) {
        // Connected below (only the emulated NIC writes through CUDA IPC).
        peer_nonce_[r] = ipcRecord(r).nonce;
        connected_[r] = proxy[rank][r];
      } else {
        mapPeer(r, 0);
        connected_[r] = !ibgda[rank][r];
      }
    }
  }
  bool other_host_proxy = false;
  for (int r = 0; r < size; ++r) other_host_proxy = other_host_proxy || (hosts[r] != hosts[rank] && proxy[rank][r]);
  if (other_host_proxy) {
    TORCH_WARN_ONCE("moelink Buffer: ranks on other hosts are reached through the CPU proxy, not IBGDA (",
                    ib_why.empty() ? ibgda::probe().reason : ib_why, ")");
  }
  if (any_ibgda) {
    try {
      prepareIbgda(ibgda);
      if (!joining) connectIbgda(ibgda_peers_, 0);
    } catch (const c10::Error&) {
      throw;
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "moelink Buffer: could not set up IBGDA: ", e.what());
    }
  }
  if (any_proxy) {
    // Every rank takes part (the engines' rendezvous), also one without proxy peers.
    std::vector<int> mine_peers;
    for (int r = 0; r < size; ++r)
      if (proxy[rank][r]) mine_peers.push_back(r);
    const int sources = static_cast<int>(mine_peers.size());
    const uint64_t inbox = 2 * InboxLayout(layout_, sources).half;
    const uint64_t outbox = 2 * sources * outboxWindow(layout_);
    auto ms = std::make_shared<transfer::PrefixStore>(key + "/proxy/", std::make_shared<C10dStore>(store));
    try {
      proxy_ = std::make_unique<EpProxy>(ms, rank, size, mine_peers, inbox, outbox,
                                         std::chrono::duration_cast<std::chrono::milliseconds>(store->getTimeout()),
                                         joining);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "moelink Buffer: could not set up the CPU proxy path: ", e.what());
    }
  }
}

// The kernels' routes and the active mask on the device; then every active rank waits until
// every one has mapped every peer (the store doubles as barrier; a joining rank finds the count
// reached).
void LowLatencyBuffer::finishSetup(const std::vector<bool>& on) {
  const int size = size_;
  int num_on = 0;
  for (int r = 0; r < size; ++r) num_on += on[r];
  buildRoutes(proxy_pairs_, ibgda_pairs_);
  {
    std::vector<int> mask(size);
    for (int r = 0; r < size; ++r) mask[r] = on[r] && connected_[r];
    active_ = at::tensor(mask, at::kInt).to(at::Device(at::kCUDA, device_));
  }
  cudaCheck(cudaDeviceSynchronize(), "buffer setup");
  store_->add(key_ + "/mapped", 1);
  auto deadline = std::chrono::steady_clock::now() + store_->getTimeout();
  while (store_->add(key_ + "/mapped", 0) < num_on) {
    TORCH_CHECK(std::chrono::steady_clock::now() < deadline,
                "moelink Buffer: timed out waiting for every rank to create its buffer (a collective call)");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void LowLatencyBuffer::prepareIbgda(const std::vector<std::vector<bool>>& ibgda) {
  for (int r = 0; r < size_; ++r)
    if (ibgda[rank_][r]) ibgda_peers_.push_back(r);
  const int n = static_cast<int>(ibgda_peers_.size());
  staging_bytes_ = align(2ull * n * outboxWindow(layout_), 2u << 20);
  cudaCheck(cudaMalloc(&staging_, staging_bytes_), "cudaMalloc(IBGDA staging)");
  cudaCheck(cudaMemset(staging_, 0, staging_bytes_), "cudaMemset(IBGDA staging)");
  staging_lkey_ = nic_->registerMemory(staging_, staging_bytes_).lkey;
  // The posting threads' counters, each on its own line, and the queue pairs (zero until
  // connected: no kernel posts to an unconnected peer, which is masked out).
  cudaCheck(cudaMalloc(&qp_counters_, 3ull * n * ibgda::kCounterStride), "cudaMalloc(IBGDA counters)");
  cudaCheck(cudaMemset(qp_counters_, 0, 3ull * n * ibgda::kCounterStride), "cudaMemset(IBGDA counters)");
  cudaCheck(cudaMalloc(&qps_dev_, n * sizeof(ibgda::QueuePair)), "cudaMalloc(IBGDA queue pairs)");
  cudaCheck(cudaMemset(qps_dev_, 0, n * sizeof(ibgda::QueuePair)), "cudaMemset(IBGDA queue pairs)");
  remote_.assign(size_, RemoteBuffer{});
  const uint64_t rec[3] = {reinterpret_cast<uint64_t>(buffer_), buffer_bytes_, buffer_rkey_};
  store_->set(key_ + "/ibgda/mr/" + std::to_string(rank_) + "." + std::to_string(nonce_),
              std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(rec), reinterpret_cast<const uint8_t*>(rec) + sizeof rec));
}

void LowLatencyBuffer::connectIbgda(const std::vector<int>& peers, int64_t generation) {
  // One record per ordered pair of processes and call: a new process never reads the address
  // its predecessor was given, and a later call never reads an earlier one's.
  const auto qpKey = [&](int from, int to) {
    return key_ + "/ibgda/qp/" + std::to_string(from) + "/" + std::to_string(to) + "/" + std::to_string(generation) +
           "/" + std::to_string(peer_nonce_[from]) + "." + std::to_string(peer_nonce_[to]);
  };
  for (int r : peers) store_->set(qpKey(rank_, r), nic_->createQueuePair(r));
  for (int r : peers) {
    auto v = store_->get(key_ + "/ibgda/mr/" + std::to_string(r) + "." + std::to_string(peer_nonce_[r]));
    TORCH_CHECK(v.size() == 3 * sizeof(uint64_t), "moelink Buffer: bad IBGDA buffer record from rank ", r);
    uint64_t rec[3];
    std::memcpy(rec, v.data(), sizeof rec);
    remote_[r] = {rec[0], rec[1], static_cast<uint32_t>(rec[2])};
    if (emulated_) emulated_->peers[r] = {peers_[r], rec[0], rec[1]};
    ibgda::QueuePair qp = nic_->connect(r, store_->get(qpKey(r, rank_)));
    const int j = static_cast<int>(std::find(ibgda_peers_.begin(), ibgda_peers_.end(), r) - ibgda_peers_.begin());
    TORCH_CHECK(j < static_cast<int>(ibgda_peers_.size()), "moelink Buffer: rank ", r, " is not an IBGDA peer");
    char* c = qp_counters_ + 3ull * j * ibgda::kCounterStride;
    qp.sq.tickets = reinterpret_cast<uint64_t*>(c);
    qp.sq.ready = reinterpret_cast<uint64_t*>(c + ibgda::kCounterStride);
    qp.sq.completed = reinterpret_cast<uint64_t*>(c + 2 * ibgda::kCounterStride);
    cudaCheck(cudaMemset(c, 0, 3ull * ibgda::kCounterStride), "cudaMemset(IBGDA counters)");
    cudaCheck(cudaMemcpy(qps_dev_ + j, &qp, sizeof qp, cudaMemcpyHostToDevice), "IBGDA queue pair copy");
    connected_[r] = true;
  }
}

void LowLatencyBuffer::buildRoutes(const std::vector<std::vector<bool>>& proxy, const std::vector<std::vector<bool>>& ibgda) {
  const EpLayout& L = layout_;
  std::vector<kernels::PeerRoute> routes(2 * size_);
  const InboxLayout in_me(L, countOf(proxy[rank_]));
  const uint64_t window = outboxWindow(L);
  for (int h = 0; h < 2; ++h) {
    char* my_half = buffer_ + h * L.half_bytes;
    for (int r = 0; r < size_; ++r) {
      kernels::PeerRoute& pr = routes[h * size_ + r];
      // Sends that are posted (proxy outbox, IBGDA staging) are written into a window of
      // this rank's dispatch rows, slot entries and the peer's combine region.
      const auto set_window = [&](char* w) {
        pr.dispatch_send = w;
        pr.index_send = w + L.dispatch_col_bytes;
        pr.combine_send = w + L.dispatch_col_bytes + L.index_col_bytes;
        pr.route_send = pr.combine_send + L.combineRegionBytes();
      };
      if (!proxy[rank_][r]) {
        // Receives land in this rank's own buffer (from itself, NVLink and IBGDA peers), sends
        // in the peer's buffer half.
        place(pr, kRecvFields, my_half, bufferLanding(L, r));
        const Landing there = bufferLanding(L, rank_);
        if (!ibgda[rank_][r]) {  // stores through the mapping (none while the peer is unmapped)
          if (peers_[r] != nullptr) place(pr, kSendFields, peers_[r] + h * L.half_bytes, there);
          continue;
        }
        // IBGDA: the staging window for (half, peer), posted as WRITEs to the peer's buffer.
        const int j = indexOf(ibgda[rank_], r);
        set_window(staging_ + (static_cast<uint64_t>(h) * ibgda_peers_.size() + j) * window);
        place(pr, kRemoteFields, remote_[r].base + h * L.half_bytes, there);
        pr.qp = qps_dev_ + j;
        pr.lkey = staging_lkey_;
        pr.rkey = remote_[r].rkey;
        continue;
      }
      pr.proxy = 1;
      const int j = indexOf(proxy[rank_], r);      // r among this rank's proxy peers
      const int jm = indexOf(proxy[r], rank_);     // this rank among r's proxy peers
      const InboxLayout in_r(L, countOf(proxy[r]));
      set_window(proxy_->outbox() + (static_cast<uint64_t>(h) * countOf(proxy[rank_]) + j) * window);
      place(pr, kRemoteFields, h * in_r.half, in_r.of(L, jm));
      place(pr, kRecvFields, proxy_->inbox() + h * in_me.half, in_me.of(L, j));
    }
  }
  if (routes_dev_ == nullptr)
    cudaCheck(cudaMalloc(&routes_dev_, routes.size() * sizeof(kernels::PeerRoute)), "cudaMalloc(routes)");
  cudaCheck(cudaMemcpy(routes_dev_, routes.data(), routes.size() * sizeof(kernels::PeerRoute), cudaMemcpyHostToDevice),
            "routes copy");
}

LowLatencyBuffer::IpcRecord LowLatencyBuffer::ipcRecord(int r) const {
  auto b = store_->get(key_ + "/ipc/" + std::to_string(r));
  TORCH_CHECK(b.size() == sizeof(cudaIpcMemHandle_t) + sizeof(uint64_t), "moelink Buffer: bad IPC record from rank ", r);
  IpcRecord rec;
  std::memcpy(&rec.handle, b.data(), sizeof rec.handle);
  std::memcpy(&rec.nonce, b.data() + sizeof rec.handle, sizeof rec.nonce);
  return rec;
}

void LowLatencyBuffer::maskUnconnected(const std::vector<int>& ranks) {
  at::Tensor keep = active_.cpu();
  for (int r : ranks)
    if (!connected_[r]) keep[r].fill_(0);
  active_.copy_(keep);
}

std::string LowLatencyBuffer::pathTo(int r) const {
  return proxy_pairs_[rank_][r] ? "proxy" : ibgda_pairs_[rank_][r] ? "ibgda" : "nvlink";
}

void LowLatencyBuffer::mapPeer(int r, uint64_t expect) {
  const IpcRecord rec = ipcRecord(r);
  TORCH_CHECK(expect == 0 || rec.nonce == expect, "moelink Buffer.update_members: rank ", r,
              " published another buffer than the one it reports (did every rank create its Buffers in the same "
              "order?)");
  void* p = nullptr;
  cudaCheck(cudaIpcOpenMemHandle(&p, rec.handle, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  peers_[r] = static_cast<char*>(p);
  peer_nonce_[r] = rec.nonce;
}

void LowLatencyBuffer::settle() {
  c10::cuda::CUDAGuard guard(device_);
  cudaCheck(cudaDeviceSynchronize(), "update_members: the rounds in flight");
  TORCH_CHECK(!proxy_ || proxy_->settle(), "moelink Buffer.update_members: the CPU proxy did not deliver what the "
              "GPU posted within the group's timeout");
  if (!nic_) return;
  // Masked out until updateMembers() connects them again (also if it never comes: a failure
  // on another rank), so that no kernel posts on a queue pair that is gone.
  for (int r : ibgda_peers_) {
    if (!connected_[r]) continue;
    nic_->destroyQueuePair(r);
    connected_[r] = false;
    transports_[r] = "inactive";
  }
  maskUnconnected(ibgda_peers_);
  cudaCheck(cudaDeviceSynchronize(), "update_members: masking the IBGDA peers");
}

void LowLatencyBuffer::updateMembers(const std::vector<int64_t>& mask, const std::vector<int64_t>& nonces,
                             int64_t generation) {
  TORCH_CHECK_VALUE(static_cast<int>(mask.size()) == size_ && static_cast<int>(nonces.size()) == size_,
                    "moelink Buffer.update_members: the mask and the identities need ", size_, " entries each");
  TORCH_CHECK_VALUE(mask[rank_] != 0, "moelink Buffer.update_members: rank ", rank_, " is not active in the group");
  c10::cuda::CUDAGuard guard(device_);
  cudaCheck(cudaDeviceSynchronize(), "update_members: the rounds in flight");
  // The active ranks this buffer has not connected: new processes (another identity), peers a
  // joining process has not connected yet, and IBGDA peers (settle() closed their queue pairs).
  std::vector<int> changed;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_ || mask[r] == 0) continue;
    TORCH_CHECK_VALUE(nonces[r] != 0, "moelink Buffer.update_members: active rank ", r, " reports no GPU buffer");
    if (!connected_[r] || static_cast<uint64_t>(nonces[r]) != peer_nonce_[r]) changed.push_back(r);
  }
  try {
    std::vector<int> ib;
    for (int r : changed) {
      const uint64_t nonce = static_cast<uint64_t>(nonces[r]);
      const std::string path = pathTo(r);
      const bool renewed = nonce != peer_nonce_[r];
      connected_[r] = false;
      transports_[r] = "inactive";
      if ((path == "nvlink" || (path == "ibgda" && emulated_)) && (renewed || peers_[r] == nullptr)) {
        if (peers_[r] != nullptr) cudaIpcCloseMemHandle(peers_[r]);  // the failed process's buffer
        peers_[r] = nullptr;
        mapPeer(r, nonce);
      }
      if (path == "proxy") proxy_->reopen(r);  // forgets the old process, opens the new one's inbox
      peer_nonce_[r] = nonce;
      if (path == "ibgda") {
        ib.push_back(r);
      } else {
        connected_[r] = true;
        transports_[r] = path;
      }
    }
    if (!ib.empty()) {
      connectIbgda(ib, generation);
      for (int r : ib) transports_[r] = "ibgda";
    }
  } catch (...) {
    // A rank left unconnected is masked out and routed nowhere, never through a closed mapping.
    maskUnconnected(changed);
    buildRoutes(proxy_pairs_, ibgda_pairs_);
    cudaDeviceSynchronize();
    throw;
  }
  if (!changed.empty()) buildRoutes(proxy_pairs_, ibgda_pairs_);
  // Every rank has settled (the caller's barrier follows settle()), so nothing is on its way:
  // start the next round from clean signals, half 0.
  cudaCheck(cudaMemset(buffer_, 0, buffer_bytes_), "update_members: clearing the buffer");
  cudaCheck(cudaMemset(scratch_, 0, kernels::scratchInts(layout_) * sizeof(int)), "update_members: clearing scratch");
  if (proxy_) proxy_->clearInbox();
  round_ = 0;
  std::vector<int> m(mask.begin(), mask.end());
  for (int& v : m) v = v != 0;
  active_.copy_(at::tensor(m, at::kInt));
  cudaCheck(cudaDeviceSynchronize(), "update_members");
}

// Teardown with IBGDA peers: the last round's last WRITEs may still be in flight at the NIC,
// and with selective signaling they ask for no completion; destroying the queue pairs now
// could cut them (the peers would then time out and mask this rank). Reads back where the
// kernels left each queue pair and has the NIC complete everything posted on it.
void LowLatencyBuffer::drainIbgda() noexcept {
  const int n = static_cast<int>(ibgda_peers_.size());
  if (!nic_ || n == 0 || qps_dev_ == nullptr || qp_counters_ == nullptr) return;
  std::vector<ibgda::QueuePair> qps(n);
  std::vector<char> counters(3ull * n * ibgda::kCounterStride);
  if (cudaMemcpy(qps.data(), qps_dev_, n * sizeof(ibgda::QueuePair), cudaMemcpyDeviceToHost) != cudaSuccess ||
      cudaMemcpy(counters.data(), qp_counters_, counters.size(), cudaMemcpyDeviceToHost) != cudaSuccess)
    return;
  for (int j = 0; j < n; ++j) {
    if (!connected_[ibgda_peers_[j]]) continue;  // no queue pair (settle() closed it)
    const char* c = counters.data() + 3ull * j * ibgda::kCounterStride;
    ibgda::QueueProgress p;
    std::memcpy(&p.posted, c + ibgda::kCounterStride, sizeof p.posted);         // ready
    std::memcpy(&p.completed, c + 2 * ibgda::kCounterStride, sizeof p.completed);  // completed
    p.cq_consumer = qps[j].cq.consumer;
    p.signal_mask = qps[j].signal_mask;
    p.failed = qps[j].error != 0;
    try {  // (a warning may throw where warnings are errors)
      std::string why;
      if (!nic_->drain(ibgda_peers_[j], p, 2000, &why))
        TORCH_WARN("moelink Buffer: the IBGDA queue pair to rank ", ibgda_peers_[j],
                   " was not drained at teardown (", why, "); its last writes may be lost");
    } catch (...) {
    }
  }
}

LowLatencyBuffer::~LowLatencyBuffer() {
  cudaDeviceSynchronize();
  drainIbgda();
  proxy_.reset();
  nic_.reset();  // before the memory it registered (the emulated NIC finishes what is posted)
  for (int r = 0; r < size_; ++r)
    if (r != rank_ && peers_[r]) cudaIpcCloseMemHandle(peers_[r]);
  cudaFree(qps_dev_);
  cudaFree(qp_counters_);
  cudaFree(staging_);
  cudaFree(routes_dev_);
  cudaFree(scratch_);
  cudaFree(buffer_);
}

}  // namespace moelink::ep
