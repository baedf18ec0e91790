#include "moelink/ep/proxy.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>

#include "moelink/common/error.h"
#include "moelink/common/settings.h"
#include "moelink/transfer/transfer_engine.h"

namespace moelink::ep {

namespace {

constexpr transfer::SegmentId kInboxSegment = 0xE9000001u;
constexpr uint64_t kRingCapacity = 1u << 16;

// MOELINK_EP_PROXY_THREADS, else one per 16 cores this process may run on (1 to 4): spinning
// threads on a host with few cores steal the peers' and the GPU launchers' time.
int proxyThreads() {
  if (auto v = settings::numberIfSet("MOELINK_EP_PROXY_THREADS")) return static_cast<int>(*v);
  return std::clamp(settings::usableCores() / 16, 1, 4);
}

void cudaCheck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) MOELINK_THROW("moelink EP proxy: ", what, " failed: ", cudaGetErrorString(e));
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
  // The group's ranks on this host: all but the proxy peers (ranks on other hosts).
  const int here = std::max(1, size - static_cast<int>(peers_.size()));
  eo.tcp_tuning = proxyTcpTuning(size, settings::usableCores() / here);
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
  carrier_ = std::make_unique<ProxyCarrier>(*engine_, ProxyCarrier::Config{.rank = rank,
                                                                            .peers = peers_,
                                                                            .inbox = kInboxSegment,
                                                                            .entries = entries_host_,
                                                                            .head = head_host_,
                                                                            .capacity = capacity_,
                                                                            .outbox = outbox_host_,
                                                                            .outbox_bytes = outbox_bytes_,
                                                                            .timeout = timeout_,
                                                                            .threads = proxyThreads(),
                                                                            .spread = settings::flag("MOELINK_EP_PROXY_SPREAD")});
}

bool EpProxy::settle() {
  if (!carrier_ || !tail_dev_) return true;
  unsigned long long tail = 0;
  if (cudaMemcpy(&tail, tail_dev_, sizeof tail, cudaMemcpyDeviceToHost) != cudaSuccess) return false;
  return carrier_->settle(tail);
}

void EpProxy::reopen(int peer) {
  MOELINK_CHECK(std::find(peers_.begin(), peers_.end(), peer) != peers_.end(), "moelink EP proxy: rank ", peer,
                " is not a proxy peer of rank ", rank_);
  auto g = carrier_->quiesce();
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
  carrier_.reset();
  if (tail_dev_) cudaFree(tail_dev_);
  if (entries_host_) cudaFreeHost(entries_host_);
  if (outbox_host_) cudaFreeHost(outbox_host_);
  if (inbox_host_) cudaHostUnregister(inbox_host_);
  engine_.reset();  // frees the inbox segment
}

std::string EpProxy::transportTo(int peer) const { return engine_->transportOf(peer, kInboxSegment); }

}  // namespace moelink::ep
