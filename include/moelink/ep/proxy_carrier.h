// ProxyCarrier: the CPU proxy's thread (plain C++: no CUDA, no torch). It takes what has been
// posted into the ring (proxy_ring.h) as a batch, plans it (planProxyBatch: the data, rows of
// consecutive tokens merged, then the signals) and hands the writes to the transfer engine,
// into each peer's inbox segment; when the engine has carried the batch, it advances the
// ring's head, which frees the entries for the poster. EpProxy (proxy.h) gives it a ring and
// an outbox in host memory that the GPU maps; tests give it plain memory and post from a
// thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "moelink/ep/proxy_ring.h"
#include "moelink/transfer/types.h"

namespace moelink::transfer {
class TransferEngine;
}  // namespace moelink::transfer

namespace moelink::ep {

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
  };
  // Starts the thread. The engine outlives the carrier.
  ProxyCarrier(transfer::TransferEngine& engine, Config config);
  // Stops the thread after the batch in hand (settle() first to deliver everything posted).
  ~ProxyCarrier();
  ProxyCarrier(const ProxyCarrier&) = delete;
  ProxyCarrier& operator=(const ProxyCarrier&) = delete;

  // Waits (up to the timeout) until the first `tail` entries are carried out. False if the
  // time ran out.
  bool settle(uint64_t tail) const;
  // Held while a batch is with the engine: whoever changes the engine's peers takes it.
  std::mutex& io() { return io_mu_; }

 private:
  void run();

  transfer::TransferEngine& engine_;
  Config c_;
  std::atomic<bool> stop_{false};
  std::mutex io_mu_;
  std::thread thread_;
};

}  // namespace moelink::ep
