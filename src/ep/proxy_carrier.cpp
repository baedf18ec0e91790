#include "moelink/ep/proxy_carrier.h"

#include <glog/logging.h>
#include <sys/prctl.h>

#include <algorithm>
#include <deque>
#include <string>

#include "moelink/common/settings.h"
#include "moelink/common/spin.h"
#include "moelink/transfer/transfer_engine.h"

namespace moelink::ep {

namespace {

constexpr size_t kMaxBatch = 512;
// How long the threads spin after their last work before they sleep (the GPU waits on them
// while traffic is recent).
constexpr auto kSpinFor = std::chrono::milliseconds(2);

}  // namespace

transfer::tcp::TcpTuning proxyTcpTuning(int world_size, int cores) {
  transfer::tcp::TcpTuning t = transfer::tcp::TcpTuning::fromEnv(world_size);
  t.spin_us = settings::numberIfSet("MOELINK_EP_PROXY_TCP_SPIN_US")
                  .value_or(cores >= kProxyTcpSpinCores ? kProxyTcpSpinUs : 0);
  return t;
}

ProxyCarrier::ProxyCarrier(transfer::TransferEngine& engine, Config config) : engine_(engine), c_(std::move(config)) {
  const size_t threads = static_cast<size_t>(std::max(1, c_.threads));
  parts_.resize(threads);
  part_batches_.resize(threads);
  for (size_t i = 1; i < threads; ++i) helpers_.emplace_back([this, i] { help(i); });
  thread_ = std::thread([this] { run(); });
}

ProxyCarrier::~ProxyCarrier() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
  // Only now: a helper must not leave while the carrier may still hand it a part.
  {
    std::lock_guard<std::mutex> g(wake_mu_);
    quit_helpers_.store(true);
  }
  wake_.notify_all();
  for (std::thread& t : helpers_) t.join();
}

bool ProxyCarrier::settle(uint64_t tail) const {
  const auto deadline = std::chrono::steady_clock::now() + c_.timeout;
  while (__atomic_load_n(c_.head, __ATOMIC_ACQUIRE) < tail) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return true;
}

void ProxyCarrier::help(size_t part) {
  uint64_t seen = 0;
  unsigned spins = 0;
  auto idle_since = std::chrono::steady_clock::now();
  while (true) {
    const uint64_t round = round_.load(std::memory_order_acquire);
    if (round == seen) {
      if (quit_helpers_.load(std::memory_order_acquire)) return;
      if (std::chrono::steady_clock::now() - idle_since < kSpinFor) {
        spinTurn(spins);
      } else {
        std::unique_lock<std::mutex> g(wake_mu_);
        wake_.wait(g, [&] { return round_.load(std::memory_order_acquire) != seen || quit_helpers_.load(); });
      }
      continue;
    }
    seen = round;
    try {
      part_batches_[part] = parts_[part].empty() ? nullptr : engine_.submit(parts_[part]);
    } catch (const std::exception& e) {  // (not expected: the engine reports failures in the batch)
      LOG_EVERY_N(ERROR, 100) << "moelink EP proxy (rank " << c_.rank << "): submitting failed: " << e.what();
      part_batches_[part] = nullptr;
    }
    busy_.fetch_sub(1, std::memory_order_acq_rel);
    idle_since = std::chrono::steady_clock::now();
  }
}

transfer::TransferRequest ProxyCarrier::request(const ProxyWrite& w, uint64_t skip, uint64_t length) {
  transfer::TransferRequest r;
  r.op = transfer::Opcode::kWrite;
  r.peer = w.peer;
  r.segment = c_.inbox;
  r.offset = w.remote + skip;
  r.length = length;
  r.local = const_cast<char*>(c_.outbox) + w.local + skip;
  return r;
}

bool ProxyCarrier::copiesHere(int peer) const {
  try {
    const std::string via = engine_.transportOf(peer, c_.inbox);
    return via == "shm" || via == "local";
  } catch (const std::exception&) {
    return false;  // not opened: the engine fails the request, from whichever thread
  }
}

