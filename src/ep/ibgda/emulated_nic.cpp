// The emulated NIC (nic.h): one host thread that plays an mlx5 send engine for every queue
// pair of this rank. It reads the send counter in each queue's doorbell record, decodes the
// WQEs there (control, remote-address, data or inline segment), executes each RDMA WRITE as a
// CUDA copy into the peer's buffer through its CUDA IPC mapping, in queue order on one stream
// (so a WRITE lands only after every earlier one, as the fence bit asks), and writes a CQE for
// each signaled WQE once its copies are done. A bad key, an address outside a registration
// or a malformed WQE fails the queue pair as a NIC would: an error CQE, and every later WQE
// flushed with an error CQE.
//
// It stands in for the hardware so that the GPU side of IBGDA (the kernels' posts, the
// doorbells, the completion polling, the ordering of data before counts and flags) runs on a
// machine without an RDMA NIC. Its speed means nothing.
//
// A WRITE from GPU memory into a buffer on the same GPU (ranks sharing one GPU in tests) goes
// through pinned host memory: a device-to-device copy within one GPU may run as a kernel, which
// waits for SMs that the ranks' kernels hold while they poll for this very data; copies to and
// from host memory stay on the copy engines, as a NIC stays off the SMs.
#include <endian.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "moelink/common/error.h"
#include "moelink/common/settings.h"
#include "moelink/ep/ibgda/nic.h"

namespace moelink::ep::ibgda {

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) MOELINK_THROW("emulated NIC: ", what, " failed: ", cudaGetErrorString(e));
}

