#include "moelink/ep/proxy.h"

#include <cuda_runtime_api.h>
#include <glog/logging.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "moelink/common/error.h"
#include "moelink/transfer/transfer_engine.h"

namespace moelink::ep {

namespace {

constexpr transfer::SegmentId kInboxSegment = 0xE9000001u;
constexpr uint64_t kRingCapacity = 1u << 16;
constexpr size_t kMaxBatch = 512;

void cudaCheck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) MOELINK_THROW("moelink EP proxy: ", what, " failed: ", cudaGetErrorString(e));
}

inline void cpuRelax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

}  // namespace

EpProxy::EpProxy(std::shared_ptr<transfer::MetadataStore> store, int rank, int size, std::vector<int> peers,
                 uint64_t inbox_bytes, uint64_t outbox_bytes, std::chrono::milliseconds timeout, bool joining)
    : rank_(rank), peers_(std::move(peers)), capacity_(kRingCapacity), timeout_(timeout) {
  transfer::EngineOptions eo;
  eo.rank = rank;
  eo.world_size = size;
  eo.timeout = timeout;
  eo.extension = joining;  // the group's secret exists: a joining rank 0 must not make another
  engine_ = std::make_unique<transfer::TransferEngine>(std::move(store), eo);
  if (peers_.empty()) return;
  inbox_bytes_ = inbox_bytes;
  outbox_bytes_ = outbox_bytes;
  inbox_host_ = static_cast<char*>(engine_->allocateSegment(kInboxSegment, inbox_bytes));
  cudaCheck(cudaHostRegister(inbox_host_, inbox_bytes, cudaHostRegisterMapped | cudaHostRegisterPortable),
            "cudaHostRegister(inbox)");
  void* p = nullptr;
  cudaCheck(cudaHostGetDevicePointer(&p, inbox_host_, 0), "cudaHostGetDevicePointer(inbox)");
  inbox_dev_ = static_cast<char*>(p);
  cudaCheck(cudaHostAlloc(reinterpret_cast<void**>(&outbox_host_), outbox_bytes,
                          cudaHostAllocMapped | cudaHostAllocPortable),
            "cudaHostAlloc(outbox)");
  cudaCheck(cudaHostGetDevicePointer(&p, outbox_host_, 0), "cudaHostGetDevicePointer(outbox)");
  outbox_dev_ = static_cast<char*>(p);
  const size_t ring_bytes = capacity_ * sizeof(kernels::ProxyEntry) + 64;
  cudaCheck(cudaHostAlloc(reinterpret_cast<void**>(&entries_host_), ring_bytes, cudaHostAllocMapped | cudaHostAllocPortable),
            "cudaHostAlloc(ring)");
  std::memset(static_cast<void*>(entries_host_), 0, ring_bytes);
  head_host_ = reinterpret_cast<uint64_t*>(entries_host_ + capacity_);
  // Two words: the tail, then the GPU's copy of the head (ProxyRing::head_seen).
  cudaCheck(cudaMalloc(reinterpret_cast<void**>(&tail_dev_), 2 * sizeof *tail_dev_), "cudaMalloc(ring tail)");
  cudaCheck(cudaMemset(tail_dev_, 0, 2 * sizeof *tail_dev_), "cudaMemset(ring tail)");
  cudaCheck(cudaHostGetDevicePointer(&p, entries_host_, 0), "cudaHostGetDevicePointer(ring)");
  ring_.entries = static_cast<kernels::ProxyEntry*>(p);
  ring_.head = reinterpret_cast<const uint64_t*>(ring_.entries + capacity_);
  ring_.tail = tail_dev_;
  ring_.head_seen = tail_dev_ + 1;
  ring_.capacity = capacity_;
  ring_.outbox = outbox_dev_;
  if (!joining)
    for (int peer : peers_) engine_->openSegment(peer, kInboxSegment);  // waits for the peer's inbox
  thread_ = std::thread([this] { run(); });
}

bool EpProxy::settle() {
  if (!thread_.joinable() || !tail_dev_) return true;
  unsigned long long tail = 0;
  if (cudaMemcpy(&tail, tail_dev_, sizeof tail, cudaMemcpyDeviceToHost) != cudaSuccess) return false;
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  while (__atomic_load_n(head_host_, __ATOMIC_ACQUIRE) < tail) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return true;
}

