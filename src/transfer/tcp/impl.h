// The tcp transport's implementation, shared by its files: transport.cpp (the Impl's lifecycle
// and the caller-facing calls, striping), loop.cpp (the progress threads' epoll loops),
// listener.cpp (the listening socket, accepting and handshakes both ways), pair.cpp (a
// connection's frames: reading, applying, writing, closing) and order.cpp (the receive side's
// order across a sender's connections). Progress-thread state is marked so below.
#pragma once

#include <netinet/in.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "moelink/transfer/tcp/transport.h"
#include "moelink/transfer/transfer_engine.h"

namespace moelink::transfer::tcp {

using std::chrono::milliseconds;


// The send side of a striped write: its parts travel on several connections (lanes) and settle
// one by one on their lanes' threads (acknowledged, or once sent where the write needs no
// acknowledgement); the request settles with the last of them, failed if any part was.
struct StripeSend {
  explicit StripeSend(int parts) : left(parts) {}
  std::atomic<int> left;
  std::mutex mu;
  std::string why;  // the first part's failure
};

struct Pending {
  BatchPtr batch;
  size_t index = 0;
  Opcode op = Opcode::kWrite;
  void* local = nullptr;
  uint64_t length = 0;
  std::shared_ptr<StripeSend> stripe;  // set on each part of a striped write
};

// Completes (why == "") or fails a pending request, or one part of a striped write.
void settle(Pending& p, const std::string& why);

// Payloads up to this size travel in the frame itself, copied when the write is posted:
// headers, signals and credits are small staging words that their owner may reuse or free
// (a mailbox torn down) while the frame still waits on the socket.
constexpr uint64_t kInlinePayload = 128;

struct OutFrame {
  char head[sizeof(wire::FrameHeader) + sizeof(wire::PartHeader)];
  size_t head_len = 0;
  const char* payload = nullptr;  // unless inline
  uint64_t payload_len = 0;
  bool inline_payload = false;
  char small[kInlinePayload];
  uint64_t sent = 0;  // bytes of head + payload already sent
  const char* payloadData() const { return inline_payload ? small : payload; }
  wire::FrameHeader& header() { return *reinterpret_cast<wire::FrameHeader*>(head); }
  const wire::FrameHeader& header() const { return *reinterpret_cast<const wire::FrameHeader*>(head); }
};

inline OutFrame makeFrame(const wire::FrameHeader& h, const void* payload, uint64_t payload_len) {
  OutFrame f;
  std::memcpy(f.head, &h, sizeof h);
  f.head_len = sizeof h;
  f.payload_len = payload_len;
  if (payload && payload_len <= kInlinePayload) {
    std::memcpy(f.small, payload, payload_len);
    f.inline_payload = true;
  } else {
    f.payload = static_cast<const char*>(payload);
  }
  return f;
}

constexpr size_t kReadBuffer = 256 << 10;
// Connections that have not presented the group's secret: at most this many at once, each for
// at most kHandshakeDeadline, with a read buffer only the size of the hello. A flood of idle
// connections then costs neither file descriptors nor memory beyond these.
constexpr size_t kMaxUnauthenticated = 64;
constexpr std::chrono::seconds kHandshakeDeadline{5};
constexpr size_t kDirectRecv = 32 << 10;  // payload remainders this large skip the buffer
// At most this much is read into the buffer at once: small frames still come many to a read,
// while of a large payload only this much can land in the buffer (to be copied out of it)
// before the rest is read straight to its destination.
constexpr size_t kBufferedRead = 64 << 10;
// Parts of a striped write are at least this large (a smaller write goes in fewer parts).
constexpr uint64_t kMinPart = 64 << 10;

// A submitter whose requests queue at most this many payload bytes on a loop sends them itself
// (flush: TcpTransport::Impl::driveOrWake) instead of waking the loop's thread: a small message
// then leaves without a thread's wake-up on its way, while a large one is still copied into the
// sockets by the loops' threads in parallel.
constexpr uint64_t kDirectSendBytes = 64 << 10;

// Unordered writes (TransferRequest::unordered) below this size travel in order on the first
// connection: for them a part's bookkeeping costs more than the wire saves, and the bound keeps
// the unordered writes a session can have in flight (what the sockets' buffers hold) far below
// kMaxStripesInFlight.
constexpr uint64_t kMinUnordered = 2 << 10;

// A connection records the requests of one part that landed on it in its session (taking the
// session's lock, which every connection of the session shares) when its reads pause, or once
// this many have landed.
constexpr size_t kLandedBatch = 64;

// More striped writes above a session's frontier than this is a protocol error (the sender's
// number of writes in flight is bounded by its callers' credits, far below).
constexpr size_t kMaxStripesInFlight = 1 << 16;

struct Session;

struct Submission {
  int peer;
  Pending pending;
  OutFrame frame;
};

class TcpTransport::Impl {
 public:
  struct Loop;
  struct Conn {
    Loop* loop = nullptr;  // the loop that drives it
    int fd = -1;
    int peer = -1;
    int lane = 0;           // 0: the primary (ordered requests); others carry parts only
    bool outbound = false;
    uint64_t session = 0;   // outbound: the session it belongs to
    std::shared_ptr<Session> in_session;  // inbound, once authenticated
    // receive side
    enum class In { kHello, kHeader, kPayload, kOrder } in = In::kHeader;  // kOrder: waits for its turn
    std::vector<char> rbuf;
    size_t rpos = 0, rlen = 0;
    wire::FrameHeader cur{};
    wire::PartHeader part{};
    char* dst = nullptr;       // payload destination (nullptr: discard)
    uint64_t remaining = 0;    // payload bytes still to receive
    bool signal = false;       // payload is an 8-byte ordered store
    char sigbuf[8];
    size_t sigpos = 0;
    uint32_t reply_status = wire::kOk;
    bool whole_part = false;   // the part in hand is all of its write (startPart)
    // Requests of one part that landed on this connection, not yet recorded in the session (the
    // session's lock is taken once for many of them: publishLanded).
    std::vector<uint64_t> landed;
    std::chrono::steady_clock::time_point accepted;  // inbound, until authenticated
    std::string from;                                 // inbound: the remote address
    // send side
    std::deque<OutFrame> out;
    uint32_t events = 0;  // what epoll watches for it
    std::unordered_map<uint64_t, Pending> pending;  // outbound: by request number
  };

