// The EP CPU proxy's carrier over loopback tcp, without a GPU: how long a burst of token rows
// takes from its first post until its signal lands in the peer's inbox, when a thread posts the
// rows one by one into the proxy's ring (as the GPU's warps do) and the carrier (ProxyCarrier)
// hands them to the engine; beside it, the same rows and signal handed to the engine as one
// batch at once (unordered, as a large batch of the carrier goes): the floor the carrier is read
// against. Run by examples/bench/proxy_carrier.py, which prints the table and plots it; alone:
//
//   build/moelink_proxy_bench [--streams 4,8] [--rows 64,128,256,512] [--row-bytes 7392] [--gap-us 0.5] [--iters 40]
//
// Prints one line per (streams, rows): "streams rows row_bytes gap_us carrier_us batch_us"
// (medians). The rows go into every other row slot of the peer (no two merge), the signal after
// them; the receiving thread watches the signal word. Both engines are tuned as the EP proxy's
// (proxyTcpTuning: MOELINK_EP_PROXY_TCP_SPIN_US applies) but for the number of streams.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "moelink/common/settings.h"
#include "moelink/ep/proxy_carrier.h"
#include "moelink/transfer/transfer_engine.h"

using namespace moelink;
using Clock = std::chrono::steady_clock;

namespace {

constexpr transfer::SegmentId kInbox = 0xE9000044u;

std::vector<double> parseList(const std::string& s) {
  std::vector<double> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::atof(item.c_str()));
  return out;
}

transfer::EngineOptions options(int rank, int streams) {
  transfer::EngineOptions o;
  o.rank = rank;
  o.world_size = 2;
  o.transport = "tcp";
  o.listen_ip = "127.0.0.1";
  // The EP proxy's (its progress threads poll while traffic is recent on a host of many cores)
  transfer::tcp::TcpTuning t = ep::proxyTcpTuning(2, settings::usableCores());
  t.streams = streams;
  o.tcp_tuning = t;
  return o;
}

// Spins (yielding) until the signal word holds `value`; the time it did.
Clock::time_point waitSignal(const uint64_t* word, uint64_t value) {
  while (__atomic_load_n(word, __ATOMIC_ACQUIRE) != value) std::this_thread::yield();
  return Clock::now();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<double> streams{4, 8}, counts{64, 128, 256, 512};
  uint64_t row = 7392;
  double gap_us = 0.5;
  int iters = 40;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--streams") streams = parseList(argv[i + 1]);
    else if (a == "--rows") counts = parseList(argv[i + 1]);
    else if (a == "--row-bytes") row = std::strtoull(argv[i + 1], nullptr, 10);
    else if (a == "--gap-us") gap_us = std::atof(argv[i + 1]);
    else if (a == "--iters") iters = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  const uint64_t most = static_cast<uint64_t>(*std::max_element(counts.begin(), counts.end()));
  const uint64_t signal_at = 2 * most * row;
  for (double sd : streams) {
    const int s = static_cast<int>(sd);
    auto store = std::make_shared<transfer::InProcessStore>();
    std::unique_ptr<transfer::TransferEngine> e[2];
    std::thread t1([&] { e[1] = std::make_unique<transfer::TransferEngine>(store, options(1, s)); });
    e[0] = std::make_unique<transfer::TransferEngine>(store, options(0, s));
    t1.join();
    std::vector<char> inbox(signal_at + 8, 0), outbox(most * row, 1);
    e[1]->registerSegment(kInbox, inbox.data(), inbox.size());
    e[0]->openSegment(1, kInbox);
    const auto* signal = reinterpret_cast<const uint64_t*>(inbox.data() + signal_at);
    const uint64_t capacity = 4 * most + 8;
    std::vector<ep::kernels::ProxyEntry> ring(capacity);
    std::memset(static_cast<void*>(ring.data()), 0, ring.size() * sizeof(ep::kernels::ProxyEntry));
    uint64_t head = 0, ticket = 0, value = 0;
    ep::ProxyCarrier carrier(*e[0], {.rank = 0,
                                     .peers = {1},
                                     .inbox = kInbox,
                                     .entries = ring.data(),
                                     .head = &head,
                                     .capacity = capacity,
                                     .outbox = outbox.data(),
                                     .outbox_bytes = outbox.size()});
    auto post = [&](int kind, uint64_t local, uint64_t remote, uint64_t length) {
      while (ticket - __atomic_load_n(&head, __ATOMIC_ACQUIRE) >= capacity) std::this_thread::yield();
      ep::kernels::postProxyEntryFromHost(ring.data(), capacity, ticket++, kind, 1, local, remote, length);
    };
    for (double cd : counts) {
      const uint64_t n = static_cast<uint64_t>(cd);
      std::vector<double> through_carrier, as_batch;
      for (int it = 0; it < iters + 3; ++it) {  // 3 warm-ups
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        // The rows one by one, `gap_us` apart, then the signal (its value in the poster's entry).
        const auto t0 = Clock::now();
        for (uint64_t k = 0; k < n; ++k) {
          while (Clock::now() < t0 + std::chrono::nanoseconds(static_cast<int64_t>(gap_us * 1000 * k))) {
          }
          post(ep::kernels::kProxyData, k * row, 2 * k * row, row);
        }
        post(ep::kernels::kProxySignal, ++value, signal_at, 8);
        const auto t1c = waitSignal(signal, value);
        // The same rows as one batch, unordered, and the signal after them.
        std::vector<transfer::TransferRequest> batch;
        for (uint64_t k = 0; k < n; ++k) {
          transfer::TransferRequest r{transfer::Opcode::kWrite, outbox.data() + k * row, 1, kInbox, 2 * k * row, row};
          r.unordered = r.no_ack = true;
          batch.push_back(r);
        }
        const uint64_t mine = ++value;
        batch.push_back({transfer::Opcode::kWrite, const_cast<uint64_t*>(&mine), 1, kInbox, signal_at, 8});
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        const auto t0b = Clock::now();
        auto b = e[0]->submit(batch);
        const auto t1b = waitSignal(signal, mine);
        b->wait(std::chrono::seconds(60));
        if (it < 3) continue;
        through_carrier.push_back(std::chrono::duration<double, std::micro>(t1c - t0).count());
        as_batch.push_back(std::chrono::duration<double, std::micro>(t1b - t0b).count());
      }
      std::printf("%d %llu %llu %.2f %.1f %.1f\n", s, static_cast<unsigned long long>(n),
                  static_cast<unsigned long long>(row), gap_us, median(through_carrier), median(as_batch));
      std::fflush(stdout);
    }
    carrier.settle(ticket);
  }
  return 0;
}
