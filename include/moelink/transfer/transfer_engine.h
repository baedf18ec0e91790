// TransferEngine: registers local memory segments, opens peers' segments and moves
// bytes between them with batches of one-sided WRITE and READ requests.
//
// One engine serves one group of `world_size` ranks that share a MetadataStore (in the
// backend, the group's prefixed c10d::Store; its records: records.h). On construction it
// claims its rank, which fails when a live process holds it (the newcomer is refused and the
// group is left as it was; a replacement for a failed rank finds the old process gone), checks
// that the group was created with the same world size, publishes an endpoint record (host id,
// tcp listen address, pid) and takes the group's secret from the store (rank 0 creates it);
// tcp connections must present that secret.
//
// Transport choice per (peer, segment): shm when the peer is on this host and the
// segment lives in shared memory, else tcp. MOELINK_TRANSPORT=tcp|shm|auto (default auto)
// forces one; forcing shm to a peer on another host is an error at open time.
//
// Lifetime: segments must outlive every request that targets them; destroying the engine
// stops its progress thread, fails pending requests and unmaps/unlinks shared memory.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <vector>

#include "moelink/transfer/doorbell.h"
#include "moelink/transfer/metadata_store.h"
#include "moelink/transfer/tcp/transport.h"
#include "moelink/transfer/transport.h"
#include "moelink/transfer/types.h"

namespace moelink::transfer {

namespace shm { class ShmTransport; }

// Local segments, looked up by transports that serve incoming requests.
class LocalSegments {
 public:
  struct Entry {
    void* addr = nullptr;
    uint64_t length = 0;
  };
  void add(SegmentId id, void* addr, uint64_t length);
  void remove(SegmentId id);
  // The address of [offset, offset+length) in segment id, or nullptr when the range is
  // not inside a registered segment.
  void* resolve(SegmentId id, uint64_t offset, uint64_t length) const;

  // Receive redirection (see TransferEngine::expectWrite).
  void expect(SegmentId id, uint64_t offset, void* dest, uint64_t length);
  // Where an incoming write of `length` bytes at (id, offset) goes: an expected
  // destination that is large enough (marked as used), else resolve().
  void* resolveIncomingWrite(SegmentId id, uint64_t offset, uint64_t length);
  // Removes the expectation at (id, offset); its destination if a write used it.
  void* claim(SegmentId id, uint64_t offset);
  // An expectation that an incoming write has used (and nobody has claimed yet).
  struct UsedExpectation {
    uint64_t offset = 0;
    void* dest = nullptr;
    uint64_t length = 0;  // the most the write may have put there
  };
  // Removes every expectation of segment id; returns those that writes used: their bytes are
  // at `dest`, not in the segment (the write may still be arriving).
  std::vector<UsedExpectation> clearExpectations(SegmentId id);

 private:
  struct Expectation {
    void* dest = nullptr;
    uint64_t length = 0;
    bool used = false;
  };
  mutable std::shared_mutex mu_;
  std::map<SegmentId, Entry> entries_;
  std::mutex expect_mu_;
  std::map<std::pair<SegmentId, uint64_t>, Expectation> expected_;
  // expected_.size(), readable without the lock: incoming writes of a rank that expects none
  // (most of them) skip it.
  std::atomic<size_t> expecting_{0};
};

struct EngineOptions {
  int rank = 0;
  int world_size = 1;
  std::string transport;  // "" reads MOELINK_TRANSPORT (auto|tcp|shm)
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  // A process that takes the place of a failed rank (or grows the group): it joins a
  // running group instead of creating one (it does not make the group's secret).
  bool extension = false;
  // The tcp listener's address ("": MOELINK_HOST_IP, else the first interface; see
  // tcp::advertisedIp()).
  std::string listen_ip;
  // Whether this process reads same-host peers' memory directly where it can (canReadFrom);
  // MOELINK_SHM_PULL=0 turns it off too.
  bool cross_memory_reads = true;
  // The tcp transport's connections per peer and striping (unset: MOELINK_TCP_STREAMS and
  // MOELINK_TCP_STRIPE_BYTES, tcp::TcpTuning::fromEnv()).
  std::optional<tcp::TcpTuning> tcp_tuning;
};

class TransferEngine {
 public:
  TransferEngine(std::shared_ptr<MetadataStore> store, EngineOptions options);
  ~TransferEngine();
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  int rank() const { return opts_.rank; }
  int worldSize() const { return opts_.world_size; }
  const std::string& transportMode() const { return mode_; }

