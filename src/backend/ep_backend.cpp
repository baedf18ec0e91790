#include "moelink/backend/ep_backend.h"

#include <algorithm>
#include <numeric>
#include <set>
#include <condition_variable>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "moelink/backend/collectives.h"
#include "moelink/backend/work.h"
#include "moelink/torch/c10d_store.h"
#include "moelink/collective/worker.h"
#include "moelink/common/error.h"
#include "moelink/common/settings.h"
#include "moelink/transfer/shm/transport.h"
#include "moelink/transfer/transfer_engine.h"

namespace moelink::backend {

using namespace std::chrono;

// The tcp listener's address when nothing beyond this host can be in the group: every rank
// reached the store at a loopback address (a local launch: torchrun --standalone, or a
// TCPStore at 127.0.0.1 / localhost), the transport is automatic and MOELINK_HOST_IP is not
// set. Then the listener (probes, and tcp between ranks if shm is ruled out) binds 127.0.0.1
// and no port is open to the network. "" otherwise (the usual address).
static std::string localOnlyListener(const c10::intrusive_ptr<c10d::Store>& store) {
  if (!settings::text("MOELINK_HOST_IP").empty()) return "";
  if (settings::text("MOELINK_TRANSPORT") != "auto") return "";
  c10::intrusive_ptr<c10d::Store> s = store;
  while (auto* p = dynamic_cast<c10d::PrefixStore*>(s.get())) s = p->getUnderlyingStore();
  auto* tcp = dynamic_cast<c10d::TCPStore*>(s.get());
  if (tcp == nullptr) return "";
  const std::string host = tcp->getHost();
  const bool loopback = host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
  return loopback ? "127.0.0.1" : "";
}

// ---- the backend ----

namespace {

// The backends of this process that have not been destroyed (EpBackend::shutdownAll).
struct LiveBackends {
  std::mutex mu;
  std::set<EpBackend*> all;
};
LiveBackends& liveBackends() {
  static auto* b = new LiveBackends;  // never destroyed: backends may outlive static destruction
  return *b;
}

}  // namespace

EpBackend::EpBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                     milliseconds timeout, Options options)
    : c10d::Backend(rank, size),
      timeout_(timeout),
      options_(options),
      c10d_store_(store),
      store_(std::make_shared<C10dStore>(store)) {
  try {
    transfer::EngineOptions eo;
    eo.rank = rank;
    eo.world_size = size;
    eo.timeout = timeout;
    eo.extension = options.extension;
    eo.listen_ip = localOnlyListener(store);
    engine_ = std::make_unique<transfer::TransferEngine>(store_, eo);
    auto wo = collective::WorkerOptions::fromEnv(timeout);
    wo.raise_on_peer_failure = options.raise_on_peer_failure;
    wo.extension = options.extension;
    wo.initial_size = options.initial_size;
    worker_ = std::make_unique<collective::CollectiveWorker>(*engine_, *store_, wo);
    units_[c10::DeviceType::CPU] = makeCollectives(c10::DeviceType::CPU, groupContext());
  } catch (const moelink::Error& e) {
    TORCH_CHECK(false, "moelink: could not set up backend 'ep' (rank ", rank, " of ", size, "): ", e.what());
  }
  std::lock_guard<std::mutex> g(liveBackends().mu);
  liveBackends().all.insert(this);
}

EpBackend::~EpBackend() {
  {
    std::lock_guard<std::mutex> g(liveBackends().mu);
    liveBackends().all.erase(this);
  }
  shutdown();
}

void EpBackend::shutdownAll() {
  {
    // NOTES: under the registry's lock, so that a backend being destroyed meanwhile waits in
    // its destructor (still whole) until this is done with it.
    std::lock_guard<std::mutex> g(liveBackends().mu);
    for (EpBackend* b : liveBackends().all) b->shutdown();
  }
  // The process is leaving: no name of it stays in /dev/shm, also those of engines that are not
  // a backend's (an EP buffer's CPU proxy) and are still alive.
  transfer::shm::unlinkOwnRegions();
}

void EpBackend::shutdown() {
  std::lock_guard<std::mutex> once(shutdown_mu_);
  // The worker first: it fails what has not finished, which also releases GPU streams that
  // wait for host-staged ops; then the CUDA unit drains its streams; the engine last.
  worker_.reset();
  {
    std::lock_guard<std::mutex> g(units_mu_);
    units_.clear();
  }
  engine_.reset();
}

Collectives& EpBackend::on(const DevicePlacement& placement) {
  std::lock_guard<std::mutex> g(units_mu_);
  TORCH_CHECK(worker_, "moelink: the 'ep' process group has been shut down");
  auto& unit = units_[placement.deviceType()];
  if (!unit) unit = makeCollectives(placement.deviceType(), groupContext());
  return *unit;
}

GroupContext EpBackend::groupContext() const {
  GroupContext g;
  g.rank = rank_;
  g.size = size_;
  g.store = c10d_store_;
  g.worker = worker_.get();
  transfer::TransferEngine* engine = engine_.get();
  g.host_of = [engine](int r) { return engine->hostIdOf(r); };
  return g;
}

std::string EpBackend::cudaPath() const {
  std::lock_guard<std::mutex> g(units_mu_);
  auto it = units_.find(c10::DeviceType::CUDA);
  return it == units_.end() ? "" : it->second->path();
}

