// tcp transport: works between any two hosts.
//
// Files: transport.cpp (lifecycle, the calls below), loop.cpp (the progress thread), listener.cpp
// (listening, accepting, handshakes), pair.cpp (a connection's frames); impl.h ties them.
//
// Each engine listens on one port. For its own requests a rank opens one outbound
// connection per peer (lazily, at the first opened segment of that peer) and presents
// {magic, group secret, rank}; the peer closes connections with a wrong secret. Frames
// name the target segment, offset and length; the receiving side bounds-checks every
// frame against its registered segments and answers a NACK for one outside them, without
// touching memory. All sockets are non-blocking and driven by one progress thread
// (epoll); submitters enqueue and wake it through an eventfd.
//
// Order: frames on a connection are applied in order, which gives the engine's per-peer
// ordering contract. A write completes when the peer acknowledges it; a read when its
// data has arrived. A broken connection fails all of its pending requests.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "moelink/transfer/transport.h"

namespace moelink::transfer {
class LocalSegments;
}

namespace moelink::transfer::tcp {

class TcpTransport : public Transport {
 public:
  // `ring_local` rings this process's doorbell: called after applying a peer's write
  // flagged notify, and after this side's requests complete or fail.
  // `ip`: the address to listen on and advertise ("": MOELINK_HOST_IP, or the first interface;
  // see advertisedIp()); one that is not an address of this host is an error (nothing
  // listens on other interfaces instead). Handshakes must name a rank below `world_size`.
  TcpTransport(int rank, int world_size, uint64_t secret, LocalSegments& segments,
               std::chrono::milliseconds connect_timeout, std::function<void()> ring_local,
               const std::string& ip = "");
  ~TcpTransport() override;
  const char* name() const override { return "tcp"; }
  bool open(const PeerInfo& peer, RemoteSegment& seg) override;
  void close(RemoteSegment& seg) override;
  void post(const TransferRequest& req, const RemoteSegment& seg, const BatchPtr& batch,
            size_t index) override;
  std::string lostReason(int peer) const override;
  uint64_t losses() const override;

  // "ip:port" that peers connect to.
  std::string address() const;
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
constexpr uint64_t kHelloMagic = 0x6d6f656c696e6b31ULL;  // "moelink1"
struct Hello {
  uint64_t magic;
  uint64_t secret;
  int32_t rank;
  int32_t reserved;
};
// "" when `h` opens a connection of this group (its magic and secret, a rank of the group, the
// reserved field zero), else why not.
std::string checkHello(const Hello& h, uint64_t secret, int world_size);
enum FrameType : uint32_t { kWrite = 1, kRead = 2, kWriteAck = 3, kReadData = 4 };
enum FrameStatus : uint32_t { kOk = 0, kOutOfBounds = 1 };
// kNoAck (writes): acknowledged only when rejected; the sender counts it complete once sent,
// and a rejection of it, which can then reach no request, breaks the connection (the pair's
// view of the receiver's memory is wrong: nothing later on it can be trusted).
enum FrameFlags : uint32_t { kNotify = 1, kNoAck = 2 };
struct FrameHeader {
  uint32_t type;
  uint32_t status;
  uint64_t request_id;
  uint32_t segment;
  uint32_t flags;  // kNotify, kNoAck on writes
  uint64_t offset;
  uint64_t length;  // payload bytes that follow (write, read data) or asked for (read)
};
static_assert(sizeof(FrameHeader) == 40, "frame header is 40 bytes on the wire");
}  // namespace wire

}  // namespace moelink::transfer::tcp
