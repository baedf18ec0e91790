// shm transport: peers on the same host map each other's segments from POSIX shared
// memory, so a WRITE or READ is a memcpy done on the submitting thread.
#pragma once

#include <string>

#include "moelink/transfer/transport.h"

namespace moelink::transfer::shm {

// Memory in POSIX shared memory, created by this process.
struct SharedRegion {
  void* addr = nullptr;
  uint64_t length = 0;
  std::string name;
};

// Creates a zeroed region named uniquely for (rank, segment id).
// Names are /moelink.<pid namespace>.<pid>.<rank>.<segment>.<n>.<random>.
SharedRegion createRegion(int rank, SegmentId id, uint64_t length);
// "moelink.<pid namespace>.": the start of this namespace's names in /dev/shm.
std::string regionPrefix();
// Unlinks this namespace's names whose process is gone; returns how many. createRegion calls it
// once per process, and the engine whenever it forgets a peer (a dead rank masked out).
int reclaimOrphanedRegions();
// Unlinks every name of this process (the mappings stay valid): at exit, so that no name of
// it outlives it, whatever still holds a mapping.
int unlinkOwnRegions();
void destroyRegion(SharedRegion& region, bool unlink);

class ShmTransport : public Transport {
 public:
  explicit ShmTransport(std::string local_host_id) : host_id_(std::move(local_host_id)) {}
  const char* name() const override { return "shm"; }
  bool open(const PeerInfo& peer, RemoteSegment& seg) override;
  void close(RemoteSegment& seg) override;
  void post(const TransferRequest& req, const RemoteSegment& seg, const BatchPtr& batch,
            size_t index) override;

 private:
  std::string host_id_;
};

// Copies `len` bytes; an aligned 8-byte copy is one atomic store (release).
void orderedCopy(void* dst, const void* src, uint64_t len);

}  // namespace moelink::transfer::shm