std::string EpBackend::hostIdOf(int peer) const {
  TORCH_CHECK_VALUE(peer >= 0 && peer < size_, "moelink: rank ", peer, " is outside the group of size ", size_);
  TORCH_CHECK(engine_, "moelink: the 'ep' process group has been shut down");
  return engine_->hostIdOf(peer);
}

collective::CollectiveWorker& EpBackend::worker() const {
  TORCH_CHECK(worker_, "moelink: the 'ep' process group has been shut down");
  return *worker_;
}

#if MOELINK_C10D_SET_TIMEOUT
void EpBackend::setTimeout(milliseconds timeout) {
  TORCH_CHECK_VALUE(timeout.count() > 0, "moelink set_timeout: the timeout must be positive, got ", timeout.count(),
                    " ms");
  timeout_.store(timeout, std::memory_order_relaxed);
}
#endif

milliseconds EpBackend::timeoutOf(milliseconds requested) const {
  return requested == c10d::kUnsetTimeout || requested.count() <= 0 ? timeout() : requested;
}

std::vector<int32_t> EpBackend::activeMask() const {
  auto m = worker().mask();
  return std::vector<int32_t>(m.begin(), m.end());
}

uint64_t EpBackend::epoch() const { return worker().epoch(); }

void EpBackend::mirrorMask(const at::Tensor& mirror) {
  TORCH_CHECK_VALUE(mirror.device().is_cpu() && mirror.scalar_type() == at::kInt && mirror.is_contiguous() &&
                        mirror.dim() == 1 && mirror.numel() >= size_,
                    "moelink: a mask mirror is a contiguous CPU int32 tensor of at least ", size_, " entries");
  collective::CollectiveWorker* w = &worker();
  auto write = [w, mirror] {
    auto* out = mirror.data_ptr<int32_t>();
    const auto m = w->mask();
    for (int64_t i = 0; i < mirror.numel(); ++i) {
      __atomic_store_n(out + i, i < static_cast<int64_t>(m.size()) && m[i] ? 1 : 0, __ATOMIC_RELAXED);
    }
  };
  write();
  w->onChange(write);  // lives as long as the worker, holding the tensor
}

std::optional<std::vector<int64_t>> EpBackend::lostRanksOf(const c10::intrusive_ptr<c10d::Work>& work) {
  auto* w = dynamic_cast<const LostRanks*>(work.get());
  if (!w) return std::nullopt;
  return w->lostRanks();
}

std::vector<int32_t> EpBackend::peerState(const std::vector<int64_t>& ranks) {
  std::vector<int32_t> out;
  for (int64_t r : ranks) {
    TORCH_CHECK_VALUE(r >= 0 && r < size_, "moelink get_peer_state: rank ", r, " is outside the group of size ", size_);
    try {
      out.push_back(worker().peerWaiting(static_cast<int>(r)) ? 1 : 0);
    } catch (const moelink::Error&) {  // its record cannot be read: not reachable, not waiting
      out.push_back(0);
    }
  }
  return out;
}

int64_t EpBackend::numSyncedRanks() {
  std::vector<int64_t> all(size_);
  for (int r = 0; r < size_; ++r) all[r] = r;
  auto state = peerState(all);
  return std::accumulate(state.begin(), state.end(), int64_t{0});
}

void EpBackend::recoverRanks(const std::vector<int64_t>& ranks) {
  std::vector<int> rs;
  for (int64_t r : ranks) {
    TORCH_CHECK_VALUE(r >= 0 && r < size_, "moelink recover_ranks: rank ", r, " is outside the group of size ", size_);
    TORCH_CHECK_VALUE(!worker().isActive(static_cast<int>(r)), "moelink recover_ranks: rank ", r, " is active");
    TORCH_CHECK_VALUE(std::find(rs.begin(), rs.end(), r) == rs.end(), "moelink recover_ranks: rank ", r, " is listed twice");
    rs.push_back(static_cast<int>(r));
  }
  if (rs.empty()) return;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::string error;
  worker().readmit(rs,
                   [&](const std::string& err) {
                     std::lock_guard<std::mutex> g(mu);
                     error = err;
                     done = true;
                     cv.notify_all();
                   },
                   timeout());
  std::unique_lock<std::mutex> lk(mu);
  cv.wait(lk, [&] { return done; });
  TORCH_CHECK(error.empty(), "moelink recover_ranks: ", error);
}

std::string EpBackend::tcpAddress() const {
  TORCH_CHECK(engine_, "moelink: the 'ep' process group has been shut down");
  return engine_->tcpAddress();
}

std::string EpBackend::transportOf(int peer) const {
  TORCH_CHECK_VALUE(peer >= 0 && peer < size_, "moelink: rank ", peer, " is outside the group of size ", size_);
  return worker().transportTo(peer);
}

bool EpBackend::readsDirectly(int peer) const {
  TORCH_CHECK_VALUE(peer >= 0 && peer < size_, "moelink: rank ", peer, " is outside the group of size ", size_);
  return worker().peerReadsDirectly(peer);
}

std::vector<int64_t> EpBackend::activeRanks() const {
  std::vector<int64_t> r;
  for (int i = 0; i < size_; ++i)
    if (worker().isActive(i)) r.push_back(i);
  return r;
}


}  // namespace moelink::backend