  // Allocates `length` zeroed bytes that same-host peers can map (POSIX shm unless the
  // mode is tcp) and registers them as segment `id`. The engine owns the memory.
  void* allocateSegment(SegmentId id, uint64_t length);
  // Registers caller-owned memory as segment `id` (reachable over tcp only).
  void registerSegment(SegmentId id, void* addr, uint64_t length);
  void unregisterSegment(SegmentId id);

  // Opens segment `id` of `peer` (waits for its publication up to the timeout).
  // Idempotent. Returns the transport's name.
  std::string openSegment(int peer, SegmentId id);
  // The transport chosen for an opened segment ("local", "shm", "tcp").
  std::string transportOf(int peer, SegmentId id) const;
  // Bytes sent to peers over tcp on each of its streams (TcpTransport::sentPerStream).
  std::vector<uint64_t> tcpSentPerStream() const;

  // Removes the names of this rank's shared-memory segments; mappings stay valid. Call
  // once every peer has opened them, so that nothing is left in /dev/shm.
  void unlinkSharedNames();

  // Validates every request (peer, segment opened, bounds) and posts the batch. A request
  // that fails validation is failed in the batch with its reason; the rest proceed.
  BatchPtr submit(const std::vector<TransferRequest>& requests);

  // This rank's doorbell (see doorbell.h): rung by peers' requests flagged `notify`, by
  // the completion of this rank's tcp requests, and by ringLocal().
  uint32_t doorbellValue() const { return transfer::doorbellValue(doorbell_); }
  void waitDoorbell(uint32_t seen, std::chrono::microseconds timeout) {
    transfer::waitDoorbell(doorbell_, seen, timeout);
  }
  void ringLocal() { ringDoorbell(doorbell_); }
  // Rings `peer`'s doorbell (its segments must have been opened).
  void notify(int peer);
  // Why `peer` is known to be unreachable (a tcp connection to it broke), or ""; losses()
  // counts the peers lost so far (an atomic load: poll it, then ask lostReason).
  std::string lostReason(int peer) const;
  uint64_t losses() const;

  // Receive redirection, for transports that receive into memory themselves (tcp): the
  // next incoming write of at most `length` bytes at (id, offset) of this rank's segment
  // is placed at `dest` instead, saving the copy out of the segment. claimExpected()
  // removes the expectation and tells whether a write used it (then the data is at
  // `dest`, else at (id, offset) as usual). The caller must install it before the writer
  // can send (the mailbox does so before returning the credit for that slot). clearExpected()
  // drops them all and returns those that writes used, whose data is at their `dest`.
  void expectWrite(SegmentId id, uint64_t offset, void* dest, uint64_t length) {
    local_.expect(id, offset, dest, length);
  }
  void* claimExpected(SegmentId id, uint64_t offset) { return local_.claim(id, offset); }
  std::vector<LocalSegments::UsedExpectation> clearExpected(SegmentId id) { return local_.clearExpectations(id); }

  // Liveness of `peer`, independent of its collective progress: "" when it is alive, else
  // why not. A peer on this host (same pid namespace) is checked through /proc (a gone or
  // zombie process, or a reused pid, is dead); another host's through a tcp connection to
  // its listener (refused or unanswered within `timeout`: dead). Blocks up to `timeout`.
  // `incarnation` > 0 probes that incarnation's process (read afresh from the store).
  // `certain`, when given, is set when the answer cannot be a partition (the process is
  // gone on this host, or the peer's host refused the connection).
  std::string probe(int peer, std::chrono::milliseconds timeout, int64_t incarnation = 0,
                    bool* certain = nullptr);
  // Forgets `peer`: closes its opened segments and its connection, drops its endpoint, so
  // that openSegment() reaches the process that now has its rank (its current incarnation).
  void forgetPeer(int peer);
  // How many processes have had `rank` in this group (1 for the first); the store keys of a
  // rank carry it, so that a replacement never reads its predecessor's addresses.
  int64_t incarnation() const { return incarnation_; }

