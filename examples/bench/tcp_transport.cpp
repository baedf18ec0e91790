// The tcp transport's own bandwidth between two engines of one process over loopback: the
// ceiling that the collectives' numbers over tcp are read against. For each number of streams
// (connections and progress threads per peer) and write size, the median time of one write
// (posted, acknowledged) one way, and both ways at once. Run by examples/bench/tcp_transport.py,
// which prints the table and plots it; alone:
//
//   build/moelink_tcp_bench [--streams 1,2,4,8] [--min-bytes N] [--max-bytes N] [--iters N] [--rows R [--wave W]]
//
// Prints one line per (streams, bytes): "streams bytes one_way_GBps both_ways_GBps" (both ways:
// the bytes each engine sends per second while the other sends as much to it). With --rows R the
// bytes go as rows of R bytes into every other R-byte slot of the peer (as the EP proxy sends
// token rows) and then an 8-byte signal, one batch, one way, and the line is "streams bytes
// in_order_GBps unordered_GBps": the rows in order (on the first stream), then unordered and
// unacknowledged (TransferRequest::unordered: spread over the streams). With --wave W a signal
// follows every W bytes of rows too (the EP proxy's batches: a wave of rows, then its signals).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "moelink/transfer/transfer_engine.h"

using namespace moelink::transfer;
using Clock = std::chrono::steady_clock;

namespace {

std::vector<int> parseList(const std::string& s) {
  std::vector<int> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::atoi(item.c_str()));
  return out;
}

EngineOptions options(int rank, int streams) {
  EngineOptions o;
  o.rank = rank;
  o.world_size = 2;
  o.transport = "tcp";
  o.listen_ip = "127.0.0.1";
  tcp::TcpTuning t = tcp::TcpTuning::fromEnv();
  t.streams = streams;
  o.tcp_tuning = t;
  return o;
}

// Seconds per batch (submitted, completed), median of `iters`.
double timeBatch(TransferEngine& from, const std::vector<TransferRequest>& batch, int iters) {
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = Clock::now();
    auto b = from.submit(batch);
    if (!b->wait(std::chrono::seconds(120)) || b->failed()) {
      std::fprintf(stderr, "write failed: %s\n", b->error().c_str());
      std::exit(1);
    }
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Seconds per write of `bytes` from `from` to `to`, median of `iters`.
double timeWrites(TransferEngine& from, int to, char* src, uint64_t bytes, int iters) {
  return timeBatch(from, {{Opcode::kWrite, src, to, 1, 0, bytes}}, iters);
}

// Seconds per batch of `bytes` in rows of `row` bytes (into every other slot) and a signal after
// them (and after every `wave` bytes of them; 0: at the end only), median of `iters`. The
// signals go to the 8-byte words from `signals` on.
double timeRows(TransferEngine& from, int to, char* src, uint64_t bytes, uint64_t row, uint64_t wave,
                uint64_t signals, bool unordered, int iters) {
  std::vector<TransferRequest> batch;
  const uint64_t word = 1;
  uint64_t since = 0, k = 0;
  for (uint64_t at = 0; at < bytes; at += row) {
    TransferRequest r{Opcode::kWrite, src + at, to, 1, 2 * at, std::min(row, bytes - at)};
    r.unordered = r.no_ack = unordered;
    batch.push_back(r);
    since += r.length;
    if ((wave && since >= wave) || at + row >= bytes) {
      batch.push_back({Opcode::kWrite, const_cast<uint64_t*>(&word), to, 1, signals + 8 * k++, 8});
      since = 0;
    }
  }
  return timeBatch(from, batch, iters);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> streams{1, 2, 4, 8};
  uint64_t min_bytes = 1 << 20, max_bytes = 256 << 20;
  int iters = 20;
  uint64_t row = 0, wave = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--streams") streams = parseList(argv[i + 1]);
    else if (a == "--min-bytes") min_bytes = std::strtoull(argv[i + 1], nullptr, 10);
    else if (a == "--max-bytes") max_bytes = std::strtoull(argv[i + 1], nullptr, 10);
    else if (a == "--iters") iters = std::atoi(argv[i + 1]);
    else if (a == "--rows") row = std::strtoull(argv[i + 1], nullptr, 10);
    else if (a == "--wave") wave = std::strtoull(argv[i + 1], nullptr, 10);
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  for (int s : streams) {
    auto store = std::make_shared<InProcessStore>();
    std::unique_ptr<TransferEngine> e[2];
    std::thread t1([&] { e[1] = std::make_unique<TransferEngine>(store, options(1, s)); });
    e[0] = std::make_unique<TransferEngine>(store, options(0, s));
    t1.join();
    std::vector<char> seg[2], src[2];
    // rows: every other slot, then the signals (one per row at most)
    const uint64_t signals = 2 * max_bytes;
    const uint64_t seg_bytes = row ? signals + 8 * (max_bytes / row + 1) : max_bytes;
    for (int r = 0; r < 2; ++r) {
      seg[r].assign(seg_bytes, 0);
      src[r].assign(max_bytes, static_cast<char>(r + 1));
      e[r]->registerSegment(1, seg[r].data(), seg_bytes);
    }
    for (int r = 0; r < 2; ++r) e[r]->openSegment(1 - r, 1);
    for (uint64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
      const int n = std::max(3, static_cast<int>(std::min<uint64_t>(iters, (4ull << 30) / bytes)));
      if (row) {
        double t[2];
        for (int unordered : {0, 1}) {
          timeRows(*e[0], 1, src[0].data(), bytes, row, wave, signals, unordered, 2);  // warm-up
          t[unordered] = timeRows(*e[0], 1, src[0].data(), bytes, row, wave, signals, unordered, n);
        }
        std::printf("%d %llu %.3f %.3f\n", s, static_cast<unsigned long long>(bytes), bytes / t[0] / 1e9,
                    bytes / t[1] / 1e9);
        std::fflush(stdout);
        continue;
      }
      timeWrites(*e[0], 1, src[0].data(), bytes, 2);  // warm-up
      const double one = timeWrites(*e[0], 1, src[0].data(), bytes, n);
      double back = 0;
      std::thread other([&] { back = timeWrites(*e[1], 0, src[1].data(), bytes, n); });
      const double both = timeWrites(*e[0], 1, src[0].data(), bytes, n);
      other.join();
      std::printf("%d %llu %.3f %.3f\n", s, static_cast<unsigned long long>(bytes), bytes / one / 1e9,
                  bytes / std::max(both, back) / 1e9);
      std::fflush(stdout);
    }
  }
  return 0;
}
