#include "moelink/transfer/doorbell.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>

namespace moelink::transfer {

// NOTES: both sides use sequentially consistent atomics: a ringer that reads waiters == 0
// did its increment before the sleeper registered, so the sleeper's futex check (bell ==
// seen) fails and it does not sleep. The futex is not PRIVATE: the word is shared memory.
void ringDoorbell(DoorbellWord* d) {
  __atomic_fetch_add(&d->bell, 1, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&d->waiters, __ATOMIC_SEQ_CST) != 0)
    syscall(SYS_futex, &d->bell, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

uint32_t doorbellValue(const DoorbellWord* d) { return __atomic_load_n(&d->bell, __ATOMIC_SEQ_CST); }

void waitDoorbell(DoorbellWord* d, uint32_t seen, std::chrono::microseconds timeout) {
  __atomic_fetch_add(&d->waiters, 1, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&d->bell, __ATOMIC_SEQ_CST) == seen) {
    timespec ts;
    ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000);
    ts.tv_nsec = static_cast<long>((timeout.count() % 1000000) * 1000);
    syscall(SYS_futex, &d->bell, FUTEX_WAIT, seen, &ts, nullptr, 0);
  }
  __atomic_fetch_sub(&d->waiters, 1, __ATOMIC_SEQ_CST);
}

}  // namespace moelink::transfer
