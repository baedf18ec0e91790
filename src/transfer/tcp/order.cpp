// The receive side's order across one sender's connections (impl.h, Session): requests on the
// primary take their turn after every earlier request of the sender, striped writes land on the
// lanes as their parts arrive, and a primary whose turn has not come waits parked (not reading
// its socket) until the lane that completes the missing write wakes its loop.
#include <sys/epoll.h>
#include <unistd.h>

#include <glog/logging.h>

#include "impl.h"
#include "moelink/common/error.h"

namespace moelink::transfer::tcp {

namespace {

// Moves the frontier over the striped writes that have fully landed right above it.
void advance(Session& s) {
  for (;;) {
    auto it = s.stripes.begin();
    while (it != s.stripes.end() && it->first <= s.frontier) it = s.stripes.erase(it);
    if (it == s.stripes.end() || it->first != s.frontier + 1) return;
    const Session::Stripe& st = it->second;
    if (st.claimed != st.total || st.left != 0) return;
    s.frontier = it->first;
    s.stripes.erase(it);
  }
}

// Under s.mu: whether request `n` may be applied now (every number below it has landed); if so
// the frontier moves over it and over the striped writes done right after it.
bool takeTurnLocked(Session& s, uint64_t n) {
  if (n - 1 != s.frontier) return false;
  s.frontier = n;
  s.waits_for = 0;
  advance(s);
  return true;
}

// Under s.mu: records the requests of one part that landed on a connection (Conn::landed) and
// moves the frontier over what they complete; "" or why they cannot be requests of the session.
std::string landLocked(Session& s, std::vector<uint64_t>& landed) {
  std::string error;
  for (uint64_t n : landed) {
    if (n <= s.frontier) {
      error = str("request ", n, ", which has been applied, again");
    } else if (s.stripes.size() >= kMaxStripesInFlight) {
      error = str("more than ", kMaxStripesInFlight, " striped writes in flight");
    } else if (!s.stripes.emplace(n, Session::Stripe{}).second) {  // (all of it landed: nothing left)
      error = str("parts of request ", n, " name different writes");
    }
    if (!error.empty()) break;
  }
  if (!landed.empty() && error.empty()) advance(s);
  landed.clear();
  return error;
}

}  // namespace

std::shared_ptr<Session> TcpTransport::Impl::sessionFor(int peer, uint64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  for (auto it = sessions_.begin(); it != sessions_.end();)
    it = it->second.expired() ? sessions_.erase(it) : std::next(it);
  auto& weak = sessions_[{peer, id}];
  if (auto s = weak.lock()) return s;
  auto s = std::make_shared<Session>(peer, id);
  weak = s;
  return s;
}

namespace {

// Under s.mu: a request that has not had its turn never will: a connection of the session broke
// the protocol, or one closed and no lane is left to bring the requests it waits for.
bool hopeless(const Session& s) { return s.tainted || (s.broken && s.lanes_open == 0); }

constexpr const char* kStuck = "its session's other connections closed before the requests this one follows came";

}  // namespace

void TcpTransport::Impl::breakSession(Session& s, int lane, std::vector<uint64_t>& landed) {
  Loop* wake_loop = nullptr;
  {
    std::lock_guard<std::mutex> g(s.mu);
    // What landed whole before it closed (a peer that left sent it all) counts; a number that
    // cannot be the session's taints it.
    if (!s.tainted && !landLocked(s, landed).empty()) s.tainted = true;
    if (lane > 0) --s.lanes_open;
    s.broken = true;
    if (s.waits_for) wake_loop = s.primary;
  }
  if (wake_loop) wake(*wake_loop);
}

bool TcpTransport::Impl::takeTurn(Conn& c) {
  Session& s = *c.in_session;
  const uint64_t n = c.cur.request_id;
  std::string error;
  bool stuck = false;
  {
    std::lock_guard<std::mutex> g(s.mu);
    if (s.tainted) {
      error = "another connection of its session broke the protocol";
    } else if (error = landLocked(s, c.landed); !error.empty()) {
    } else if (n <= s.frontier) {
      error = str("request number ", n, " after ", s.frontier, " (numbers only grow)");
    }
    // Numbers it skips are striped writes, whose parts may still be on their way: it waits for
    // them (a sender that skipped numbers it never sends only stalls its own session).
    if (error.empty()) {
      if (takeTurnLocked(s, n)) return true;
      stuck = hopeless(s);
      if (!stuck) s.waits_for = n - 1;
    }
  }
  if (!error.empty()) {
    protocolError(c, error);
    return false;
  }
  if (stuck) {
    closeConn(c, kStuck, false);
    return false;
  }
  c.in = Conn::In::kOrder;
  c.loop->waiting.push_back(&c);
  setEvents(c);
  return false;
}

void TcpTransport::Impl::resumeWaiting(Loop& l) {
  if (l.waiting.empty()) return;
  std::vector<Conn*> waiting;
  waiting.swap(l.waiting);
  for (Conn* c : waiting) {
    if (c->fd < 0 || c->in != Conn::In::kOrder) continue;
    Session& s = *c->in_session;
    const uint64_t n = c->cur.request_id;
    bool go = false, stuck = false;
    {
      std::lock_guard<std::mutex> g(s.mu);
      go = !s.tainted && takeTurnLocked(s, n);
      stuck = !go && hopeless(s);
    }
    if (stuck) {
      closeConn(*c, kStuck, false);
      continue;
    }
    if (!go) {
      l.waiting.push_back(c);
      continue;
    }
    c->in = Conn::In::kHeader;
    setEvents(*c);
    if (!startFrame(*c)) continue;
    if (!consumeBuffered(*c)) continue;
    readConn(*c);
  }
}

bool TcpTransport::Impl::startPart(Conn& c) {
  Session& s = *c.in_session;
  const wire::FrameHeader& h = c.cur;
  const wire::PartHeader& p = c.part;
  c.whole_part = p.part_offset == 0 && h.length == p.total;
  if (c.whole_part) {
    // All of its write (an unordered write of one part): it lands without the session's lock,
    // which finishPart's record of it (publishLanded) takes once for many.
    c.dst = landingOf(c.peer, h.segment, h.offset, h.length);
    c.reply_status = c.dst ? wire::kOk : wire::kOutOfBounds;
    c.signal = false;
    c.remaining = h.length;
    c.in = Conn::In::kPayload;
    if (c.remaining == 0) finishPayload(c);
    return true;
  }
  std::string error;
  char* dst = nullptr;
  bool ok = false;
  {
    std::lock_guard<std::mutex> g(s.mu);
    if (s.tainted) {
      error = "another connection of its session broke the protocol";
    } else if (error = landLocked(s, c.landed); !error.empty()) {
    } else if (h.request_id <= s.frontier) {
      error = str("a part of request ", h.request_id, ", which has been applied");
    } else if (p.part_offset > p.total || h.length > p.total - p.part_offset) {
      error = str("a part of ", h.length, " bytes at ", p.part_offset, " of a ", p.total, "-byte write");
    } else {
      auto it = s.stripes.find(h.request_id);
      if (it == s.stripes.end()) {
        if (s.stripes.size() >= kMaxStripesInFlight) {
          error = str("more than ", kMaxStripesInFlight, " striped writes in flight");
        } else {
          Session::Stripe st;
          st.segment = h.segment;
          st.offset = h.offset;
          st.total = st.left = p.total;
          st.flags = h.flags;
          st.base = landingOf(c.peer, h.segment, h.offset, p.total);
          it = s.stripes.emplace(h.request_id, st).first;
        }
      } else if (it->second.segment != h.segment || it->second.offset != h.offset || it->second.total != p.total) {
        error = str("parts of request ", h.request_id, " name different writes");
      }
      if (error.empty()) {
        Session::Stripe& st = it->second;
        if (h.length > st.total - st.claimed) {
          error = str("parts of request ", h.request_id, " add up to more than its ", st.total, " bytes");
        } else {
          st.claimed += h.length;
          ok = st.base != nullptr;
          dst = ok ? st.base + p.part_offset : nullptr;
        }
      }
    }
  }
  if (!error.empty()) return protocolError(c, error);
  c.dst = dst;
  c.reply_status = ok ? wire::kOk : wire::kOutOfBounds;
  c.signal = false;
  c.remaining = h.length;
  c.in = Conn::In::kPayload;
  if (c.remaining == 0) finishPayload(c);
  return true;
}

void TcpTransport::Impl::finishPart(Conn& c) {
  Session& s = *c.in_session;
  const wire::FrameHeader& h = c.cur;
  if (c.whole_part) {
    c.landed.push_back(h.request_id);
    if ((h.flags & wire::kNotify) && c.reply_status == wire::kOk) c.loop->ring = true;
    // (recorded when this connection's reads pause, or every kLandedBatch of them)
    if (c.landed.size() >= kLandedBatch && !publishLanded(c)) return;  // closed
    answerWrite(c);
    c.reply_status = wire::kOk;
    return;
  }
  Loop* wake_loop = nullptr;
  bool notify = false;
  {
    std::lock_guard<std::mutex> g(s.mu);
    auto it = s.stripes.find(h.request_id);
    if (it != s.stripes.end()) {
      Session::Stripe& st = it->second;
      st.left -= std::min(st.left, h.length);
      if (st.left == 0 && st.claimed == st.total) {
        notify = (st.flags & wire::kNotify) && st.base;
        advance(s);
        if (s.waits_for && s.frontier >= s.waits_for && s.primary != c.loop) wake_loop = s.primary;
      }
    }
  }
  if (notify) c.loop->ring = true;
  // The primary on this loop (streams of one lane per loop share loop 0) resumes in this pass;
  // on another, this thread lets it go on unless that loop is busy.
  if (wake_loop) driveOrWake(*wake_loop);
  answerWrite(c);
  c.reply_status = wire::kOk;
}

bool TcpTransport::Impl::publishLanded(Conn& c) {
  if (c.landed.empty() || c.fd < 0) return c.fd >= 0;
  Session& s = *c.in_session;
  Loop* wake_loop = nullptr;
  std::string error;
  {
    std::lock_guard<std::mutex> g(s.mu);
    if (!s.tainted) error = landLocked(s, c.landed);
    // (the primary on this loop resumes in this pass)
    if (error.empty() && s.waits_for && s.frontier >= s.waits_for && s.primary != c.loop) wake_loop = s.primary;
  }
  c.landed.clear();
  if (!error.empty()) return protocolError(c, error);
  if (wake_loop) driveOrWake(*wake_loop);
  return true;
}

}  // namespace moelink::transfer::tcp
