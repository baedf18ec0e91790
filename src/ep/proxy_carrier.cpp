#include "moelink/ep/proxy_carrier.h"

#include <glog/logging.h>

#include <string>

#include "moelink/transfer/transfer_engine.h"

namespace moelink::ep {

namespace {

constexpr size_t kMaxBatch = 512;

inline void cpuRelax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

}  // namespace

ProxyCarrier::ProxyCarrier(transfer::TransferEngine& engine, Config config) : engine_(engine), c_(std::move(config)) {
  thread_ = std::thread([this] { run(); });
}

ProxyCarrier::~ProxyCarrier() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

bool ProxyCarrier::settle(uint64_t tail) const {
  const auto deadline = std::chrono::steady_clock::now() + c_.timeout;
  while (__atomic_load_n(c_.head, __ATOMIC_ACQUIRE) < tail) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return true;
}

void ProxyCarrier::run() {
  uint64_t head = __atomic_load_n(c_.head, __ATOMIC_ACQUIRE);
  std::vector<kernels::ProxyEntry> entries;
  std::vector<transfer::TransferRequest> reqs;
  std::vector<uint64_t> signals(kMaxBatch);
  entries.reserve(kMaxBatch);
  reqs.reserve(kMaxBatch);
  const ProxyLimits limits{c_.peers, c_.outbox_bytes};
  auto idle_since = std::chrono::steady_clock::now();
  while (!stop_.load(std::memory_order_relaxed)) {
    entries.clear();
    while (entries.size() < kMaxBatch) {
      const uint64_t ticket = head + entries.size();
      const kernels::ProxyEntry& e = c_.entries[ticket % c_.capacity];
      if (__atomic_load_n(&e.seq, __ATOMIC_ACQUIRE) != ticket + 1) break;
      entries.push_back(e);
    }
    if (entries.empty()) {
      // Spin while traffic is recent (the GPU waits on us), then back off to short sleeps.
      if (std::chrono::steady_clock::now() - idle_since < std::chrono::milliseconds(2)) {
        cpuRelax();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
      continue;
    }
    const ProxyPlan plan = planProxyBatch(entries.data(), entries.size(), limits);
    for (size_t i : plan.dropped) {
      const kernels::ProxyEntry& e = entries[i];
      LOG(ERROR) << "moelink EP proxy (rank " << c_.rank << "): dropping a malformed request (kind " << e.kind
                 << ", peer " << e.peer << ", remote " << e.remote << ", length " << e.length << ")";
    }
    reqs.clear();
    for (const ProxyWrite& w : plan.writes) {
      transfer::TransferRequest r;
      r.op = transfer::Opcode::kWrite;
      r.peer = w.peer;
      r.segment = c_.inbox;
      r.offset = w.remote;
      r.length = w.length;
      if (w.signal) {
        signals[reqs.size()] = w.local;  // lives until the engine has applied it (the wait below)
        r.local = &signals[reqs.size()];
      } else {
        r.local = const_cast<char*>(c_.outbox) + w.local;
      }
      reqs.push_back(r);
    }
    if (!reqs.empty()) {
      std::lock_guard<std::mutex> g(io_mu_);
      auto batch = engine_.submit(reqs);
      if (!batch->wait(c_.timeout) || batch->failed()) {
        LOG_EVERY_N(ERROR, 100) << "moelink EP proxy (rank " << c_.rank << "): transfer failed: "
                                << (batch->failed() ? batch->error() : std::string("timed out"));
      }
    }
    head += entries.size();
    __atomic_store_n(c_.head, head, __ATOMIC_RELEASE);
    idle_since = std::chrono::steady_clock::now();
  }
}

}  // namespace moelink::ep