void ProxyCarrier::carryData(const ProxyWave& wave, bool unordered, std::vector<transfer::BatchPtr>& pending) {
  if (wave.data.empty()) return;
  // Writes over a transport that copies in the submitting thread (shared memory) are split
  // over the threads; the others (tcp: its own threads carry them) go in one submission.
  std::vector<std::pair<int, bool>> peers;  // the wave's peers: whether the submitter copies
  std::vector<transfer::TransferRequest> whole;
  uint64_t split_bytes = 0;
  auto copies = [&](int peer) {
    for (const auto& p : peers)
      if (p.first == peer) return p.second;
    peers.emplace_back(peer, copiesHere(peer));
    return peers.back().second;
  };
  for (const ProxyWrite& w : wave.data) {
    if (copies(w.peer))
      split_bytes += w.length;
    else
      whole.push_back(request(w, 0, w.length));
  }
  // Unordered, they need no acknowledgements either: the carrier waits only until they are
  // sent (the outbox is the poster's again), and the signals after them land after all of them.
  for (transfer::TransferRequest& r : whole) r.unordered = r.no_ack = unordered;
  if (!whole.empty()) pending.push_back(engine_.submit(whole));
  if (split_bytes == 0) return;
  const uint64_t threads = std::max<uint64_t>(
      1, std::min<uint64_t>(parts_.size(), split_bytes / std::max<uint64_t>(1, c_.part_bytes)));
  const uint64_t per = (split_bytes + threads - 1) / threads;
  for (auto& p : parts_) p.clear();
  // Consecutive pieces of the wave's writes, `per` bytes to a part (the last takes the rest).
  size_t part = 0;
  uint64_t room = per;
  for (const ProxyWrite& w : wave.data) {
    if (!copies(w.peer)) continue;
    uint64_t done = 0;
    while (done < w.length) {
      if (room == 0 && part + 1 < threads) {
        ++part;
        room = per;
      }
      const uint64_t n = part + 1 < threads ? std::min(room, w.length - done) : w.length - done;
      parts_[part].push_back(request(w, done, n));
      done += n;
      room -= std::min(room, n);
    }
  }
  if (threads > 1) {
    // Every helper takes the round (those beyond `threads` find their part empty).
    busy_.store(static_cast<int>(parts_.size()) - 1, std::memory_order_relaxed);
    round_.fetch_add(1, std::memory_order_acq_rel);
    {
      std::lock_guard<std::mutex> g(wake_mu_);
    }
    wake_.notify_all();
  }
  pending.push_back(engine_.submit(parts_[0]));
  if (threads > 1) {
    unsigned spins = 0;
    while (busy_.load(std::memory_order_acquire) > 0) spinTurn(spins);
    for (size_t i = 1; i < parts_.size(); ++i)
      if (part_batches_[i]) pending.push_back(std::move(part_batches_[i]));
  }
}

// A batch with the engine: the ring entries it carries end at ticket `end`; its signals' values
// live here until the engine has applied them.
struct ProxyCarrier::InFlight {
  uint64_t end = 0;
  uint64_t bytes = 0;  // its data
  std::chrono::steady_clock::time_point since;
  std::vector<transfer::BatchPtr> batches;
  std::vector<uint64_t> values;
};

std::unique_lock<std::mutex> ProxyCarrier::quiesce() {
  io_wanted_.fetch_add(1, std::memory_order_acq_rel);
  std::unique_lock<std::mutex> g(io_mu_);
  io_wanted_.fetch_sub(1, std::memory_order_acq_rel);
  return g;
}

