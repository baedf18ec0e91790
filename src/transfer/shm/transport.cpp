#include "moelink/transfer/shm/transport.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>

#include "moelink/common/error.h"

namespace moelink::transfer::shm {

namespace {

// The pid namespace this process's pids mean something in (its /proc/self/ns/pid inode): names
// carry it, so that only names of this namespace are judged by their pid.
uint64_t pidNamespace() {
  struct stat st;
  return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

}  // namespace

std::string regionPrefix() { return str("moelink.", pidNamespace(), "."); }

namespace {

// Unlinks this namespace's names whose process `doomed(pid)` says; returns how many.
template <typename Pred>
int unlinkWhere(Pred doomed) {
  const std::string prefix = regionPrefix();
  DIR* dir = opendir("/dev/shm");
  if (!dir) return 0;
  int unlinked = 0;
  while (dirent* e = readdir(dir)) {
    const std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    char* end = nullptr;
    const long pid = std::strtol(name.c_str() + prefix.size(), &end, 10);
    if (pid <= 0 || !end || *end != '.' || !doomed(static_cast<pid_t>(pid))) continue;
    if (shm_unlink(("/" + name).c_str()) == 0) ++unlinked;
  }
  closedir(dir);
  return unlinked;
}

// Whether process `pid` (of this pid namespace) is gone: no such process, or one that has
// exited and waits to be reaped (a zombie maps nothing). One that is not ours to signal counts
// as alive.
bool processGone(pid_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = std::fopen(path, "r");
  if (!f) return true;
  char line[512] = {0};
  const bool read = std::fgets(line, sizeof line, f) != nullptr;
  std::fclose(f);
  const char* close = read ? std::strrchr(line, ')') : nullptr;  // the command may hold spaces
  return close && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
}

}  // namespace

int reclaimOrphanedRegions() { return unlinkWhere(processGone); }

int unlinkOwnRegions() {
  const pid_t me = getpid();
  return unlinkWhere([me](pid_t pid) { return pid == me; });
}

SharedRegion createRegion(int rank, SegmentId id, uint64_t length) {
  static std::atomic<uint64_t> counter{0};
  // Names whose process died before unlinking them (a crash during group creation) are
  // removed by the next process of the namespace that creates one.
  static std::once_flag reclaim;
  std::call_once(reclaim, [] { reclaimOrphanedRegions(); });
  std::random_device rd;
  SharedRegion r;
  r.length = length;
  r.name = str("/", regionPrefix(), getpid(), ".", rank, ".", id, ".", counter.fetch_add(1), ".", std::hex, rd());
  int fd = shm_open(r.name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  MOELINK_SYSCHECK(fd, "shm_open(", r.name, ")");
  size_t map_len = length ? length : 1;
  if (ftruncate(fd, static_cast<off_t>(map_len)) < 0) {
    int e = errno;
    ::close(fd);
    shm_unlink(r.name.c_str());
    MOELINK_THROW("ftruncate(", r.name, ", ", map_len, ") failed: ", std::strerror(e),
                  " (is /dev/shm large enough?)");
  }
  void* p = mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) {
    int e = errno;
    shm_unlink(r.name.c_str());
    MOELINK_THROW("mmap(", r.name, ") failed: ", std::strerror(e));
  }
  r.addr = p;
  return r;
}

void destroyRegion(SharedRegion& region, bool unlink) {
  if (region.addr) munmap(region.addr, region.length ? region.length : 1);
  if (unlink && !region.name.empty()) shm_unlink(region.name.c_str());
  region.addr = nullptr;
}

bool ShmTransport::open(const PeerInfo& peer, RemoteSegment& seg) {
  if (peer.host_id != host_id_ || seg.desc.shm_name.empty()) return false;
  int fd = shm_open(seg.desc.shm_name.c_str(), O_RDWR, 0600);
  MOELINK_SYSCHECK(fd, "shm_open(", seg.desc.shm_name, ") of rank ", peer.rank,
                   " (was it unlinked before every peer opened it?)");
  size_t map_len = seg.desc.length ? seg.desc.length : 1;
  // The length comes from the peer's record: a mapping past the object's end would fault on
  // first touch (SIGBUS), so the object must really be that large.
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < map_len) {
    ::close(fd);
    MOELINK_THROW("rank ", peer.rank, "'s segment ", seg.desc.id, " ('", seg.desc.shm_name, "') holds ",
                  static_cast<uint64_t>(st.st_size), " bytes, its descriptor says ", seg.desc.length);
  }
  void* p = mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  MOELINK_CHECK(p != MAP_FAILED, "mmap of rank ", peer.rank, "'s segment ", seg.desc.id,
                " failed: ", std::strerror(errno));
  seg.mapped = p;
  return true;
}

void ShmTransport::close(RemoteSegment& seg) {
  if (seg.mapped) munmap(seg.mapped, seg.desc.length ? seg.desc.length : 1);
  seg.mapped = nullptr;
}

void orderedCopy(void* dst, const void* src, uint64_t len) {
  if (len == 8 && (reinterpret_cast<uintptr_t>(dst) & 7) == 0) {
    uint64_t v;
    std::memcpy(&v, src, 8);
    // NOTES: the release store orders every earlier copy to this peer before the signal.
    __atomic_store_n(static_cast<uint64_t*>(dst), v, __ATOMIC_RELEASE);
    return;
  }
  if (len) std::memcpy(dst, src, len);
}

void ShmTransport::post(const TransferRequest& req, const RemoteSegment& seg,
                        const BatchPtr& batch, size_t index) {
  char* remote = static_cast<char*>(seg.mapped) + req.offset;
  if (req.op == Opcode::kWrite) {
    orderedCopy(remote, req.local, req.length);
  } else {
    std::atomic_thread_fence(std::memory_order_acquire);
    if (req.length) std::memcpy(req.local, remote, req.length);
  }
  batch->complete(index);
}

}  // namespace moelink::transfer::shm
