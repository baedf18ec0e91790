// Busy-waiting helpers for threads that poll for a short while before they sleep.
#pragma once

#include <thread>

namespace moelink {

// One pause between polls (lets the core's sibling thread run, and costs the bus nothing).
inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// A polling thread's turn: a pause, and every 64th time a yield, so that polling threads on a
// host with fewer free cores than threads let the others run.
inline void spinTurn(unsigned& spins) {
  if (++spins % 64 == 0)
    std::this_thread::yield();
  else
    cpuRelax();
}

}  // namespace moelink
