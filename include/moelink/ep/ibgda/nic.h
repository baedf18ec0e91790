// The NIC side of IBGDA, as the EP buffer sees it: memory registration, one RC queue pair per
// peer, and the queues' memory for the GPU threads that post on them (queue.h).
//
// Two implementations:
// - the mlx5 NIC through rdma-core (src/ep/ibgda/verbs_nic.cpp), built as its own shared
//   object `moelink_ibgda.so` next to the Python module and loaded with dlopen, so that the
//   module itself never needs libibverbs: without rdma-core or an mlx5 device, opening fails
//   with the reason, and peers on other hosts take the CPU proxy;
// - an emulated NIC (emulated_nic.cpp) that executes the WRITEs it reads from the same queues
//   with CUDA copies into the peers' buffers (CUDA IPC mappings), for testing the GPU side of
//   IBGDA where no RDMA NIC is present (MOELINK_EP_IBGDA=emulate, ranks of one host).
//
// Queues: the send queue, the completion queue and both doorbell records live in pinned host
// memory mapped into the GPU (rdma-core's mlx5 provider allocates them through a parent
// domain's allocator); the doorbell register (UAR) is mapped into the GPU as I/O memory. GPU
// threads write WQEs over PCIe and the NIC reads them from host memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moelink/ep/ibgda/queue.h"

namespace moelink::ep::ibgda {

struct MemoryKeys {
  uint32_t lkey = 0;
  uint32_t rkey = 0;
};

// Where a queue pair's GPU posters left it (read back from the GPU after the kernels).
struct QueueProgress {
  uint64_t posted = 0;       // WQEs posted (`ready`)
  uint64_t completed = 0;    // WQEs known completed
  uint64_t cq_consumer = 0;  // CQEs consumed
  uint32_t signal_mask = 0;
  bool failed = false;       // an error completion was seen
};

class Nic {
 public:
  virtual ~Nic() = default;
  // "emulated", or the device and port ("mlx5_0:1").
  virtual std::string name() const = 0;
  // Registers [ptr, ptr + bytes) of GPU memory for local reads and remote writes.
  virtual MemoryKeys registerMemory(void* ptr, size_t bytes) = 0;
  // Creates the queue pair to `peer`; returns this end's address for the peer (opaque bytes).
  // One the peer already has is destroyed first (a readmitted peer gets a new queue pair).
  virtual std::vector<uint8_t> createQueuePair(int peer) = 0;
  // Destroys the queue pair to `peer`, if any, once no kernel posts on it: what was posted and
  // not yet carried out is dropped, and nothing more arrives through it at the peer.
  virtual void destroyQueuePair(int peer) = 0;
  // Connects the queue pair to the peer's end (its createQueuePair() bytes) and returns the
  // queues for the GPU: device addresses, `tickets`, `ready` and `completed` left unset.
  virtual QueuePair connect(int peer, const std::vector<uint8_t>& remote) = 0;
  // Waits until the NIC has completed every WQE posted on the queue pair to `peer`, once no
  // kernel posts any more (teardown; drainQp() in queue.h). False, with the reason, if it
  // failed or `timeout_ms` passed. The emulated NIC has nothing to do here: it carries out
  // everything it was handed before it is destroyed.
  virtual bool drain(int peer, const QueueProgress& progress, int timeout_ms, std::string* why_not) {
    return true;
  }
  // Destroyed once the kernels that post on the queues are done (the buffer is going away).
};

// Opens the mlx5 NIC that MOELINK_IBGDA_DEVICE names ("mlx5_0" or "mlx5_0:1"), else the
// first mlx5 device with an active port (not necessarily the one nearest the GPU: a host with
// several NICs should name it). Returns nullptr and the reason when the plugin, rdma-core, a
// device or a way to register GPU memory (dma-buf or nvidia_peermem) is missing.
std::unique_ptr<Nic> openVerbsNic(int cuda_device, std::string* why_not);

// Translates a WRITE's remote key and address to where this process reaches it (the peer's
// CUDA IPC mapping); nullptr when the key is unknown or the range outside its registration.
using RemoteResolver = std::function<void*(uint32_t rkey, uint64_t addr, uint64_t bytes)>;

// The emulated NIC: `rkey_base + rank` is the rank's remote key.
std::unique_ptr<Nic> makeEmulatedNic(int cuda_device, int rank, RemoteResolver resolve);
constexpr uint32_t kEmulatedKeyBase = 0xe0000000u;

// Allocation of the queue-pair bookkeeping the posting GPU threads share (`tickets`, `ready`,
// `completed`): zeroed device memory, 3 counters per queue pair on their own lines.
constexpr size_t kCounterStride = 128;

}  // namespace moelink::ep::ibgda

// The C entry points of moelink_ibgda.so (verbs_nic.cpp); C so that nothing of the C++
// runtime crosses the dlopen boundary (the Python module links its own libstdc++).
extern "C" {
struct moelink_ibgda_queues {
  unsigned char* wqes;     // device addresses
  uint32_t sq_depth;
  uint32_t qpn;
  uint32_t* sq_dbr;
  uint64_t* doorbell;
  unsigned char* cqes;
  uint32_t cq_depth;
  uint32_t* cq_dbr;
};
// Each returns 0 on success, else writes a message into err (errlen bytes).
// `device`: "mlx5_0" or "mlx5_0:1" (nullptr: the first active); `gid_index` < 0: a RoCE v2 GID.
typedef int (*moelink_ibgda_open_fn)(const char* device, int gid_index, int cuda_device, void** ctx, char* name,
                                     size_t namelen, char* err, size_t errlen);
typedef int (*moelink_ibgda_reg_fn)(void* ctx, void* ptr, size_t bytes, uint32_t* lkey, uint32_t* rkey, char* err,
                                    size_t errlen);
typedef int (*moelink_ibgda_create_qp_fn)(void* ctx, int peer, unsigned char* addr, size_t* addrlen, char* err,
                                          size_t errlen);
typedef int (*moelink_ibgda_connect_fn)(void* ctx, int peer, const unsigned char* addr, size_t addrlen,
                                        struct moelink_ibgda_queues* out, char* err, size_t errlen);
typedef void (*moelink_ibgda_close_fn)(void* ctx);
typedef void (*moelink_ibgda_destroy_qp_fn)(void* ctx, int peer);
struct moelink_ibgda_progress {  // moelink::ep::ibgda::QueueProgress
  uint64_t posted;
  uint64_t completed;
  uint64_t cq_consumer;
  uint32_t signal_mask;
  uint32_t failed;
};
typedef int (*moelink_ibgda_drain_fn)(void* ctx, int peer, const struct moelink_ibgda_progress* progress,
                                      int timeout_ms, char* err, size_t errlen);
}
