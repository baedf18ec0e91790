#include "moelink/collective/p2p_receiver.h"

#include <glog/logging.h>

#include <algorithm>
#include <cstring>

#include "moelink/common/error.h"

namespace moelink::collective {

using Clock = std::chrono::steady_clock;

P2PReceiver::P2PReceiver(Mailbox& box, int rank, int world) : box_(box), rank_(rank), world_(world), src_(world) {}

std::string P2PReceiver::prefix(int peer, int tag) const { return str("recv from rank ", peer, " (tag ", tag, ")"); }

bool P2PReceiver::busy() const {
  if (!posted_.empty()) return true;
  for (const Source& s : src_)
    if (s.bound || s.stashing || s.discarding) return true;
  return false;
}

void P2PReceiver::failPeer(int p, const std::string& why) {
  Source& s = src_[p];
  if (s.bound) {
    auto r = std::move(s.bound);
    r->done(str("recv from rank ", p, ": ", why), p);
  }
  resetPeer(p);
  for (auto it = posted_.begin(); it != posted_.end();) {
    if ((*it)->peer == p) {
      auto r = std::move(*it);
      it = posted_.erase(it);
      r->done(str("recv from rank ", p, ": ", why), p);
    } else {
      ++it;
    }
  }
}

void P2PReceiver::resetPeer(int p) {
  Source& s = src_[p];
  if (s.stashing) {
    const Stashed* m = s.stashing;
    stash_.remove_if([&](const Stashed& e) { return &e == m; });
  }
  s.stashing = nullptr;
  s.discarding = false;
  s.in = IncomingSend{};
}

void P2PReceiver::failAll(const std::string& why) {
  for (auto& r : posted_) r->done(why, -1);
  posted_.clear();
  for (Source& s : src_)
    if (s.bound) {
      auto r = std::move(s.bound);
      r->done(why, -1);
    }
}

bool P2PReceiver::progress(const std::vector<char>& live) {
  bool progressed = false;
  for (auto it = posted_.begin(); it != posted_.end();) {
    const int p = (*it)->peer;
    if (p >= 0 && !live[p]) {
      auto r = std::move(*it);
      it = posted_.erase(it);
      r->done(str("recv from rank ", p, ": rank ", p,
                  " is not active in the group (it left; moelink.recover_ranks readmits it)"),
              p);
      progressed = true;
    } else {
      ++it;
    }
  }
  progressed |= matchStash();
  for (int p = 0; p < world_; ++p)
    if (p != rank_) progressed |= receive(p);
  expire();
  return progressed;
}

// Posted recvs take stashed sends first (they arrived before anything in the mailboxes).
bool P2PReceiver::matchStash() {
  bool progressed = false;
  for (auto it = posted_.begin(); it != posted_.end();) {
    Recv& r = **it;
    auto m = std::find_if(stash_.begin(), stash_.end(), [&](const Stashed& s) {
      return s.complete && (r.peer == s.peer || r.peer < 0) && s.tag == r.tag;
    });
    if (m == stash_.end()) {
      ++it;
      continue;
    }
    std::string bad;
    if (m->data.size() != r.bytes)
      bad = str(prefix(m->peer, r.tag), ": rank ", m->peer, " sent ", m->data.size(), " bytes, this rank expects ",
                r.bytes);
    else if (r.bytes)
      std::memcpy(r.data, m->data.data(), r.bytes);
    const int from = m->peer;
    stash_.erase(m);
    auto op = std::move(*it);
    it = posted_.erase(it);
    if (!bad.empty()) LOG(WARNING) << "moelink: rank " << rank_ << ": " << bad;
    op->done(bad, from);
    progressed = true;
  }
  return progressed;
}

bool P2PReceiver::receive(int p) {
  Source& s = src_[p];
  bool progressed = false;
  while (s.discarding) {  // the rest of a send whose recv failed
    const MsgHeader* h = box_.peek(p);
    if (!h) return progressed;
    if (h->flags & kLast) s.discarding = false;
    box_.release(p);
    progressed = true;
  }
  if (!s.bound && !s.stashing) {
    const MsgHeader* h = box_.peek(p);
    if (!h) return progressed;
    if (h->flags & kAbort) {  // a sender gave up on a send no recv matched
      box_.release(p);
      return true;
    }
    if (!startSend(p, *h)) return progressed;
    progressed = true;
  }
  if (s.stashing) return continueStash(p) || progressed;
  if (s.bound) return continueRecv(p) || progressed;
  return progressed;
}

// The head message of `p` starts a send: bind it to the earliest recv it matches, or stash it
// when a recv waits on this source with another tag. False when it stays where it is.
bool P2PReceiver::startSend(int p, const MsgHeader& h) {
  Source& s = src_[p];
  s.in = IncomingSend{};
  auto it = std::find_if(posted_.begin(), posted_.end(), [&](const std::unique_ptr<Recv>& r) {
    return (r->peer == p || r->peer < 0) && r->tag == h.tag;
  });
  if (it == posted_.end()) {
    // No recv for this send yet. If one waits on this source (another tag), the sends behind
    // this one may be what it waits for: stash this one.
    const bool waiting = std::any_of(posted_.begin(), posted_.end(),
                                     [&](const std::unique_ptr<Recv>& r) { return r->peer == p || r->peer < 0; });
    if (!waiting) return false;
    if (std::string bad = checkSendPiece(h, p, s.in, box_.chunkBytes(), prefix(p, h.tag)); !bad.empty()) {
      reject(p, nullptr, bad);
      return true;
    }
    Stashed& m = stash_.emplace_back();
    m.peer = p;
    m.tag = h.tag;
    // Grown as the data comes (each piece was checked against the announced size).
    m.data.reserve(std::min<uint64_t>(h.pair_bytes, box_.chunkBytes() * box_.depth()));
    s.stashing = &m;
    return true;
  }
  std::unique_ptr<Recv> r = std::move(*it);
  posted_.erase(it);
  if (std::string bad = checkSendPiece(h, p, s.in, box_.chunkBytes(), prefix(p, r->tag)); !bad.empty()) {
    reject(p, std::move(r), bad);
    return true;
  }
  if (h.pair_bytes != r->bytes) {
    std::string bad = str(prefix(p, r->tag), ": rank ", p, " sent ", h.pair_bytes, " bytes, this rank expects ", r->bytes);
    LOG(WARNING) << "moelink: rank " << rank_ << ": " << bad;
    skipSend(p);
    r->done(bad, p);
    return true;
  }
  s.bound = std::move(r);
  return true;
}

bool P2PReceiver::continueStash(int p) {
  Source& s = src_[p];
  Stashed& m = *s.stashing;
  bool progressed = false;
  while (const MsgHeader* h = box_.peek(p)) {
    progressed = true;
    if (h->flags & kAbort) {  // the sender gave up half way: forget the partial send
      box_.release(p);
      resetPeer(p);
      break;
    }
    std::string bad = checkSendPiece(*h, p, s.in, box_.chunkBytes(), prefix(p, m.tag));
    const char* data = bad.empty() ? box_.payload(p, &bad) : nullptr;
    if (!data) {
      reject(p, nullptr, bad);
      break;
    }
    m.data.insert(m.data.end(), data, data + h->bytes);
    s.in = {true, h->tag, h->pair_bytes, s.in.got + h->bytes};
    const bool last = h->flags & kLast;
    box_.release(p);
    if (last) {
      m.complete = true;
      s.stashing = nullptr;
      s.in = IncomingSend{};
      break;
    }
  }
  return progressed;
}

bool P2PReceiver::continueRecv(int p) {
  Source& s = src_[p];
  bool progressed = false;
  while (const MsgHeader* h = box_.peek(p)) {
    progressed = true;
    if (h->flags & kAbort) {
      box_.release(p);
      auto r = std::move(s.bound);
      s.in = IncomingSend{};
      r->done(str("recv from rank ", p, ": the sender gave up on this send"), p);
      return true;
    }
    std::string bad = checkSendPiece(*h, p, s.in, box_.chunkBytes(), prefix(p, s.bound->tag));
    const char* data = bad.empty() ? box_.payload(p, &bad) : nullptr;
    if (!data) {
      reject(p, std::move(s.bound), bad);
      return true;
    }
    // NOTES: checkSendPiece bounds got + bytes by the send's size, which equals the recv's.
    if (h->bytes) std::memcpy(s.bound->data + s.in.got, data, h->bytes);
    s.in = {true, h->tag, h->pair_bytes, s.in.got + h->bytes};
    const bool last = h->flags & kLast;
    box_.release(p);
    if (last) {
      auto r = std::move(s.bound);
      s.in = IncomingSend{};
      r->done("", p);
      return true;
    }
  }
  if (s.bound && Clock::now() > s.bound->deadline) {
    auto r = std::move(s.bound);
    s.in = IncomingSend{};
    s.discarding = true;
    r->done(str("recv from rank ", p, ": Timed out in the middle of the message"), p);
    progressed = true;
  }
  return progressed;
}

void P2PReceiver::reject(int p, std::unique_ptr<Recv> r, const std::string& why) {
  LOG(WARNING) << "moelink: rank " << rank_ << ": " << why;
  Source& s = src_[p];
  if (s.stashing) resetPeer(p);
  s.in = IncomingSend{};
  skipSend(p);
  if (r) {
    r->done(why, p);
    return;
  }
  // A broken send that no recv took: the recvs waiting on this source would wait for a send
  // that cannot come right.
  for (auto it = posted_.begin(); it != posted_.end();) {
    if ((*it)->peer == p) {
      auto op = std::move(*it);
      it = posted_.erase(it);
      op->done(why, p);
    } else {
      ++it;
    }
  }
}

void P2PReceiver::skipSend(int p) {
  const MsgHeader* h = box_.peek(p);
  if (!h) return;
  src_[p].discarding = !(h->flags & kLast);
  box_.release(p);
}

void P2PReceiver::expire() {
  const auto now = Clock::now();
  for (auto it = posted_.begin(); it != posted_.end();) {
    if (now <= (*it)->deadline) {
      ++it;
      continue;
    }
    auto op = std::move(*it);
    it = posted_.erase(it);
    std::string from = op->peer < 0 ? std::string("any rank") : str("rank ", op->peer);
    std::string other;  // what did arrive from that source, under other tags
    for (const Stashed& m : stash_)
      if (op->peer < 0 || m.peer == op->peer) other += str(other.empty() ? "" : ", ", m.tag);
    op->done(str("recv from ", from, " (tag ", op->tag, ", ", op->bytes, " bytes): Timed out; nothing was sent",
                 other.empty() ? std::string() : str(" with this tag (unmatched sends with tags ", other, ")")),
             op->peer);
  }
}

}  // namespace moelink::collective