  // Cross-memory reads (shm/process_read.h), for same-host peers. canReadFrom(): whether
  // this process can read `peer`'s private memory (probed once per peer process; false
  // across pid namespaces, under MOELINK_SHM_PULL=0, or where the kernel forbids it).
  // readFrom(): copies `length` bytes at address `remote_addr` of `peer`'s process to `dst`;
  // "" on success, else why not.
  bool canReadFrom(int peer);
  std::string readFrom(int peer, void* dst, uint64_t remote_addr, uint64_t length);
  // Where [offset, offset+length) of `peer`'s opened segment `id` is mapped in this process
  // (shm), for atomics on words both sides share; nullptr when it is not mapped here.
  void* mappedAt(int peer, SegmentId id, uint64_t offset, uint64_t length);

  // The tcp listen address published for this rank ("ip:port").
  std::string tcpAddress() const;
  const std::string& hostId() const { return host_id_; }
  // The host id that `peer` published (waits for it up to the timeout).
  std::string hostIdOf(int peer) { return peerInfo(peer).host_id; }
  uint64_t secret() const { return secret_; }

 private:
  struct OwnedSegment {
    void* addr = nullptr;
    uint64_t length = 0;
    std::string shm_name;  // cleared once unlinked
    bool owned = false;
    bool shared = false;  // mapped from POSIX shm (else anonymous pages, or caller-owned)
  };
  static void releaseOwned(OwnedSegment& seg);
  // Takes this process's rank: a new incarnation of it, unless a live process holds it.
  void claimRank();
  // Who holds incarnation `incarnation` of `rank` and is alive ("" when gone, or this process).
  std::string liveHolder(int rank, int64_t incarnation);
  // Compares this rank's world size with the one the group was created with (fails the group's
  // waiting ranks too on a difference).
  void checkGroupSize();
  // Why the process behind `info` is gone, or "" while it lives (probe()).
  std::string processGone(const PeerInfo& info, std::chrono::milliseconds timeout, bool* certain);
  // The peer's endpoint record; store reads wait up to `wait` (default: the engine's timeout).
  const PeerInfo& peerInfo(int peer, std::optional<std::chrono::milliseconds> wait = std::nullopt);
  PeerInfo readPeerInfo(int peer, const std::string& key, std::optional<std::chrono::milliseconds> wait = std::nullopt);
  RemoteSegment* findOpened(int peer, SegmentId id);
  // "engine/<what>/<rank>.<incarnation>"
  std::string key(int rank, const std::string& what, std::optional<std::chrono::milliseconds> wait = std::nullopt);

  std::shared_ptr<MetadataStore> store_;
  EngineOptions opts_;
  std::string mode_;
  std::string host_id_;
  uint64_t secret_ = 0;
  int64_t incarnation_ = 1;
  std::string claim_token_;  // what this engine wrote to claim its incarnation
  LocalSegments local_;
  std::unique_ptr<tcp::TcpTransport> tcp_;
  std::unique_ptr<shm::ShmTransport> shm_;

  mutable std::mutex mu_;  // guards the maps below (not the data path's fast lookups)
  std::map<SegmentId, OwnedSegment> segments_;
  std::map<int, PeerInfo> peers_;
  std::map<int, int64_t> incarnations_;  // peers' current incarnations, once read
  std::map<std::pair<int, SegmentId>, std::unique_ptr<RemoteSegment>> opened_;
  std::map<int, bool> readable_;  // canReadFrom's answers, per peer process
  // Published by address: a reader that reads this value here may read this process.
  uint64_t read_probe_ = 0;
  DoorbellWord* doorbell_ = nullptr;
  std::vector<RemoteSegment*> peer_doorbells_;  // by rank, once opened
};

// Reserved segment id of every engine's doorbell.
constexpr SegmentId kDoorbellSegment = 0xFFFFFFF0u;

// A stable id of this host: MOELINK_HOST_ID if set, else hostname + kernel boot id.
std::string localHostId();

}  // namespace moelink::transfer