  // One progress thread and the connections it drives: loop 0 also owns the listener and every
  // primary connection; loop i > 0 the lanes i of every peer, both ways.
  struct Loop {
    int index = 0;
    int epoll_fd = -1, event_fd = -1;
    std::thread thread;
    // Held by whichever thread runs a pass over the loop's connections: its progress thread after
    // each epoll_wait, or another thread driving it directly (driveOrWake). Only ever try-locked
    // by a thread that holds another loop's, so no two threads wait on each other.
    std::mutex drive;
    // Shared with other threads, under the Impl's mu_.
    std::vector<Submission> submissions;
    // Whether `submissions` carry at most `limit` payload bytes (under mu_).
    bool queuedAtMost(uint64_t limit) const {
      uint64_t bytes = 0;
      for (const Submission& s : submissions)
        if ((bytes += s.frame.payload_len) > limit) return false;
      return true;
    }
    std::vector<std::unique_ptr<Conn>> adopted;  // connections handed to this loop
    // Outbound connections to close: (peer, session, why); why "" when the peer was forgotten.
    std::vector<std::tuple<int, uint64_t, std::string>> drops;
    // Whoever holds `drive` only.
    std::map<int, std::unique_ptr<Conn>> conns;
    std::map<int, Conn*> outbound;  // by peer
    std::vector<Conn*> waiting;     // inbound primaries in kOrder
    bool ring = false;
    bool closed_any = false;
    std::atomic<uint64_t> sent{0};  // bytes written to outbound connections (any thread reads)
  };

  Impl(int rank, int world, uint64_t secret, LocalSegments& segs, milliseconds timeout,
       std::function<void()> ring_local, const std::string& listen_ip, const TcpTuning& tuning);

