// Doorbell: a counter that one thread sleeps on and others ring, across processes.
//
// The word lives in memory the ringers can reach: a same-host peer rings it through its
// shared-memory mapping; for a tcp peer, this process's progress thread rings it when a
// write flagged `notify` arrives. Ringing costs one atomic add, plus a futex wake only
// while someone sleeps. A sleeper reads value(), checks for work, then calls
// wait(seen, ...), which returns at once if the bell rang in between (no lost wakeups).
#pragma once

#include <chrono>
#include <cstdint>

namespace moelink::transfer {

struct alignas(64) DoorbellWord {
  uint32_t bell;     // incremented by every ring
  uint32_t waiters;  // threads inside wait()
};

void ringDoorbell(DoorbellWord* d);
uint32_t doorbellValue(const DoorbellWord* d);
// Sleeps until the bell differs from `seen` or `timeout` passes (spurious returns allowed).
void waitDoorbell(DoorbellWord* d, uint32_t seen, std::chrono::microseconds timeout);

}  // namespace moelink::transfer