void EpProxy::reopen(int peer) {
  MOELINK_CHECK(std::find(peers_.begin(), peers_.end(), peer) != peers_.end(), "moelink EP proxy: rank ", peer,
                " is not a proxy peer of rank ", rank_);
  std::lock_guard<std::mutex> g(io_mu_);
  engine_->forgetPeer(peer);
  engine_->openSegment(peer, kInboxSegment);  // the new process's (its incarnation's) inbox
}

void EpProxy::clearInbox() {
  if (inbox_host_) std::memset(inbox_host_, 0, inbox_bytes_);
}

EpProxy::~EpProxy() {
  // Deliver what the GPU has posted before stopping: a peer may still wait for it (this
  // rank can finish a round before its last rows reach the others). The buffer has
  // synchronized the device, so the GPU's tail is final.
  settle();
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
  if (tail_dev_) cudaFree(tail_dev_);
  if (entries_host_) cudaFreeHost(entries_host_);
  if (outbox_host_) cudaFreeHost(outbox_host_);
  if (inbox_host_) cudaHostUnregister(inbox_host_);
  engine_.reset();  // frees the inbox segment
}

std::string EpProxy::transportTo(int peer) const { return engine_->transportOf(peer, kInboxSegment); }

void EpProxy::run() {
  uint64_t head = 0;
  std::vector<kernels::ProxyEntry> batch_entries;
  std::vector<transfer::TransferRequest> reqs;
  std::vector<uint64_t> signals(kMaxBatch);
  batch_entries.reserve(kMaxBatch);
  reqs.reserve(kMaxBatch);
  const ProxyLimits limits{peers_, outbox_bytes_};
  auto idle_since = std::chrono::steady_clock::now();
  while (!stop_.load(std::memory_order_relaxed)) {
    batch_entries.clear();
    reqs.clear();
    size_t n = 0;
    while (n < kMaxBatch) {
      kernels::ProxyEntry& e = entries_host_[(head + n) % capacity_];
      if (__atomic_load_n(&e.seq, __ATOMIC_ACQUIRE) != head + n + 1) break;
      batch_entries.push_back(e);
      ++n;
    }
    if (n > 0) {
      const ProxyPlan plan = planProxyBatch(batch_entries.data(), n, limits);
      for (size_t i : plan.dropped) {
        const kernels::ProxyEntry& e = batch_entries[i];
        LOG(ERROR) << "moelink EP proxy (rank " << rank_ << "): dropping a malformed request (kind " << e.kind
                   << ", peer " << e.peer << ", remote " << e.remote << ", length " << e.length << ")";
      }
      for (const ProxyWrite& w : plan.writes) {
        transfer::TransferRequest r;
        r.op = transfer::Opcode::kWrite;
        r.peer = w.peer;
        r.segment = kInboxSegment;
        r.offset = w.remote;
        r.length = w.length;
        if (w.signal) {
          signals[reqs.size()] = w.local;
          r.local = &signals[reqs.size()];
        } else {
          r.local = outbox_host_ + w.local;
        }
        reqs.push_back(r);
      }
    }
    if (n == 0) {
      // Spin while traffic is recent (the GPU waits on us), then back off to short sleeps.
      if (std::chrono::steady_clock::now() - idle_since < std::chrono::milliseconds(2)) {
        cpuRelax();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
      continue;
    }
    if (!reqs.empty()) {
      std::lock_guard<std::mutex> g(io_mu_);
      auto batch = engine_->submit(reqs);
      // The signal values live in `signals` until the engine has applied them.
      if (!batch->wait(timeout_) || batch->failed()) {
        LOG_EVERY_N(ERROR, 100) << "moelink EP proxy (rank " << rank_ << "): transfer failed: "
                                << (batch->failed() ? batch->error() : std::string("timed out"));
      }
    }
    head += n;
    __atomic_store_n(head_host_, head, __ATOMIC_RELEASE);
    idle_since = std::chrono::steady_clock::now();
  }
}

}  // namespace moelink::ep