  ~Impl() { shutdown(); }
  void listen(const std::string& ip);

  void shutdown();

  const std::string& address() const { return address_; }
  int streams() const { return static_cast<int>(loops_.size()); }
  std::vector<uint64_t> sentPerStream() const {
    std::vector<uint64_t> out;
    for (const auto& l : loops_) out.push_back(l->sent.load(std::memory_order_relaxed));
    return out;
  }

  // Why the connection to `peer` broke ("" while it has not).
  std::string lostReason(int peer);
  uint64_t losses() const { return losses_.load(std::memory_order_acquire); }

  // Caller's thread: the progress threads close the old outbound connections (a cut link may
  // not have broken them); the next open() connects again.
  void forget(int peer);

  // Connects to `peer` once (caller's thread): its primary connection and its lanes; later calls
  // reuse them.
  void connectPeer(const PeerInfo& peer);

  // Queues the request on its loops; flush() wakes them.
  void post(const TransferRequest& req, const BatchPtr& batch, size_t index);
  void flush();

 private:
  void addToEpoll(Loop& l, int fd, uint32_t events);
  void setEvents(Conn& c);

  static void wake(Loop& l);

  void loop(Loop& l);
  // The part of a loop's turn that needs no epoll event (under l.drive): the submissions go onto
  // their connections, parked primaries whose turn came go on, queued frames are written, closed
  // connections are reaped, and the doorbell rings if something completed.
  void pass(Loop& l);
  // Runs `l`'s pass in this thread if no other thread holds l.drive, else wakes its progress
  // thread. Callers: flush() (the submitter sends its own small messages) and a lane whose part
  // lets loop 0's parked primary go on. False: the transport is stopped (nothing was done).
  bool driveOrWake(Loop& l);

  void takeSubmissions(Loop& l);

  // One handshake, then the connection is handed to its loop (caller's thread).
  std::unique_ptr<Conn> connectLane(const PeerInfo& peer, const sockaddr_in& a, int lane, uint64_t session,
                                    std::chrono::steady_clock::time_point deadline);

  void acceptAll();

  // The inbound connection at the front of handshaking_ that is still in its handshake, or
  // nullptr (entries of connections that authenticated or closed are dropped on the way).
  Conn* oldestUnauthenticated();

  // At the cap, the oldest connection still without a handshake makes room: a flood of idle
  // connections then cannot keep a real peer out, which authenticates at once.
  void evictOldestUnauthenticated(const std::string& newcomer);

  // Closes connections that have not presented the secret within the deadline.
  void expireHandshakes();

  // Logs a rejection once per key (a remote address), not once per connection.
  void logRejection(const std::string& key, const std::string& what);

  // An authenticated inbound connection: joins its session; a lane moves to its loop. False
  // when the connection was closed.
  bool authenticated(Conn& c, const wire::Hello& h);

  // Reads and handles everything available; false when the connection was closed.
  bool readConn(Conn& c);
  bool readAvailable(Conn& c);

  // r <= 0 from recv: true when it is just "no more data now".
  bool handleRecvResult(Conn& c, ssize_t r);

  // Parses buffered bytes; false when the connection was closed.
  bool consumeBuffered(Conn& c);

  // Keeps a partial header at the front of the buffer so that the next recv appends.
  void compactPartial(Conn& c);

  bool startFrame(Conn& c);

  void finishPayload(Conn& c);
  // The receiver's answer to the write (or part) just received: its acknowledgement with its
  // status, unless it asked for none and was applied.
  void answerWrite(Conn& c);

