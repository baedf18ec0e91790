#include "moelink/transfer/tcp/transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>
#include <vector>

#include <glog/logging.h>

#include "moelink/common/error.h"
#include "moelink/transfer/tcp/socket.h"
#include "moelink/transfer/shm/transport.h"
#include "moelink/transfer/transfer_engine.h"

namespace moelink::transfer::tcp {

using namespace std::chrono;

namespace {

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

OutFrame makeFrame(const wire::FrameHeader& h, const void* payload, uint64_t payload_len) {
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

}  // namespace

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
       std::function<void()> ring_local, const std::string& listen_ip)
      : rank_(rank), world_(world), secret_(secret), segs_(segs), timeout_(timeout), ring_local_(std::move(ring_local)) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    MOELINK_SYSCHECK(listen_fd_, "socket");
    int one = 1;
    setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    // Listen on the address peers are told to use (MOELINK_HOST_IP or the first interface),
    // and on no other interface.
    const std::string ip = listen_ip.empty() ? advertisedIp() : listen_ip;
    a.sin_port = 0;
    if (inet_pton(AF_INET, ip.c_str(), &a.sin_addr) != 1) {
      ::close(listen_fd_);
      MOELINK_THROW("cannot listen on '", ip, "': not an IPv4 address (MOELINK_HOST_IP, if set, must be one of "
                    "this host's addresses)");
    }
    if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) < 0) {
      const int e = errno;
      ::close(listen_fd_);
      MOELINK_THROW("cannot listen on ", ip, ": ", std::strerror(e),
                    e == EADDRNOTAVAIL ? " (it is not an address of this host; MOELINK_HOST_IP, if set, must be one)"
                                       : "");
    }
    MOELINK_SYSCHECK(listen(listen_fd_, 128), "listen");
    socklen_t len = sizeof a;
    MOELINK_SYSCHECK(getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len), "getsockname");
    address_ = str(ip, ":", ntohs(a.sin_port));
    spare_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    setNonBlocking(listen_fd_);
    epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
    MOELINK_SYSCHECK(epoll_fd_, "epoll_create1");
    event_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    MOELINK_SYSCHECK(event_fd_, "eventfd");
    addToEpoll(listen_fd_, EPOLLIN);
    addToEpoll(event_fd_, EPOLLIN);
    thread_ = std::thread([this] { loop(); });
  }

  ~Impl() { shutdown(); }

  void shutdown() {
    if (stopped_.exchange(true)) return;
    wake();
    if (thread_.joinable()) thread_.join();
    for (auto& [fd, c] : conns_) closeConn(*c, "transport shut down", false);
    conns_.clear();
    std::lock_guard<std::mutex> g(mu_);
    for (auto& s : submissions_) s.pending.batch->fail(s.pending.index, "tcp transport shut down");
    submissions_.clear();
    ::close(listen_fd_);
    if (spare_fd_ >= 0) ::close(spare_fd_);
    spare_fd_ = -1;
    ::close(epoll_fd_);
    ::close(event_fd_);
  }

  const std::string& address() const { return address_; }

  // Why the connection to `peer` broke ("" while it has not).
  std::string lostReason(int peer) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = dead_.find(peer);
    return it == dead_.end() ? std::string() : it->second;
  }
  uint64_t losses() const { return losses_.load(std::memory_order_acquire); }

  // Caller's thread: the progress thread closes the old outbound connection (a cut link may
  // not have broken it); the next open() connects again.
  void forget(int peer) {
    std::lock_guard<std::mutex> og(open_mu_);
    std::lock_guard<std::mutex> g(mu_);
    connected_.erase(peer);
    dead_.erase(peer);
    forgotten_.push_back(peer);
    losses_.fetch_add(1, std::memory_order_release);  // pollers re-read lostReason()
    wake();
  }

  // Connects to `peer` once (caller's thread); later calls reuse the connection.
  void connectPeer(const PeerInfo& peer) {
    std::lock_guard<std::mutex> og(open_mu_);
    {
      std::lock_guard<std::mutex> g(mu_);
      if (connected_.count(peer.rank)) return;
    }
    sockaddr_in a = parseAddress(peer.tcp_address);
    auto deadline = steady_clock::now() + timeout_;
    int fd = -1;
    while (true) {
      fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      MOELINK_SYSCHECK(fd, "socket");
      if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) break;
      int e = errno;
      ::close(fd);
      if (steady_clock::now() > deadline)
        MOELINK_THROW_TIMEOUT("could not connect to rank ", peer.rank, " at ", peer.tcp_address,
                              ": ", std::strerror(e));
      std::this_thread::sleep_for(milliseconds(20));
    }
    setNoDelay(fd);
    wire::Hello hello{wire::kHelloMagic, secret_, rank_, 0};
    uint64_t reply = 0;
    try {
      sendAll(fd, &hello, sizeof hello, deadline);
      recvAll(fd, &reply, sizeof reply, deadline);
      MOELINK_CHECK(reply == wire::kHelloMagic, "rank ", peer.rank, " refused the handshake");
    } catch (...) {
      ::close(fd);
      throw;
    }
    setNonBlocking(fd);
    auto c = std::make_unique<Conn>();
    c->fd = fd;
    c->peer = peer.rank;
    c->outbound = true;
    c->rbuf.resize(kReadBuffer);
    std::lock_guard<std::mutex> g(mu_);
    connected_.insert(peer.rank);
    new_conns_.push_back(std::move(c));
    wake();
  }

  void post(const TransferRequest& req, const BatchPtr& batch, size_t index) {
    Submission s;
    s.peer = req.peer;
    s.pending = Pending{batch, index, req.op, req.local, req.length};
    wire::FrameHeader h{};
    h.type = req.op == Opcode::kWrite ? wire::kWrite : wire::kRead;
    h.segment = req.segment;
    h.flags = (req.notify ? static_cast<uint32_t>(wire::kNotify) : 0u) |
              (req.no_ack && req.op == Opcode::kWrite ? static_cast<uint32_t>(wire::kNoAck) : 0u);
    h.offset = req.offset;
    h.length = req.length;
    s.frame = makeFrame(h, req.op == Opcode::kWrite ? req.local : nullptr,
                        req.op == Opcode::kWrite ? req.length : 0);
    std::lock_guard<std::mutex> g(mu_);
    if (auto it = dead_.find(req.peer); it != dead_.end()) {
      batch->fail(index, it->second);
      return;
    }
    if (stopped_) {
      batch->fail(index, "tcp transport shut down");
      return;
    }
    submissions_.push_back(std::move(s));
    if (submissions_.size() == 1) wake();
  }

 private:
  struct Submission {
    int peer;
    Pending pending;
    OutFrame frame;
  };

  void addToEpoll(int fd, uint32_t events) {
    epoll_event ev{};
    ev.events = events;
    ev.data.fd = fd;
    MOELINK_SYSCHECK(epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev), "epoll_ctl(ADD)");
  }

  void wake() {
    uint64_t one = 1;
    ssize_t r = ::write(event_fd_, &one, sizeof one);
    (void)r;
  }

  void loop() {
    std::vector<epoll_event> events(64);
    while (!stopped_.load()) {
      int n = epoll_wait(epoll_fd_, events.data(), static_cast<int>(events.size()), 100);
      if (n < 0 && errno != EINTR) {
        LOG(ERROR) << "moelink tcp: epoll_wait failed: " << std::strerror(errno);
        break;
      }
      for (int i = 0; i < n; ++i) {
        int fd = events[i].data.fd;
        if (fd == event_fd_) {
          uint64_t v;
          while (::read(event_fd_, &v, sizeof v) > 0) {
          }
          continue;
        }
        if (fd == listen_fd_) {
          acceptAll();
          continue;
        }
        auto it = conns_.find(fd);
        if (it == conns_.end()) continue;
        Conn& c = *it->second;
        if (events[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP)) {
          if (!readConn(c)) continue;  // closed
        }
        if (events[i].events & EPOLLOUT) flushConn(c);
      }
      takeSubmissions();
      for (auto& [fd, c] : conns_)
        if (!c->out.empty()) flushConn(*c);
      expireHandshakes();
      reapClosed();
      if (ring_) {  // something completed or a notify arrived during this pass
        ring_ = false;
        ring_local_();
      }
    }
  }

  void takeSubmissions() {
    std::vector<std::unique_ptr<Conn>> fresh;
    std::vector<Submission> subs;
    std::vector<int> forgotten;
    {
      std::lock_guard<std::mutex> g(mu_);
      fresh.swap(new_conns_);
      subs.swap(submissions_);
      forgotten.swap(forgotten_);
    }
    for (int peer : forgotten) {  // before `fresh`: a new connection to it may be there
      auto it = outbound_.find(peer);
      if (it == outbound_.end()) continue;
      Conn& c = *it->second;
      epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c.fd, nullptr);
      ::close(c.fd);
      c.fd = -1;
      for (auto& [id, p] : c.pending) p.batch->fail(p.index, str("rank ", peer, " was replaced"));
      if (!c.pending.empty()) ring_ = true;
      c.pending.clear();
      c.out.clear();
      outbound_.erase(it);
      closed_any_ = true;
    }
    for (auto& c : fresh) {
      int fd = c->fd;
      outbound_[c->peer] = c.get();
      conns_[fd] = std::move(c);
      addToEpoll(fd, EPOLLIN);
    }
    for (auto& s : subs) {
      auto it = outbound_.find(s.peer);
      if (it == outbound_.end()) {
        s.pending.batch->fail(s.pending.index, str("no tcp connection to rank ", s.peer));
        continue;
      }
      Conn& c = *it->second;
      uint64_t id = next_id_++;
      reinterpret_cast<wire::FrameHeader*>(s.frame.head)->request_id = id;
      c.pending.emplace(id, s.pending);
      c.out.push_back(s.frame);
    }
  }

  void acceptAll() {
    while (true) {
      sockaddr_in from{};
      socklen_t len = sizeof from;
      int fd = accept4(listen_fd_, reinterpret_cast<sockaddr*>(&from), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if ((errno == EMFILE || errno == ENFILE) && spare_fd_ >= 0) {
          // Out of descriptors: take the connection with the one kept in reserve and drop it,
          // so the listener does not stay readable (and this loop spinning) until one frees.
          ::close(spare_fd_);
          int dropped = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
          if (dropped >= 0) ::close(dropped);
          spare_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
          logRejection("out-of-fds", "out of file descriptors: refusing tcp connections");
          continue;
        }
        return;
      }
      char ip[INET_ADDRSTRLEN] = "?";
      inet_ntop(AF_INET, &from.sin_addr, ip, sizeof ip);
      if (unauthenticated_ >= kMaxUnauthenticated) evictOldestUnauthenticated(ip);
      setNoDelay(fd);
      auto c = std::make_unique<Conn>();
      c->fd = fd;
      c->in = Conn::In::kHello;
      c->rbuf.resize(sizeof(wire::Hello));  // the full buffer once authenticated
      c->accepted = std::chrono::steady_clock::now();
      c->from = ip;
      ++unauthenticated_;
      handshaking_.push_back(fd);
      conns_[fd] = std::move(c);
      addToEpoll(fd, EPOLLIN);
    }
  }

  // The inbound connection at the front of handshaking_ that is still in its handshake, or
  // nullptr (entries of connections that authenticated or closed are dropped on the way).
  Conn* oldestUnauthenticated() {
    while (!handshaking_.empty()) {
      auto it = conns_.find(handshaking_.front());
      if (it != conns_.end() && it->second->fd >= 0 && it->second->in == Conn::In::kHello) return it->second.get();
      handshaking_.pop_front();
    }
    return nullptr;
  }

  // At the cap, the oldest connection still without a handshake makes room: a flood of idle
  // connections then cannot keep a real peer out, which authenticates at once.
  void evictOldestUnauthenticated(const std::string& newcomer) {
    if (Conn* c = oldestUnauthenticated()) {
      logRejection("cap", str("more than ", kMaxUnauthenticated, " connections without a handshake (the newest from ",
                              newcomer, "): closing the oldest ones"));
      closeConn(*c, "too many connections without a handshake", false);
    }
  }

  // Closes connections that have not presented the secret within the deadline.
  void expireHandshakes() {
    const auto now = std::chrono::steady_clock::now();
    while (Conn* c = oldestUnauthenticated()) {
      if (now - c->accepted <= kHandshakeDeadline) break;
      logRejection(c->from, str("closed a connection from ", c->from, " that sent no handshake within ",
                                kHandshakeDeadline.count(), " s"));
      closeConn(*c, "no handshake", false);
    }
  }

  // Logs a rejection once per key (a remote address), not once per connection.
  void logRejection(const std::string& key, const std::string& what) {
    if (logged_rejections_.insert(key).second) LOG(WARNING) << "moelink tcp: " << what;
  }

  // Reads and handles everything available; false when the connection was closed.
  bool readConn(Conn& c) {
    while (true) {
      // Large payload remainders go straight to their destination.
      if (c.in == Conn::In::kPayload && c.rpos == c.rlen && c.dst && !c.signal &&
          c.remaining >= kDirectRecv) {
        ssize_t r = ::recv(c.fd, c.dst, c.remaining, 0);
        if (r <= 0) return handleRecvResult(c, r);
        c.dst += r;
        c.remaining -= static_cast<uint64_t>(r);
        if (c.remaining == 0) finishPayload(c);
        continue;
      }
      if (c.rpos == c.rlen) c.rpos = c.rlen = 0;
      ssize_t r = ::recv(c.fd, c.rbuf.data() + c.rlen, std::min(c.rbuf.size() - c.rlen, kBufferedRead), 0);
      if (r <= 0) return handleRecvResult(c, r);
      c.rlen += static_cast<size_t>(r);
      if (!consumeBuffered(c)) return false;
    }
  }

  // r <= 0 from recv: true when it is just "no more data now".
  bool handleRecvResult(Conn& c, ssize_t r) {
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return true;
    std::string why = r == 0 ? "peer closed the connection" : std::strerror(errno);
    closeConn(c, why, false);  // a peer that exited (closeConn says who reports it)
    return false;
  }

  // Parses buffered bytes; false when the connection was closed.
  bool consumeBuffered(Conn& c) {
    while (c.rpos < c.rlen) {
      size_t avail = c.rlen - c.rpos;
      const char* p = c.rbuf.data() + c.rpos;
      if (c.in == Conn::In::kHello) {
        if (avail < sizeof(wire::Hello)) {
          compactPartial(c);
          return true;
        }
        wire::Hello h;
        std::memcpy(&h, p, sizeof h);
        c.rpos += sizeof h;
        if (std::string why = wire::checkHello(h, secret_, world_); !why.empty()) {
          logRejection(c.from, str("rejected a connection from ", c.from, ": ", why));
          closeConn(c, "bad handshake", false);
          return false;
        }
        c.peer = h.rank;
        c.in = Conn::In::kHeader;
        --unauthenticated_;
        compactPartial(c);
        c.rbuf.resize(kReadBuffer);
        OutFrame f;
        uint64_t magic = wire::kHelloMagic;
        std::memcpy(f.head, &magic, sizeof magic);
        f.head_len = sizeof magic;
        c.out.push_back(f);
      } else if (c.in == Conn::In::kHeader) {
        if (avail < sizeof(wire::FrameHeader)) {
          compactPartial(c);
          return true;
        }
        std::memcpy(&c.cur, p, sizeof c.cur);
        c.rpos += sizeof c.cur;
        if (!startFrame(c)) return false;
      } else {  // payload
        uint64_t take = std::min<uint64_t>(avail, c.remaining);
        if (c.signal) {
          std::memcpy(c.sigbuf + c.sigpos, p, take);
          c.sigpos += take;
        } else if (c.dst) {
          std::memcpy(c.dst, p, take);
          c.dst += take;
        }
        c.rpos += take;
        c.remaining -= take;
        if (c.remaining == 0) finishPayload(c);
      }
    }
    return true;
  }

  // Keeps a partial header at the front of the buffer so that the next recv appends.
  void compactPartial(Conn& c) {
    size_t avail = c.rlen - c.rpos;
    std::memmove(c.rbuf.data(), c.rbuf.data() + c.rpos, avail);
    c.rpos = 0;
    c.rlen = avail;
  }

  bool startFrame(Conn& c) {
    const auto& h = c.cur;
    switch (h.type) {
      case wire::kWrite: {
        if (c.outbound) return protocolError(c, "write frame on an outbound connection");
        void* dst = segs_.resolveIncomingWrite(h.segment, h.offset, h.length);
        c.reply_status = dst ? wire::kOk : wire::kOutOfBounds;
        if (!dst)
          LOG(WARNING) << "moelink tcp: rank " << c.peer << " wrote " << h.length
                       << " bytes at offset " << h.offset << " of segment " << h.segment
                       << ", outside every registered segment; rejected";
        c.dst = static_cast<char*>(dst);
        c.signal = dst && h.length == 8 && (reinterpret_cast<uintptr_t>(dst) & 7) == 0;
        c.sigpos = 0;
        c.remaining = h.length;
        c.in = Conn::In::kPayload;
        if (c.remaining == 0) finishPayload(c);
        return true;
      }
      case wire::kRead: {
        if (c.outbound) return protocolError(c, "read frame on an outbound connection");
        void* src = segs_.resolve(h.segment, h.offset, h.length);
        wire::FrameHeader r{};
        r.type = wire::kReadData;
        r.status = src ? wire::kOk : wire::kOutOfBounds;
        r.request_id = h.request_id;
        r.segment = h.segment;
        r.offset = h.offset;
        r.length = src ? h.length : 0;
        std::atomic_thread_fence(std::memory_order_acquire);
        c.out.push_back(makeFrame(r, src, r.length));
        return true;
      }
      case wire::kWriteAck: {
        if (!c.outbound) return protocolError(c, "ack frame on an inbound connection");
        auto it = c.pending.find(h.request_id);
        const std::string why = h.status == wire::kOk
                                    ? std::string()
                                    : str("rank ", c.peer, " rejected a write of ", h.length, " bytes at offset ",
                                          h.offset, " of segment ", h.segment, ": out of bounds");
        if (it == c.pending.end()) {
          // A kNoAck write completed when it was sent: its rejection reaches no request, and
          // the writes after it assumed it landed. The pair is broken; say why.
          if (!why.empty()) {
            closeConn(c, why, true);
            return false;
          }
          return protocolError(c, "ack for an unknown request");
        }
        ring_ = true;
        if (why.empty())
          it->second.batch->complete(it->second.index);
        else
          it->second.batch->fail(it->second.index, why);
        c.pending.erase(it);
        return true;
      }
      case wire::kReadData: {
        if (!c.outbound) return protocolError(c, "read data on an inbound connection");
        auto it = c.pending.find(h.request_id);
        if (it == c.pending.end()) return protocolError(c, "read data for an unknown request");
        if (h.status != wire::kOk || h.length != it->second.length) {
          it->second.batch->fail(it->second.index,
                                 str("rank ", c.peer, " rejected a read at offset ", h.offset,
                                     " of segment ", h.segment, ": out of bounds"));
          c.pending.erase(it);
          c.dst = nullptr;
          c.remaining = h.length;
          c.in = h.length ? Conn::In::kPayload : Conn::In::kHeader;
          c.signal = false;
          c.reply_status = wire::kOutOfBounds;
          return true;
        }
        c.dst = static_cast<char*>(it->second.local);
        c.signal = false;
        c.reply_status = wire::kOk;
        c.remaining = h.length;
        c.in = Conn::In::kPayload;
        if (c.remaining == 0) finishPayload(c);
        return true;
      }
      default:
        return protocolError(c, str("unknown frame type ", h.type));
    }
  }

  void finishPayload(Conn& c) {
    const auto& h = c.cur;
    c.in = Conn::In::kHeader;
    if (h.type == wire::kWrite) {
      if (c.signal) shm::orderedCopy(c.dst, c.sigbuf, 8);
      c.signal = false;
      if ((h.flags & wire::kNotify) && c.reply_status == wire::kOk) ring_ = true;
      if (!(h.flags & wire::kNoAck) || c.reply_status != wire::kOk) {
        wire::FrameHeader a = h;
        a.type = wire::kWriteAck;
        a.status = c.reply_status;
        a.flags = 0;
        c.out.push_back(makeFrame(a, nullptr, 0));
      }
    } else if (h.type == wire::kReadData) {
      auto it = c.pending.find(h.request_id);
      if (it != c.pending.end() && c.reply_status == wire::kOk) {
        ring_ = true;
        it->second.batch->complete(it->second.index);
        c.pending.erase(it);
      }
      c.reply_status = wire::kOk;
    }
  }

  bool protocolError(Conn& c, const std::string& what) {
    LOG(WARNING) << "moelink tcp: protocol error from rank " << c.peer << ": " << what;
    closeConn(c, "protocol error: " + what, true);
    return false;
  }

  void flushConn(Conn& c) {
    if (c.fd < 0) return;
    while (!c.out.empty()) {
      iovec iov[64];
      int n = 0;
      for (auto it = c.out.begin(); it != c.out.end() && n < 62; ++it) {
        const OutFrame& f = *it;
        uint64_t s = f.sent;
        if (s < f.head_len) {
          iov[n++] = {const_cast<char*>(f.head + s), f.head_len - s};
          s = f.head_len;
        }
        if (f.payload_len > s - f.head_len) {
          uint64_t off = s - f.head_len;
          iov[n++] = {const_cast<char*>(f.payloadData() + off), f.payload_len - off};
        }
      }
      ssize_t r = ::writev(c.fd, iov, n);
      if (r < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        if (errno == EINTR) continue;
        closeConn(c, std::strerror(errno), false);  // a peer that exited, as above
        return;
      }
      uint64_t left = static_cast<uint64_t>(r);
      while (left && !c.out.empty()) {
        OutFrame& f = c.out.front();
        uint64_t total = f.head_len + f.payload_len;
        uint64_t take = std::min(left, total - f.sent);
        f.sent += take;
        left -= take;
        if (f.sent == total) {
          // A write that gets no acknowledgement of its own is complete once it is on the
          // wire (the one that carries a later write's acknowledgement reports its rejection).
          const auto* h = reinterpret_cast<const wire::FrameHeader*>(f.head);
          if (c.outbound && f.head_len == sizeof(wire::FrameHeader) && h->type == wire::kWrite &&
              (h->flags & wire::kNoAck)) {
            if (auto it = c.pending.find(h->request_id); it != c.pending.end()) {
              it->second.batch->complete(it->second.index);
              c.pending.erase(it);
              ring_ = true;
            }
          }
          c.out.pop_front();
        }
      }
    }
    bool want = !c.out.empty();
    if (want != c.want_out) {
      epoll_event ev{};
      ev.events = EPOLLIN | (want ? static_cast<uint32_t>(EPOLLOUT) : 0u);
      ev.data.fd = c.fd;
      epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, c.fd, &ev);
      c.want_out = want;
    }
  }

  void closeConn(Conn& c, const std::string& why, bool warn) {
    if (c.fd < 0) return;
    if (c.in == Conn::In::kHello && !c.outbound) --unauthenticated_;
    std::string reason = str("tcp connection to rank ", c.peer, " lost: ", why);
    // A peer that closed or reset the connection (every clean shutdown does) is logged only
    // verbosely: whoever needed it reports a real loss with this reason. Peer faults warn.
    if (c.outbound && !stopped_ && warn) LOG(WARNING) << "moelink " << reason;
    if (c.outbound && !stopped_ && !warn) VLOG(1) << "moelink " << reason;
    epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c.fd, nullptr);
    ::close(c.fd);
    c.fd = -1;
    for (auto& [id, p] : c.pending) p.batch->fail(p.index, reason);
    if (!c.pending.empty()) ring_ = true;
    c.pending.clear();
    c.out.clear();
    if (c.outbound) {
      outbound_.erase(c.peer);
      std::lock_guard<std::mutex> g(mu_);
      dead_[c.peer] = reason;
      losses_.fetch_add(1, std::memory_order_release);
      // Fail what was submitted but not yet moved onto the connection.
      for (auto it = submissions_.begin(); it != submissions_.end();) {
        if (it->peer == c.peer) {
          it->pending.batch->fail(it->pending.index, reason);
          it = submissions_.erase(it);
        } else {
          ++it;
        }
      }
    }
    closed_any_ = true;
  }

  void reapClosed() {
    if (!closed_any_) return;
    for (auto it = conns_.begin(); it != conns_.end();)
      it = it->second->fd < 0 ? conns_.erase(it) : std::next(it);
    closed_any_ = false;
  }

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

