// Transport: one way of moving bytes to a peer's registered segment.
//
// The engine owns segments and peers; a transport only moves bytes. The engine asks a
// transport whether it can reach a (peer, segment) and then hands it requests whose
// bounds it has already checked against the peer's published descriptor. A transport
// completes or fails every request it accepts (TransferBatch::complete / fail), never
// drops one; a peer whose connection breaks fails its pending requests with a reason.
//
// Implementations live in one folder each with the same file names:
// tcp/transport.{h,cpp}, shm/transport.{h,cpp}; rdma/ (ibverbs RC) and CUDA IPC are
// planned to sit beside them behind the same interface.
#pragma once

#include <string>

#include "moelink/transfer/types.h"

namespace moelink::transfer {

// What the engine knows about a peer, from the peer's published endpoint record.
struct PeerInfo {
  int rank = -1;
  std::string host_id;
  std::string tcp_address;  // "ip:port"
  // The process behind the rank, for liveness checks on its host (0: not published).
  int64_t pid = 0;
  uint64_t start_time = 0;  // /proc/<pid>/stat field 22 (tells a reused pid apart)
  std::string pid_ns;       // /proc/self/ns/pid link text
  uint64_t read_probe = 0;  // address of the process's cross-memory probe word (0: none)
};

// A peer's segment as opened by this rank.
struct RemoteSegment {
  SegmentDesc desc;
  class Transport* via = nullptr;
  void* mapped = nullptr;  // set by transports that map the memory (shm)
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  // Whether this transport can reach `seg` on `peer`; may prepare per-peer state (connect,
  // map). Called once per opened segment, on the caller's thread.
  virtual bool open(const PeerInfo& peer, RemoteSegment& seg) = 0;
  // Releases what open() prepared for `seg`.
  virtual void close(RemoteSegment& seg) = 0;
  // Starts request `index` of `batch`. Requests are pre-validated by the engine.
  virtual void post(const TransferRequest& req, const RemoteSegment& seg, const BatchPtr& batch,
                    size_t index) = 0;
  // Hands what post() queued to the transport's threads. The engine calls it once after posting a
  // batch's requests, so that a batch of many small requests wakes each thread once, not once per
  // request (tcp: a system call in the submitting thread for each wake). Any thread may call it;
  // it wakes what any thread queued.
  virtual void flush() {}
  // Why `peer` can no longer be reached through this transport (its connection broke), or ""
  // while nothing is known against it; losses() counts the peers lost so far (cheap to poll).
  virtual std::string lostReason(int peer) const { return ""; }
  virtual uint64_t losses() const { return 0; }
};

}  // namespace moelink::transfer
