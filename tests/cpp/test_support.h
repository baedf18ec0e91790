// Ranks as threads of one process over an in-process store.
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "moelink/transfer/metadata_store.h"

namespace moelink::testing {

// Runs fn(rank) on `world` threads and rethrows the first exception.
inline void runRanks(int world, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  std::exception_ptr first;
  std::mutex mu;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        std::lock_guard<std::mutex> g(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

inline uint8_t pattern(int rank, uint64_t i) { return static_cast<uint8_t>((i * 131 + rank * 17 + 7) & 0xff); }

}  // namespace moelink::testing