  // order.cpp: an ordered request on a primary connection takes its turn (true), waits for it
  // (false, the connection parked in kOrder) or breaks the connection (false, closed).
  bool takeTurn(Conn& c);
  // The parked primaries of this loop whose turn came go on.
  void resumeWaiting(Loop& l);
  // A part of a striped write: where it lands (false: the connection was closed).
  bool startPart(Conn& c);
  void finishPart(Conn& c);
  // Records c.landed in the session, wakes the primary they let go on; false when the
  // connection was closed (a number the session cannot take).
  bool publishLanded(Conn& c);
  // An inbound connection of `s` closed (`lane` > 0: a lane): its whole parts that landed are
  // recorded, and a primary that waits wakes (to go on, or to fail if it can no longer).
  void breakSession(Session& s, int lane, std::vector<uint64_t>& landed);
  std::shared_ptr<Session> sessionFor(int peer, uint64_t id);

  bool protocolError(Conn& c, const std::string& what);
  // Where `peer`'s write of `length` bytes at (segment, offset) lands (an expected destination
  // or the segment), or nullptr, said in the log, when it is outside every registered segment.
  char* landingOf(int peer, SegmentId segment, uint64_t offset, uint64_t length);

  void flushConn(Conn& c);

  void closeConn(Conn& c, const std::string& why, bool warn);

  void reapClosed(Loop& l);

  int rank_;
  int world_;
  uint64_t secret_;
  LocalSegments& segs_;
  milliseconds timeout_;
  TcpTuning tuning_;
  int listen_fd_ = -1;
  std::string address_;
  std::atomic<bool> stopped_{false};
  std::vector<std::unique_ptr<Loop>> loops_;

  // Shared with submitting threads.
  std::mutex open_mu_;
  std::mutex mu_;
  std::set<int> connected_;
  std::map<int, std::string> dead_;
  std::map<int, uint64_t> out_session_;     // peer -> the session of this rank's connections to it
  std::map<int, uint64_t> next_number_;     // peer -> the number of its session's next request
  std::map<std::pair<int, uint64_t>, std::weak_ptr<Session>> sessions_;  // inbound, by (peer, id)
  std::atomic<uint64_t> losses_{0};  // entries added to dead_ (and peers forgotten)
  uint64_t stripe_turn_ = 0;        // which lane carries the next striped write's first part
  uint32_t wake_due_ = 0;           // loops given submissions since the last flush(), one bit each
  static_assert(kMaxStreams <= 32, "wake_due_ has a bit per loop");

  // Loop 0's thread only.
  size_t unauthenticated_ = 0;             // inbound connections still in their handshake
  std::deque<int> handshaking_;            // their fds in accept order (may hold stale entries)
  int spare_fd_ = -1;                      // given up to drain the listener when out of fds
  std::set<std::string> logged_rejections_;
  std::function<void()> ring_local_;
};

// The receive side of one sender's connections (one session of its: the primary connection and
// its lanes): in which order their requests apply (order.cpp). The sender numbers its requests
// 1, 2, ... per session. Every request but a striped write travels on the primary, and is applied
// once every request numbered below it is (its `frontier`); the parts of a striped write land as
// they arrive, on whichever lane carries them.
struct Session {
  Session(int peer, uint64_t id) : peer(peer), id(id) {}
  struct Stripe {
    uint32_t segment = 0;
    uint64_t offset = 0, total = 0;
    uint64_t claimed = 0;  // bytes of parts started
    uint64_t left = 0;     // bytes of parts not yet received
    char* base = nullptr;  // where the whole write lands (nullptr: rejected, discarded)
    uint32_t flags = 0;
  };
  const int peer;
  const uint64_t id;
  std::mutex mu;  // guards the rest
  uint64_t frontier = 0;  // requests up to this number are applied (or being applied by the primary)
  std::map<uint64_t, Stripe> stripes;  // striped writes above the frontier, by number
  uint64_t waits_for = 0;              // the primary waits until the frontier reaches this (0: not)
  TcpTransport::Impl::Loop* primary = nullptr;      // the loop that drives the primary connection
  int lanes_open = 0;                  // its lane connections (not the primary) that are open
  // A connection of the session closed: what came in full before is applied in order, but a
  // request that waits for an earlier one fails once no lane is left open to bring it.
  bool broken = false;
  bool tainted = false;  // a connection of the session broke the protocol: nothing more is applied
};
}  // namespace moelink::transfer::tcp
