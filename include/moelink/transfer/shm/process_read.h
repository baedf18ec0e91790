// Cross-memory reads: one process copies bytes straight out of another process's private
// memory on the same host (process_vm_readv), one copy instead of the two that a
// shared-memory slot costs (sender into the slot, receiver out of it).
//
// The kernel allows it when the reader may ptrace the target (same user; Yama's
// ptrace_scope and seccomp can forbid it), so a reader probes a target once: the target
// publishes the address of a word whose value both sides can compute, and the reader
// checks that it reads that value. A reader that cannot read falls back to the slots.
#pragma once

#include <cstdint>
#include <string>

namespace moelink::transfer::shm {

// Copies `length` bytes at `remote_addr` in process `pid` to `dst`. "" on success, else why
// not (the target exited, the range is not mapped there, permission denied).
std::string readProcess(int64_t pid, void* dst, uint64_t remote_addr, uint64_t length);

// Whether this process can read process `pid`'s memory: reads the 8 bytes at `probe_addr`
// there and compares them with `expected`.
bool canReadProcess(int64_t pid, uint64_t probe_addr, uint64_t expected);

}  // namespace moelink::transfer::shm
