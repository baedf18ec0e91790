// The tcp transport's implementation, shared by its files: transport.cpp (the Impl's lifecycle
// and the caller-facing calls), loop.cpp (the progress thread's epoll loop), listener.cpp (the
// listening socket, accepting and handshakes both ways) and pair.cpp (a connection's frames:
// reading, applying, writing, closing). Progress-thread state is marked so below.
#pragma once

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
#include <unordered_map>
#include <vector>

#include "moelink/transfer/tcp/transport.h"
#include "moelink/transfer/transfer_engine.h"

namespace moelink::transfer::tcp {

using std::chrono::milliseconds;


struct Pending {
  BatchPtr batch;
  size_t index = 0;
  Opcode op = Opcode::kWrite;
  void* local = nullptr;
  uint64_t length = 0;
};

// Payloads up to this size travel in the frame itself, copied when the write is posted:
// headers, signals and credits are small staging words that their owner may reuse or free
// (a mailbox torn down) while the frame still waits on the socket.
constexpr uint64_t kInlinePayload = 128;

struct OutFrame {
  char head[sizeof(wire::FrameHeader)];
  size_t head_len = 0;
  const char* payload = nullptr;  // unless inline
  uint64_t payload_len = 0;
  bool inline_payload = false;
  char small[kInlinePayload];
  uint64_t sent = 0;  // bytes of head + payload already sent
  const char* payloadData() const { return inline_payload ? small : payload; }
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


class TcpTransport::Impl {
 public:
  struct Conn {
    int fd = -1;
    int peer = -1;
    bool outbound = false;
    // receive side
    enum class In { kHello, kHeader, kPayload } in = In::kHeader;
    std::vector<char> rbuf;
    size_t rpos = 0, rlen = 0;
    wire::FrameHeader cur{};
    char* dst = nullptr;       // payload destination (nullptr: discard)
    uint64_t remaining = 0;    // payload bytes still to receive
    bool signal = false;       // payload is an 8-byte ordered store
    char sigbuf[8];
    size_t sigpos = 0;
    uint32_t reply_status = wire::kOk;
    std::chrono::steady_clock::time_point accepted;  // inbound, until authenticated
    std::string from;                                 // inbound: the remote address
    // send side
    std::deque<OutFrame> out;
    bool want_out = false;
    std::unordered_map<uint64_t, Pending> pending;  // outbound: by request id
  };

  Impl(int rank, int world, uint64_t secret, LocalSegments& segs, milliseconds timeout,
       std::function<void()> ring_local, const std::string& listen_ip);

  ~Impl() { shutdown(); }
  void listen(const std::string& ip);

  void shutdown();

  const std::string& address() const { return address_; }

  // Why the connection to `peer` broke ("" while it has not).
  std::string lostReason(int peer);
  uint64_t losses() const { return losses_.load(std::memory_order_acquire); }

  // Caller's thread: the progress thread closes the old outbound connection (a cut link may
  // not have broken it); the next open() connects again.
  void forget(int peer);

  // Connects to `peer` once (caller's thread); later calls reuse the connection.
  void connectPeer(const PeerInfo& peer);

  void post(const TransferRequest& req, const BatchPtr& batch, size_t index);

 private:
  struct Submission {
    int peer;
    Pending pending;
    OutFrame frame;
  };

  void addToEpoll(int fd, uint32_t events);

  void wake();

  void loop();

  void takeSubmissions();

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

  // Reads and handles everything available; false when the connection was closed.
  bool readConn(Conn& c);

  // r <= 0 from recv: true when it is just "no more data now".
  bool handleRecvResult(Conn& c, ssize_t r);

  // Parses buffered bytes; false when the connection was closed.
  bool consumeBuffered(Conn& c);

  // Keeps a partial header at the front of the buffer so that the next recv appends.
  void compactPartial(Conn& c);

  bool startFrame(Conn& c);

  void finishPayload(Conn& c);

  bool protocolError(Conn& c, const std::string& what);

  void flushConn(Conn& c);

  void closeConn(Conn& c, const std::string& why, bool warn);

  void reapClosed();

  int rank_;
  int world_;
  uint64_t secret_;
  LocalSegments& segs_;
  milliseconds timeout_;
  int listen_fd_ = -1, epoll_fd_ = -1, event_fd_ = -1;
  std::string address_;
  std::thread thread_;
  std::atomic<bool> stopped_{false};

  // Shared with submitting threads.
  std::mutex open_mu_;
  std::mutex mu_;
  std::vector<Submission> submissions_;
  std::vector<std::unique_ptr<Conn>> new_conns_;
  std::set<int> connected_;
  std::map<int, std::string> dead_;
  std::vector<int> forgotten_;       // peers whose outbound connection is to go
  std::atomic<uint64_t> losses_{0};  // entries added to dead_ (and peers forgotten)

  // Progress thread only.
  std::map<int, std::unique_ptr<Conn>> conns_;
  std::map<int, Conn*> outbound_;
  uint64_t next_id_ = 1;
  bool closed_any_ = false;
  size_t unauthenticated_ = 0;             // inbound connections still in their handshake
  std::deque<int> handshaking_;            // their fds in accept order (may hold stale entries)
  int spare_fd_ = -1;                      // given up to drain the listener when out of fds
  std::set<std::string> logged_rejections_;
  bool ring_ = false;
  std::function<void()> ring_local_;
};

}  // namespace moelink::transfer::tcp
