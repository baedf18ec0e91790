// ProxyCarrier: the CPU proxy's threads (plain C++: no CUDA, no torch). The carrier takes what
// has been posted into the ring (proxy_ring.h) as a batch, plans it into waves
// (planProxyBatch: data, rows of consecutive tokens merged, then the signals that follow it)
// and hands the writes to the transfer engine, into each peer's inbox segment, then takes the
// next batch without waiting for this one (up to kMaxInFlight batches with the engine: the
// engine applies a peer's requests in submission order, so a later batch's signals still land
// after every earlier row); as the engine finishes the batches, in ring order, it advances the
// ring's head, which frees their entries and outbox bytes for the poster. A poster that posts
// rows one by one (a GPU's warps) thus never waits for a round trip per batch. A wave's data to peers over shared memory, where the engine copies in the
// submitting thread, is split over `threads` threads (the carrier and its helpers) that
// submit their parts at once (one core copies a few GB/s); data to peers
// over tcp, whose own threads carry it, is one submission, its writes unordered (spread over
// the tcp streams; the signals after them still land after all of them) unless `spread` is off,
// the batch and those in flight are small (`spread_bytes`) or its writes overlap. The wave's signals are submitted
// once all of its data has been (the engine applies a peer's requests in submission order). EpProxy (proxy.h) gives it a ring and
// an outbox in host memory that the GPU maps; tests give it plain memory and post from a
// thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "moelink/ep/proxy_ring.h"
#include "moelink/transfer/tcp/transport.h"
#include "moelink/transfer/types.h"

namespace moelink::transfer {
class TransferEngine;
}  // namespace moelink::transfer

namespace moelink::ep {

// The tcp tuning of the engine a carrier drives (EpProxy's, the carrier's benchmark's): the
// transport's own (TcpTuning::fromEnv) but for its progress threads, which poll for
// MOELINK_EP_PROXY_TCP_SPIN_US after their last work, by default kProxyTcpSpinUs where the
// process has at least kProxyTcpSpinCores cores to itself (`cores`: those it may run on over the
// group's ranks on its host), else not at all. The carrier's own threads spin while its traffic
// is recent, and so do these: a proxy peer's rows are taken on each hop without a thread being
// woken (docs/PERF.md, the EP proxy's carrier: 0.55-0.81x the time of sleeping threads for
// bursts of 1-256 rows on 16 cores). On a host with few cores the polling threads would take
// the cores the other threads need.
constexpr uint64_t kProxyTcpSpinUs = 3000;
constexpr int kProxyTcpSpinCores = 16;
transfer::tcp::TcpTuning proxyTcpTuning(int world_size, int cores);

class ProxyCarrier {
 public:
  struct Config {
    int rank = 0;
    std::vector<int> peers;             // the ranks it may write to
    transfer::SegmentId inbox = 0;      // their inbox segment (opened on the engine)
    kernels::ProxyEntry* entries = nullptr;  // the ring: `capacity` entries
    uint64_t* head = nullptr;           // entries consumed, written here (release)
    uint64_t capacity = 0;
    const char* outbox = nullptr;       // data offsets are from here
    uint64_t outbox_bytes = 0;
    std::chrono::milliseconds timeout{300000};  // how long a batch may take before it is logged and passed
    int threads = 1;                    // threads that carry a wave's data (the carrier included)
    uint64_t wave_bytes = kProxyWaveBytes;  // planProxyBatch's
    uint64_t part_bytes = 64 << 10;     // the least data a thread takes from a wave
    bool spread = true;                 // tcp data writes unordered (TransferRequest::unordered)
    // ... in a batch that carries at least this much data together with the batches still in
    // flight: below it the rows go in order on one connection, which wakes fewer threads for a
    // lone small batch (docs/PERF.md, the tcp transport's rows: unordered 0.5-1.1x in order for
    // one batch of 256 KiB, 1.0-3.1x from 1 MiB; the carrier's own benchmark: a burst of rows
    // posted one by one arrives sooner spread from 256 KiB than from 1 MiB).
    uint64_t spread_bytes = 256 << 10;
  };
  // Starts the thread. The engine outlives the carrier.
  ProxyCarrier(transfer::TransferEngine& engine, Config config);
  // Stops the threads once the batches in hand are done (settle() first to deliver everything
  // posted).
  ~ProxyCarrier();
  ProxyCarrier(const ProxyCarrier&) = delete;
  ProxyCarrier& operator=(const ProxyCarrier&) = delete;

  // Waits (up to the timeout) until the first `tail` entries are carried out. False if the
  // time ran out.
  bool settle(uint64_t tail) const;
  // Batches carried so far but not yet finished, at most.
  static constexpr size_t kMaxInFlight = 32;
  // Whoever changes the engine's peers holds this lock meanwhile: the carrier holds it while
  // any batch is with the engine, takes no new batch while someone waits for it, and lets it go
  // once those in flight are done.
  std::unique_lock<std::mutex> quiesce();

 private:
  struct InFlight;
  void run();
  void help(size_t part);
  // Submits a wave's data, split into parts over the threads; returns once every part has
  // been submitted (their batches are added to `pending`).
  void carryData(const ProxyWave& wave, bool unordered, std::vector<transfer::BatchPtr>& pending);
  transfer::TransferRequest request(const ProxyWrite& w, uint64_t skip, uint64_t length);
  // Whether the engine's transport to `peer` copies in the submitting thread (shared memory).
  bool copiesHere(int peer) const;

  transfer::TransferEngine& engine_;
  Config c_;
  std::atomic<bool> stop_{false};
  std::mutex io_mu_;
  std::atomic<int> io_wanted_{0};  // threads waiting in quiesce()
  // The signal values of batches passed on a timeout (the engine may still read them): kept
  // as long as the carrier.
  std::vector<std::vector<uint64_t>> passed_values_;
  // Work for the helpers: part i + 1 of the current wave is parts_[i + 1] (part 0 is the
  // carrier's); a new wave raises `round_`, each helper lowers `busy_` when its part is submitted.
  std::vector<std::vector<transfer::TransferRequest>> parts_;
  std::vector<transfer::BatchPtr> part_batches_;
  std::atomic<uint64_t> round_{0};
  std::atomic<int> busy_{0};
  std::atomic<bool> quit_helpers_{false};  // set once the carrier thread has ended
  std::mutex wake_mu_;
  std::condition_variable wake_;
  std::vector<std::thread> helpers_;
  std::thread thread_;
};

}  // namespace moelink::ep