TcpTransport::TcpTransport(int rank, int world_size, uint64_t secret, LocalSegments& segments,
                           milliseconds connect_timeout, std::function<void()> ring_local, const std::string& ip)
    : impl_(std::make_unique<Impl>(rank, world_size, secret, segments, connect_timeout, std::move(ring_local), ip)) {}

std::string wire::checkHello(const Hello& h, uint64_t secret, int world_size) {
  if (h.magic != kHelloMagic || h.secret != secret) return str("it claimed rank ", h.rank, " (bad magic or group secret)");
  if (h.rank < 0 || h.rank >= world_size) return str("it claimed rank ", h.rank, ", outside the group of ", world_size);
  if (h.reserved != 0) return str("it claimed rank ", h.rank, " with a non-zero reserved field");
  return "";
}

TcpTransport::~TcpTransport() = default;

bool TcpTransport::open(const PeerInfo& peer, RemoteSegment&) {
  impl_->connectPeer(peer);
  return true;
}

void TcpTransport::close(RemoteSegment&) {}

void TcpTransport::post(const TransferRequest& req, const RemoteSegment&, const BatchPtr& batch,
                        size_t index) {
  impl_->post(req, batch, index);
}

std::string TcpTransport::address() const { return impl_->address(); }

std::string TcpTransport::lostReason(int peer) const { return impl_->lostReason(peer); }

uint64_t TcpTransport::losses() const { return impl_->losses(); }

void TcpTransport::shutdown() { impl_->shutdown(); }

void TcpTransport::forget(int peer) { impl_->forget(peer); }

}  // namespace moelink::transfer::tcp
