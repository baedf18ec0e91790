// A tcp connection's frames: reading and parsing them (the hello first on an inbound
// connection), applying writes and reads to the registered segments, writing queued frames,
// and closing a connection with its pending requests failed.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <glog/logging.h>

#include "impl.h"
#include "moelink/common/error.h"
#include "moelink/transfer/shm/transport.h"
#include "moelink/transfer/tcp/socket.h"

namespace moelink::transfer::tcp {

using namespace std::chrono;

// Reads and handles everything available; false when the connection was closed.
bool TcpTransport::Impl::readConn(Conn& c) { return readAvailable(c) && publishLanded(c); }

bool TcpTransport::Impl::readAvailable(Conn& c) {
  while (true) {
    if (c.fd < 0) return false;  // closed by what it read (finishPart's record of it)
    if (c.in == Conn::In::kOrder) return true;  // parked: it reads again when its turn comes
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
bool TcpTransport::Impl::handleRecvResult(Conn& c, ssize_t r) {
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return true;
  std::string why = r == 0 ? "peer closed the connection" : std::strerror(errno);
  closeConn(c, why, false);  // a peer that exited (closeConn says who reports it)
  return false;
}

// Parses buffered bytes; false when the connection was closed.
bool TcpTransport::Impl::consumeBuffered(Conn& c) {
  while (c.rpos < c.rlen) {
    if (c.fd < 0) return false;  // closed by a frame it finished (finishPart's record of it)
    size_t avail = c.rlen - c.rpos;
    const char* p = c.rbuf.data() + c.rpos;
    if (c.in == Conn::In::kOrder) return true;
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
      if (!authenticated(c, h)) return false;  // handed to another loop, or closed
    } else if (c.in == Conn::In::kHeader) {
      if (avail < sizeof(wire::FrameHeader)) {
        compactPartial(c);
        return true;
      }
      std::memcpy(&c.cur, p, sizeof c.cur);
      const bool part = c.cur.type == wire::kWritePart;
      if (part && avail < sizeof(wire::FrameHeader) + sizeof(wire::PartHeader)) {
        compactPartial(c);
        return true;
      }
      c.rpos += sizeof c.cur;
      if (part) {
        std::memcpy(&c.part, p + sizeof c.cur, sizeof c.part);
        c.rpos += sizeof c.part;
      }
      // Requests on a primary wait for every earlier one of their sender (order.cpp); a lane
      // carries parts only.
      if (!c.outbound && !part) {
        if (c.lane != 0) return protocolError(c, "a request other than a write part on a lane");
        if (!takeTurn(c)) return c.fd >= 0;
      }
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
void TcpTransport::Impl::compactPartial(Conn& c) {
  size_t avail = c.rlen - c.rpos;
  std::memmove(c.rbuf.data(), c.rbuf.data() + c.rpos, avail);
  c.rpos = 0;
  c.rlen = avail;
}

bool TcpTransport::Impl::startFrame(Conn& c) {
  const auto& h = c.cur;
  switch (h.type) {
    case wire::kWrite: {
      if (c.outbound) return protocolError(c, "write frame on an outbound connection");
      char* dst = landingOf(c.peer, h.segment, h.offset, h.length);
      c.reply_status = dst ? wire::kOk : wire::kOutOfBounds;
      c.dst = dst;
      c.signal = dst && h.length == 8 && (reinterpret_cast<uintptr_t>(dst) & 7) == 0;
      c.sigpos = 0;
      c.remaining = h.length;
      c.in = Conn::In::kPayload;
      if (c.remaining == 0) finishPayload(c);
      return true;
    }
    case wire::kWritePart: {
      if (c.outbound) return protocolError(c, "write part on an outbound connection");
      return startPart(c);
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
      c.loop->ring = true;
      settle(it->second, why);
      c.pending.erase(it);
      return true;
    }
    case wire::kReadData: {
      if (!c.outbound) return protocolError(c, "read data on an inbound connection");
      auto it = c.pending.find(h.request_id);
      if (it == c.pending.end()) return protocolError(c, "read data for an unknown request");
      if (h.status != wire::kOk || h.length != it->second.length) {
        settle(it->second, str("rank ", c.peer, " rejected a read at offset ", h.offset, " of segment ", h.segment,
                               ": out of bounds"));
        c.loop->ring = true;
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

void TcpTransport::Impl::finishPayload(Conn& c) {
  const auto& h = c.cur;
  c.in = Conn::In::kHeader;
  if (h.type == wire::kWritePart) {
    finishPart(c);
  } else if (h.type == wire::kWrite) {
    if (c.signal) shm::orderedCopy(c.dst, c.sigbuf, 8);
    c.signal = false;
    if ((h.flags & wire::kNotify) && c.reply_status == wire::kOk) c.loop->ring = true;
    answerWrite(c);
  } else if (h.type == wire::kReadData) {
    auto it = c.pending.find(h.request_id);
    if (it != c.pending.end() && c.reply_status == wire::kOk) {
      c.loop->ring = true;
      settle(it->second, "");
      c.pending.erase(it);
    }
    c.reply_status = wire::kOk;
  }
}

void TcpTransport::Impl::answerWrite(Conn& c) {
  // One sent without asking for an acknowledgement (kNoAck) gets one only when rejected, which
  // breaks the pair at the sender (the writes after it assumed it landed).
  if ((c.cur.flags & wire::kNoAck) && c.reply_status == wire::kOk) return;
  wire::FrameHeader a = c.cur;
  a.type = wire::kWriteAck;
  a.status = c.reply_status;
  a.flags = 0;
  c.out.push_back(makeFrame(a, nullptr, 0));
}

bool TcpTransport::Impl::protocolError(Conn& c, const std::string& what) {
  LOG(WARNING) << "moelink tcp: protocol error from rank " << c.peer << ": " << what;
  if (c.in_session) {
    std::lock_guard<std::mutex> g(c.in_session->mu);
    c.in_session->tainted = true;
  }
  closeConn(c, "protocol error: " + what, true);
  return false;
}

char* TcpTransport::Impl::landingOf(int peer, SegmentId segment, uint64_t offset, uint64_t length) {
  auto* dst = static_cast<char*>(segs_.resolveIncomingWrite(segment, offset, length));
  if (!dst)
    LOG(WARNING) << "moelink tcp: rank " << peer << " wrote " << length << " bytes at offset " << offset
                 << " of segment " << segment << ", outside every registered segment; rejected";
  return dst;
}

void TcpTransport::Impl::flushConn(Conn& c) {
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
    // (MSG_NOSIGNAL: a peer that reset the connection is an EPIPE here, not a SIGPIPE that ends
    // a process which has not ignored it; the submitter's thread writes too, flush())
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = static_cast<size_t>(n);
    ssize_t r = ::sendmsg(c.fd, &m, MSG_NOSIGNAL);
    if (r < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      if (errno == EINTR) continue;
      closeConn(c, std::strerror(errno), false);  // a peer that exited, as above
      return;
    }
    uint64_t left = static_cast<uint64_t>(r);
    if (c.outbound) c.loop->sent.fetch_add(left, std::memory_order_relaxed);
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
        const bool write = (h->type == wire::kWrite && f.head_len == sizeof(wire::FrameHeader)) ||
                           (h->type == wire::kWritePart &&
                            f.head_len == sizeof(wire::FrameHeader) + sizeof(wire::PartHeader));
        if (c.outbound && write && (h->flags & wire::kNoAck)) {
          if (auto it = c.pending.find(h->request_id); it != c.pending.end()) {
            settle(it->second, "");
            c.pending.erase(it);
            c.loop->ring = true;
          }
        }
        c.out.pop_front();
      }
    }
  }
  setEvents(c);
}

void TcpTransport::Impl::closeConn(Conn& c, const std::string& why, bool warn) {
  if (c.fd < 0) return;
  Loop& l = *c.loop;
  if (c.in == Conn::In::kHello && !c.outbound) --unauthenticated_;
  std::string reason = str("tcp connection to rank ", c.peer, " lost: ", why);
  // A peer that closed or reset the connection (every clean shutdown does) is logged only
  // verbosely: whoever needed it reports a real loss with this reason. Peer faults warn.
  if (c.outbound && !stopped_ && warn) LOG(WARNING) << "moelink " << reason;
  if (c.outbound && !stopped_ && !warn) VLOG(1) << "moelink " << reason;
  epoll_ctl(l.epoll_fd, EPOLL_CTL_DEL, c.fd, nullptr);
  ::close(c.fd);
  c.fd = -1;
  for (auto& [id, p] : c.pending) settle(p, reason);
  if (!c.pending.empty()) l.ring = true;
  c.pending.clear();
  c.out.clear();
  if (c.in_session) breakSession(*c.in_session, c.lane, c.landed);
  c.landed.clear();
  if (c.outbound) {
    if (auto it = l.outbound.find(c.peer); it != l.outbound.end() && it->second == &c) l.outbound.erase(it);
    std::lock_guard<std::mutex> g(mu_);
    // The peer is lost for every connection of the current session: the others close too, and
    // what was submitted but not yet moved onto them fails.
    auto cur = out_session_.find(c.peer);
    if (cur != out_session_.end() && cur->second == c.session && !dead_.count(c.peer)) {
      dead_[c.peer] = reason;
      losses_.fetch_add(1, std::memory_order_release);
      for (auto& other : loops_) {
        for (auto it = other->submissions.begin(); it != other->submissions.end();) {
          if (it->peer == c.peer) {
            settle(it->pending, reason);
            it = other->submissions.erase(it);
            l.ring = true;
          } else {
            ++it;
          }
        }
        if (other.get() != &l) {
          other->drops.emplace_back(c.peer, c.session, reason);
          wake(*other);
        }
      }
    }
  }
  l.closed_any = true;
}

}  // namespace moelink::transfer::tcp