void ProxyCarrier::run() {
  // Its idle sleeps are 20 us: with the default timer slack (50 us) each lasted ~70 us, which a
  // GPU waiting on the first request after a pause paid.
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
  uint64_t head = __atomic_load_n(c_.head, __ATOMIC_ACQUIRE);
  uint64_t taken = head;  // entries handed to the engine (head: those it has finished)
  uint64_t flying_bytes = 0;
  std::vector<kernels::ProxyEntry> entries;
  std::vector<transfer::TransferRequest> signals;
  std::deque<InFlight> flying;
  entries.reserve(kMaxBatch);
  signals.reserve(kMaxBatch);
  std::unique_lock<std::mutex> io(io_mu_, std::defer_lock);
  const ProxyLimits limits{c_.peers, c_.outbox_bytes};
  auto idle_since = std::chrono::steady_clock::now();
  unsigned spins = 0;
  // Retires the oldest batch once the engine has finished it, or (`block`) waits for it; one
  // that fails, or is not done within the timeout, is logged and passed, as the peer's waits
  // will report it. False: not finished yet (only without `block`).
  auto retireOldest = [&](bool block) {
    InFlight& f = flying.front();
    const auto deadline = f.since + c_.timeout;
    std::string error;
    for (const transfer::BatchPtr& batch : f.batches) {
      if (!batch->done()) {
        const auto now = std::chrono::steady_clock::now();
        if (!block && now < deadline) return false;
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now);
        if (now >= deadline || !batch->wait(left + std::chrono::milliseconds(1))) {
          error = "timed out";
          break;
        }
      }
      if (batch->failed()) {
        error = batch->error();
        break;
      }
    }
    if (!error.empty()) {
      LOG_EVERY_N(ERROR, 100) << "moelink EP proxy (rank " << c_.rank << "): transfer failed: " << error;
      // A batch passed before the engine finished it may still read its signals' values.
      if (error == "timed out") passed_values_.push_back(std::move(f.values));
    }
    head = f.end;
    flying_bytes -= f.bytes;
    __atomic_store_n(c_.head, head, __ATOMIC_RELEASE);
    flying.pop_front();
    if (flying.empty() && io.owns_lock()) io.unlock();
    return true;
  };
  while (!stop_.load(std::memory_order_relaxed)) {
    while (!flying.empty() && retireOldest(false)) {
    }
    // Room for another batch, and nobody waiting to change the engine's peers (they get the
    // lock once the batches in flight are done).
    if (flying.size() >= kMaxInFlight || (io_wanted_.load(std::memory_order_acquire) > 0 && !flying.empty())) {
      retireOldest(true);
      continue;
    }
    if (io_wanted_.load(std::memory_order_acquire) > 0 && !io.owns_lock()) {
      std::this_thread::yield();
      continue;
    }
    entries.clear();
    while (entries.size() < kMaxBatch) {
      const uint64_t ticket = taken + entries.size();
      const kernels::ProxyEntry& e = c_.entries[ticket % c_.capacity];
      if (__atomic_load_n(&e.seq, __ATOMIC_ACQUIRE) != ticket + 1) break;
      entries.push_back(e);
    }
    if (entries.empty()) {
      // Spin while traffic is recent or with the engine (the GPU waits on us; every 64th turn
      // a yield, for the engine's threads on a host with few cores), then back off to short
      // sleeps.
      if (!flying.empty() || std::chrono::steady_clock::now() - idle_since < kSpinFor) {
        spinTurn(spins);
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
      continue;
    }
    if (!io.owns_lock()) io.lock();
    const ProxyPlan plan = planProxyBatch(entries.data(), entries.size(), limits, c_.wave_bytes);
    for (size_t i : plan.dropped) {
      const kernels::ProxyEntry& e = entries[i];
      LOG(ERROR) << "moelink EP proxy (rank " << c_.rank << "): dropping a malformed request (kind " << e.kind
                 << ", peer " << e.peer << ", remote " << e.remote << ", length " << e.length << ")";
    }
    InFlight f;
    f.end = taken + entries.size();
    f.since = std::chrono::steady_clock::now();
    size_t num_signals = 0;
    for (const ProxyWave& wave : plan.waves) {
      f.bytes += wave.bytes;
      num_signals += wave.signals.size();
    }
    const bool unordered = c_.spread && !plan.in_ring_order && f.bytes + flying_bytes >= c_.spread_bytes;
    f.values.reserve(num_signals);  // never reallocated: the requests point into it
    for (const ProxyWave& wave : plan.waves) {
      carryData(wave, unordered, f.batches);
      if (wave.signals.empty()) continue;
      signals.clear();
      for (const ProxyWrite& w : wave.signals) {
        f.values.push_back(w.local);
        transfer::TransferRequest r;
        r.op = transfer::Opcode::kWrite;
        r.peer = w.peer;
        r.segment = c_.inbox;
        r.offset = w.remote;
        r.length = w.length;
        r.local = &f.values.back();
        signals.push_back(r);
      }
      f.batches.push_back(engine_.submit(signals));
    }
    taken = f.end;
    flying_bytes += f.bytes;
    flying.push_back(std::move(f));
    idle_since = std::chrono::steady_clock::now();
  }
  // What is with the engine still reads the outbox and these values.
  while (!flying.empty()) retireOldest(true);
}

}  // namespace moelink::ep
