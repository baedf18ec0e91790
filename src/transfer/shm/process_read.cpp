#include "moelink/transfer/shm/process_read.h"

#include <sys/uio.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "moelink/common/error.h"

namespace moelink::transfer::shm {

std::string readProcess(int64_t pid, void* dst, uint64_t remote_addr, uint64_t length) {
  uint64_t done = 0;
  while (done < length) {
    iovec local{static_cast<char*>(dst) + done, static_cast<size_t>(length - done)};
    iovec remote{reinterpret_cast<void*>(remote_addr + done), static_cast<size_t>(length - done)};
    ssize_t n = process_vm_readv(static_cast<pid_t>(pid), &local, 1, &remote, 1, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      char where[32];
      std::snprintf(where, sizeof where, "0x%llx", static_cast<unsigned long long>(remote_addr + done));
      return str("reading ", length - done, " bytes of process ", pid, " at ", where,
                 " failed: ", n < 0 ? std::strerror(errno) : "nothing read");
    }
    done += static_cast<uint64_t>(n);  // a partial read stops at a page that is not mapped; retry reports it
  }
  return "";
}

bool canReadProcess(int64_t pid, uint64_t probe_addr, uint64_t expected) {
  if (pid <= 0 || probe_addr == 0) return false;
  uint64_t got = 0;
  return readProcess(pid, &got, probe_addr, sizeof got).empty() && got == expected;
}

}  // namespace moelink::transfer::shm