// Pinned host memory mapped into the GPU, zeroed.
struct Mapped {
  void* host = nullptr;
  void* dev = nullptr;
  explicit Mapped(size_t bytes) {
    check(cudaHostAlloc(&host, bytes, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc");
    std::memset(host, 0, bytes);
    check(cudaHostGetDevicePointer(&dev, host, 0), "cudaHostGetDevicePointer");
  }
  ~Mapped() { cudaFreeHost(host); }
  Mapped(const Mapped&) = delete;
  Mapped& operator=(const Mapped&) = delete;
};

constexpr uint32_t kSqDepth = 2048;  // WQEs (one 64-byte basic block each)
constexpr uint32_t kCqDepth = 256;   // > kSqDepth / 64 + 2 (queue.h's bound for selective signaling)

struct EmuQp {
  int peer = -1;
  uint32_t qpn = 0;
  Mapped wqes{kSqDepth * kBasicBlockBytes};
  Mapped cqes{kCqDepth * kCqeBytes};
  Mapped sq_dbr{64};
  Mapped cq_dbr{64};
  Mapped doorbell{64};
  Mapped inline_src{kSqDepth * 8};  // the inline WRITEs' values, as the copies' sources
  uint64_t sq_ci = 0, cq_pi = 0;
  bool failed = false;
  bool connected = false;
  std::string why;  // the first failure, or the first CUDA error retried
  EmuQp() {
    for (uint32_t i = 0; i < kCqDepth; ++i)  // as the driver initializes a CQ
      static_cast<unsigned char*>(cqes.host)[i * kCqeBytes + kCqeOpOwnOffset] = kCqeInvalid << 4;
  }
};

struct Region {
  uintptr_t begin, end;
};

class EmulatedNic final : public Nic {
 public:
  EmulatedNic(int device, int rank, RemoteResolver resolve)
      : device_(device), key_(kEmulatedKeyBase + static_cast<uint32_t>(rank)), resolve_(std::move(resolve)) {
    check(cudaSetDevice(device_), "cudaSetDevice");
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    // Here, not at the first WRITE: allocating pinned memory may wait for the device, whose
    // kernels wait for that WRITE.
    check(cudaHostAlloc(&bounce_, kBounceBytes, cudaHostAllocPortable), "cudaHostAlloc(bounce)");
    thread_ = std::thread([this] { run(); });
  }

  ~EmulatedNic() override {
    finishAll();
    stop_ = true;
    thread_.join();
    cudaStreamDestroy(stream_);
    cudaFreeHost(bounce_);
    // Failures are what a NIC would report in its CQEs; say them on stderr too (and everything
    // with MOELINK_EP_IBGDA_TRACE set), since the kernels only drop posts and time out.
    const bool trace = settings::flag("MOELINK_EP_IBGDA_TRACE");
    for (auto& q : qps_)
      if (q->failed || !q->why.empty() || trace)
        std::fprintf(stderr,
                     "moelink emulated NIC (rank %u): queue pair to rank %d: %llu WQEs executed, "
                     "%llu CQEs%s%s\n",
                     key_ - kEmulatedKeyBase, q->peer, static_cast<unsigned long long>(q->sq_ci),
                     static_cast<unsigned long long>(q->cq_pi), q->failed ? ", FAILED: " : "", q->why.c_str());
  }

  std::string name() const override { return "emulated"; }

  MemoryKeys registerMemory(void* ptr, size_t bytes) override {
    std::lock_guard<std::mutex> g(mu_);
    const auto b = reinterpret_cast<uintptr_t>(ptr);
    regions_.push_back({b, b + bytes});
    return {key_, key_};
  }

  std::vector<uint8_t> createQueuePair(int peer) override {
    std::lock_guard<std::mutex> g(mu_);
    eraseQp(peer);
    auto q = std::make_unique<EmuQp>();
    q->peer = peer;
    q->qpn = next_qpn_++;
    std::vector<uint8_t> addr(4);
    std::memcpy(addr.data(), &q->qpn, 4);
    qps_.push_back(std::move(q));
    return addr;
  }

  void destroyQueuePair(int peer) override {
    std::lock_guard<std::mutex> g(mu_);  // not inside step(): a WRITE under way has landed
    eraseQp(peer);
  }

  QueuePair connect(int peer, const std::vector<uint8_t>& remote) override {
    std::lock_guard<std::mutex> g(mu_);
    MOELINK_CHECK(remote.size() == 4, "emulated NIC: bad queue-pair address from rank ", peer);
    for (auto& q : qps_) {
      if (q->peer != peer) continue;
      QueuePair p;
      p.sq.wqes = static_cast<unsigned char*>(q->wqes.dev);
      p.sq.depth = kSqDepth;
      p.sq.qpn = q->qpn;
      p.sq.dbr = static_cast<uint32_t*>(q->sq_dbr.dev);
      p.sq.doorbell = static_cast<uint64_t*>(q->doorbell.dev);
      p.cq.cqes = static_cast<const unsigned char*>(q->cqes.dev);
      p.cq.depth = kCqDepth;
      p.cq.dbr = static_cast<uint32_t*>(q->cq_dbr.dev);
      q->connected = true;
      return p;
    }
    MOELINK_THROW("emulated NIC: no queue pair to rank ", peer);
  }

 private:
  void eraseQp(int peer) {
    for (auto it = qps_.begin(); it != qps_.end();) it = (*it)->peer == peer ? qps_.erase(it) : std::next(it);
  }

  // Waits (up to 10 s) until every WQE posted so far is executed.
  void finishAll() {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < deadline) {
      {
        std::lock_guard<std::mutex> g(mu_);
        bool idle = true;
        for (auto& q : qps_) idle = idle && (q->failed || (q->sq_ci & 0xffff) == sendCounter(*q));
        if (idle) return;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  static uint32_t sendCounter(const EmuQp& q) {
    const uint32_t* dbr = static_cast<const uint32_t*>(q.sq_dbr.host);
    return be32toh(__atomic_load_n(&dbr[kSendDbr], __ATOMIC_ACQUIRE)) & 0xffff;
  }

  bool localOk(uint32_t lkey, uint64_t addr, uint32_t len) const {
    if (lkey != key_) return false;
    for (const Region& r : regions_)
      if (addr >= r.begin && addr + len <= r.end) return true;
    return false;
  }

  void run() {
    cudaSetDevice(device_);
    int idle = 0;
    while (!stop_.load(std::memory_order_relaxed)) {
      bool did = false;
      {
        std::lock_guard<std::mutex> g(mu_);
        for (auto& q : qps_)
          if (q->connected) did = step(*q) || did;
      }
      if (did) {
        idle = 0;
      } else if (++idle < 1000) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  struct Completion {
    uint16_t wqe_counter;
    bool error;
  };

  // Executes what the doorbell record says is posted; returns whether there was any.
  bool step(EmuQp& q) {
    const uint32_t counter = sendCounter(q);
    if ((q.sq_ci & 0xffff) == counter) return false;
    const uint64_t start = q.sq_ci;
    std::vector<Completion> done;
    bool copies = false;
    while ((q.sq_ci & 0xffff) != counter) {
      const uint32_t slot = static_cast<uint32_t>(q.sq_ci) & (kSqDepth - 1);
      const unsigned char* wqe = static_cast<const unsigned char*>(q.wqes.host) + slot * kBasicBlockBytes;
      uint32_t w[12];
      std::memcpy(w, wqe, sizeof w);
      const uint32_t opmod_idx_opcode = be32toh(w[0]), qpn_ds = be32toh(w[1]);
      const uint8_t fm_ce_se = wqe[11];
      uint64_t raddr;
      std::memcpy(&raddr, wqe + 16, 8);
      raddr = be64toh(raddr);
      const uint32_t rkey = be32toh(w[6]);
      const uint32_t first = be32toh(w[8]);
      bool ok = !q.failed && (opmod_idx_opcode & 0xff) == kOpcodeRdmaWrite &&
                ((opmod_idx_opcode >> 8) & 0xffff) == (q.sq_ci & 0xffff) && (qpn_ds >> 8) == q.qpn &&
                (qpn_ds & 0x3f) == 3;
      const void* src = nullptr;
      uint32_t len = 0;
      if (ok && (first & kInlineSeg)) {
        len = first & ~kInlineSeg;
        ok = len == 8;
        uint64_t* value = static_cast<uint64_t*>(q.inline_src.host) + slot;
        std::memcpy(value, wqe + 36, 8);
        src = value;
      } else if (ok) {
        len = first;
        const uint32_t lkey = be32toh(w[9]);
        uint64_t laddr;
        std::memcpy(&laddr, wqe + 40, 8);
        laddr = be64toh(laddr);
        ok = len > 0 && localOk(lkey, laddr, len);
        src = reinterpret_cast<const void*>(laddr);
      }
      void* dst = ok ? resolve_(rkey, raddr, len) : nullptr;
      ok = ok && dst != nullptr;
      if (ok) {
        // A call CUDA refuses now (e.g. while another thread captures a graph in global mode)
        // is tried again on the next sweep, from this WQE on.
        const cudaError_t e = copy(dst, src, len);
        if (e != cudaSuccess) {
          if (q.why.empty()) q.why = std::string("cudaMemcpyAsync: ") + cudaGetErrorString(e) + " (retried)";
          cudaGetLastError();
          break;
        }
        copies = true;
      }
      if (!ok && !q.failed) {
        q.failed = true;
        const bool remote = dst == nullptr && src != nullptr;
        q.why = "WQE " + std::to_string(q.sq_ci) +
                (remote ? ": remote key/address not registered" : ": malformed, or local key/address");
      }
      if (!ok || (fm_ce_se & kCqUpdate)) done.push_back({static_cast<uint16_t>(q.sq_ci), !ok});
      ++q.sq_ci;
    }
    // (A bounce leaves copies queued also when a later call of its WRITE failed.)
    while ((copies || bounce_used_ > 0) && cudaStreamSynchronize(stream_) != cudaSuccess &&
           !stop_.load(std::memory_order_relaxed)) {
      cudaGetLastError();
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    bounce_used_ = 0;
    for (const Completion& c : done) {
      // Room in the CQ: the consumer index the GPU published in its doorbell record.
      const uint32_t* cq_dbr = static_cast<const uint32_t*>(q.cq_dbr.host);
      while (q.cq_pi - (be32toh(__atomic_load_n(&cq_dbr[kCqSetCi], __ATOMIC_ACQUIRE)) & 0xffffff) >= kCqDepth &&
             !stop_.load(std::memory_order_relaxed))
        std::this_thread::yield();
      unsigned char* cqe = static_cast<unsigned char*>(q.cqes.host) + (q.cq_pi % kCqDepth) * kCqeBytes;
      const uint16_t be = htobe16(c.wqe_counter);
      std::memcpy(cqe + kCqeWqeCounterOffset, &be, 2);
      const uint8_t op = c.error ? kCqeReqErr : kCqeReq;
      __atomic_store_n(cqe + kCqeOpOwnOffset, static_cast<uint8_t>(op << 4 | ((q.cq_pi / kCqDepth) & 1)),
                       __ATOMIC_RELEASE);
      ++q.cq_pi;
    }
    return q.sq_ci != start;
  }

  // Queues the copy of one WRITE on stream_ (see the file comment for the bounce).
  cudaError_t copy(void* dst, const void* src, size_t len) {
    cudaPointerAttributes from{}, to{};
    const bool bounce = cudaPointerGetAttributes(&from, src) == cudaSuccess && from.type == cudaMemoryTypeDevice &&
                        cudaPointerGetAttributes(&to, dst) == cudaSuccess && to.type == cudaMemoryTypeDevice &&
                        to.device == from.device;
    cudaGetLastError();
    if (!bounce) return cudaMemcpyAsync(dst, src, len, cudaMemcpyDefault, stream_);
    for (size_t done = 0; done < len;) {
      const size_t n = std::min(len - done, kBounceBytes);
      if (bounce_used_ + n > kBounceBytes) {  // the copies queued so far hold the rest
        if (const cudaError_t e = cudaStreamSynchronize(stream_); e != cudaSuccess) return e;
        bounce_used_ = 0;
      }
      char* b = static_cast<char*>(bounce_) + bounce_used_;
      if (const cudaError_t e = cudaMemcpyAsync(b, static_cast<const char*>(src) + done, n, cudaMemcpyDeviceToHost,
                                                stream_);
          e != cudaSuccess)
        return e;
      if (const cudaError_t e = cudaMemcpyAsync(static_cast<char*>(dst) + done, b, n, cudaMemcpyHostToDevice, stream_);
          e != cudaSuccess)
        return e;
      bounce_used_ += n;
      done += n;
    }
    return cudaSuccess;
  }

  static constexpr size_t kBounceBytes = 16u << 20;

  int device_;
  uint32_t key_;
  void* bounce_ = nullptr;  // pinned; the same-GPU WRITEs' copies pass through it
  size_t bounce_used_ = 0;  // bytes of it that queued copies use (reset once stream_ is idle)
  RemoteResolver resolve_;
  cudaStream_t stream_ = nullptr;
  std::mutex mu_;
  std::vector<Region> regions_;
  std::vector<std::unique_ptr<EmuQp>> qps_;
  uint32_t next_qpn_ = 0x100;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace

std::unique_ptr<Nic> makeEmulatedNic(int cuda_device, int rank, RemoteResolver resolve) {
  return std::make_unique<EmulatedNic>(cuda_device, rank, std::move(resolve));
}

}  // namespace moelink::ep::ibgda
