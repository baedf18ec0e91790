// tcp transport: works between any two hosts.
//
// Files: transport.cpp (lifecycle, the calls below), loop.cpp (the progress thread), listener.cpp
// (listening, accepting, handshakes), pair.cpp (a connection's frames); impl.h ties them.
//
// Each engine listens on one port. For its own requests a rank opens `streams` outbound
// connections per peer (lazily, at the first opened segment of that peer): a primary and
// streams - 1 lanes, each presenting {magic, group secret, rank, lane, session}; the peer
// closes connections with a wrong secret. Frames name the target segment, offset and
// length; the receiving side bounds-checks every frame against its registered segments and
// answers a NACK for one outside them, without touching memory. All sockets are
// non-blocking; `streams` progress threads drive them (epoll), thread i the lanes i of
// every peer both ways, thread 0 also the primaries and the listener; submitters enqueue
// and wake them through eventfds.
//
// Striping: a write of at least `stripe_bytes` is cut into up to `streams` parts of at least
// 64 KiB, one per connection, so that several threads and sockets move it at once.
//
// Order: the sender numbers its requests to a peer 1, 2, ...; every request but a striped
// write travels on the primary, in order, and the receiver applies it only once every request
// numbered below it has landed, which gives the engine's per-peer ordering contract (a signal
// after a striped write is applied after all of its parts). The parts of a striped write land
// as they arrive: they are not ordered against other striped writes in flight (see
// TransferRequest). A write of one part (an unordered write below two parts' size: an EP proxy's
// row) lands as a whole on its connection, which records it in the session's order later, for
// many such writes at once (when its reads pause, or every 64 of them), so that connections
// carrying many small writes do not queue on the session's lock for each. Its number is checked
// then: one the session has applied or seen closes the connection, after the write's bytes
// (bounds-checked like any write's) landed. A write completes when the peer acknowledges it (each of its parts); a
// read when its data has arrived. A broken connection fails all of its pending requests and
// every later one to that peer. On the receiving side a session whose connection closed (a
// sender that left closes them one by one) still applies, in order, every request that came in
// full before, as one connection would; a request that waits for an earlier one fails once no
// lane is left open to bring it, and a protocol error on any connection of the session stops it
// applying anything more. A transport that shuts down first waits (up to 1 s) for its sockets'
// sent bytes to be acknowledged, reading and dropping what comes in, so that closing does not
// reset the connections and drop what the peers have not received yet.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moelink/transfer/transport.h"

namespace moelink::transfer {
class LocalSegments;
}

namespace moelink::transfer::tcp {

// How many connections and threads carry the traffic, and which writes are striped over them.
struct TcpTuning {
  int streams = 1;                   // connections per peer and progress threads (1..kMaxStreams)
  uint64_t stripe_bytes = 256 << 10;  // writes of at least this size are striped (streams > 1)
  // How long a progress thread keeps polling its sockets after its last work before it sleeps in
  // epoll_wait (0: it sleeps at once); a thread that polls answers the next frame without being
  // woken, and keeps a core busy meanwhile.
  uint64_t spin_us = 0;
  // MOELINK_TCP_STREAMS, MOELINK_TCP_STRIPE_BYTES, MOELINK_TCP_SPIN_US (common/settings.cpp); the
  // default number of streams by the host's cores, capped for a group of `world_size` ranks by
  // the file descriptors.
  static TcpTuning fromEnv(int world_size = 1);
};
constexpr int kMaxStreams = 16;

class TcpTransport : public Transport {
 public:
  // `ring_local` rings this process's doorbell: called after applying a peer's write
  // flagged notify, and after this side's requests complete or fail.
  // `ip`: the address to listen on and advertise ("": MOELINK_HOST_IP, or the first interface;
  // see advertisedIp()); one that is not an address of this host is an error (nothing
  // listens on other interfaces instead). Handshakes must name a rank below `world_size`.
  TcpTransport(int rank, int world_size, uint64_t secret, LocalSegments& segments,
               std::chrono::milliseconds connect_timeout, std::function<void()> ring_local,
               const std::string& ip = "", const TcpTuning& tuning = TcpTuning::fromEnv());
  ~TcpTransport() override;
  const char* name() const override { return "tcp"; }
  bool open(const PeerInfo& peer, RemoteSegment& seg) override;
  void close(RemoteSegment& seg) override;
  void post(const TransferRequest& req, const RemoteSegment& seg, const BatchPtr& batch,
            size_t index) override;
  void flush() override;
  std::string lostReason(int peer) const override;
  uint64_t losses() const override;

  // "ip:port" that peers connect to.
  std::string address() const;
  // Connections per peer (and progress threads).
  int streams() const;
  // Bytes this rank has sent to its peers on each stream (frames included), since it started.
  std::vector<uint64_t> sentPerStream() const;
  // Stops the progress thread and fails every pending request.
  void shutdown();
  // Drops everything known about `peer` (its connection, its loss), so that a process that
  // replaces it is connected afresh.
  void forget(int peer);

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Wire format, shared with tests that speak the protocol by hand.
namespace wire {
constexpr uint64_t kHelloMagic = 0x6d6f656c696e6b32ULL;  // "moelink2"
// The first bytes on a connection; the listener answers kHelloMagic (8 bytes).
struct Hello {
  uint64_t magic;
  uint64_t secret;
  int32_t rank;
  int32_t lane;      // 0: the primary connection; 1..kMaxStreams-1: a lane
  uint64_t session;  // the sender's connections of one generation share it
};
static_assert(sizeof(Hello) == 32, "hello is 32 bytes on the wire");
// "" when `h` opens a connection of this group (its magic and secret, a rank of the group, a lane
// below kMaxStreams), else why not.
std::string checkHello(const Hello& h, uint64_t secret, int world_size);
// kWritePart: one part of a striped write; its FrameHeader names the whole write's segment and
// offset, its request number and flags, and `length` the part's payload; a PartHeader follows.
enum FrameType : uint32_t { kWrite = 1, kRead = 2, kWriteAck = 3, kReadData = 4, kWritePart = 5 };
enum FrameStatus : uint32_t { kOk = 0, kOutOfBounds = 1 };
// kNoAck (writes and their parts): acknowledged only when rejected; the sender counts it complete once sent,
// and a rejection of it, which can then reach no request, breaks the connection (the pair's
// view of the receiver's memory is wrong: nothing later on it can be trusted).
enum FrameFlags : uint32_t { kNotify = 1, kNoAck = 2 };
struct FrameHeader {
  uint32_t type;
  uint32_t status;
  uint64_t request_id;  // requests: the sender's number of it (1, 2, ... per session); replies: the request's
  uint32_t segment;
  uint32_t flags;  // kNotify, kNoAck on writes
  uint64_t offset;
  uint64_t length;  // payload bytes that follow (write, read data) or asked for (read)
};
static_assert(sizeof(FrameHeader) == 40, "frame header is 40 bytes on the wire");
struct PartHeader {
  uint64_t total;        // the whole write's bytes
  uint64_t part_offset;  // where this part's payload goes within them
};
static_assert(sizeof(PartHeader) == 16, "part header is 16 bytes on the wire");
}  // namespace wire

}  // namespace moelink::transfer::tcp
