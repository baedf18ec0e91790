// send / recv / recv-from-any over the p2p mailbox (see worker.h for the matching rules).
#include <glog/logging.h>

#include <algorithm>
#include <cstring>

#include "moelink/collective/worker.h"
#include "moelink/common/error.h"
#include "worker_internal.h"

namespace moelink::collective {

using namespace std::chrono;

void CollectiveWorker::send(int peer, const void* data, uint64_t bytes, int tag, OpCallback done,
                            milliseconds timeout, std::function<bool()> ready) {
  MOELINK_CHECK(peer >= 0 && peer < world_ && peer != rank_, "invalid destination rank ", peer,
                " (group of ", world_, ", this rank ", rank_, ")");
  auto op = std::make_unique<SendOp>();
  op->peer = peer;
  op->data = static_cast<const char*>(data);
  op->bytes = bytes;
  op->tag = tag;
  op->done = std::move(done);
  op->deadline = Clock::now() + timeout;
  op->timeout = timeout;
  op->ready = std::move(ready);
  {
    std::lock_guard<std::mutex> g(mu_);
    MOELINK_CHECK(!stop_, "the process group is shut down");
    new_sends_.push_back(std::move(op));
  }
  engine_.ringLocal();
}

void CollectiveWorker::recv(int peer, void* data, uint64_t bytes, int tag, RecvCallback done,
                            milliseconds timeout) {
  MOELINK_CHECK(peer < world_ && peer != rank_, "invalid source rank ", peer, " (group of ",
                world_, ", this rank ", rank_, ")");
  auto op = std::make_unique<RecvOp>();
  op->peer = peer;
  op->data = static_cast<char*>(data);
  op->bytes = bytes;
  op->tag = tag;
  op->done = std::move(done);
  op->deadline = Clock::now() + timeout;
  {
    std::lock_guard<std::mutex> g(mu_);
    MOELINK_CHECK(!stop_, "the process group is shut down");
    new_recvs_.push_back(std::move(op));
  }
  engine_.ringLocal();
}

void CollectiveWorker::failPeerP2P(int p, const std::string& why) {
  for (auto& s : sends_[p]) s->done(str("send to rank ", p, ": ", why));
  sends_[p].clear();
  if (bound_[p]) {
    auto op = std::move(bound_[p]);
    op->done(str("recv from rank ", p, ": ", why), p);
  }
  if (stashing_[p]) {
    Stashed* m = stashing_[p];
    stash_.remove_if([&](const Stashed& s) { return &s == m; });
    stashing_[p] = nullptr;
  }
  discarding_[p] = abort_pending_[p] = 0;
  for (auto it = posted_.begin(); it != posted_.end();) {
    if ((*it)->peer == p) {
      auto op = std::move(*it);
      it = posted_.erase(it);
      op->done(str("recv from rank ", p, ": ", why), p);
    } else {
      ++it;
    }
  }
}

bool CollectiveWorker::progressSends() {
  bool progressed = false;
  const uint64_t chunk = p2p_->chunkBytes();
  for (int p = 0; p < world_; ++p) {
    auto& q = sends_[p];
    if (!q.empty() && !live_[p]) {
      failPeerP2P(p, str("rank ", p, " is not active in the group (it left; moelink.recover_ranks readmits it)"));
      progressed = true;
      continue;
    }
    if (abort_pending_[p] && p2p_->canSendControl(p)) {
      MsgHeader h;
      h.kind = static_cast<uint8_t>(OpKind::kSend);
      h.flags = kAbort | kLast;
      h.sender = rank_;
      p2p_->send(p, h, nullptr);
      abort_pending_[p] = 0;
      progressed = true;
    }
    while (!q.empty() && !abort_pending_[p]) {
      SendOp& s = *q.front();
      if (s.seq == 0) {
        if (s.ready) {
          if (!s.ready()) break;
          s.ready = nullptr;
          s.deadline = Clock::now() + s.timeout;
        }
        s.seq = ++p2p_sent_[p];
      }
      while (!s.all_issued && p2p_->canSend(p)) {
        uint64_t len = std::min(chunk, s.bytes - s.issued_bytes);
        MsgHeader h;
        h.kind = static_cast<uint8_t>(OpKind::kSend);
        h.op_seq = s.seq;
        h.pair_bytes = s.bytes;
        h.bytes = len;
        h.tag = s.tag;
        h.sender = rank_;
        h.flags = (s.issued_bytes == 0 ? kFirst : 0);
        if (s.issued_bytes + len == s.bytes) {
          h.flags |= kLast;
          s.all_issued = true;
        }
        s.inflight.push_back(p2p_->send(p, h, s.data + s.issued_bytes));
        s.issued_bytes += len;
        progressed = true;
      }
      std::string err;
      bool done = s.all_issued;
      for (auto& b : s.inflight) {
        if (b->failed()) err = str("send to rank ", p, ": ", b->error());
        done &= b->done();
      }
      if (err.empty() && !done && Clock::now() > s.deadline) {
        err = str("send to rank ", p, " (tag ", s.tag, ", ", s.bytes,
                  " bytes): Timed out; no matching recv consumed it");
        if (s.issued_bytes > 0 && !s.all_issued) abort_pending_[p] = 1;
      }
      if (err.empty() && !done) break;
      // Writes that are still in flight read the caller's memory: wait for them.
      bool settled = true;
      for (auto& b : s.inflight) settled &= b->done();
      if (!settled) break;
      if (!err.empty()) LOG(WARNING) << "moelink: rank " << rank_ << ": " << err;
      auto cb = std::move(s.done);
      q.pop_front();
      cb(err);
      progressed = true;
    }
  }
  return progressed;
}

bool CollectiveWorker::progressRecvs() {
  bool progressed = false;
  // Posted recvs take stashed sends first (they arrived before anything in the mailboxes).
  for (auto it = posted_.begin(); it != posted_.end();) {
    RecvOp& r = **it;
    if (r.peer >= 0 && !live_[r.peer]) {
      auto op = std::move(*it);
      it = posted_.erase(it);
      op->done(str("recv from rank ", op->peer, ": rank ", op->peer,
                   " is not active in the group (it left; moelink.recover_ranks readmits it)"),
               op->peer);
      progressed = true;
      continue;
    }
    auto m = std::find_if(stash_.begin(), stash_.end(), [&](const Stashed& s) {
      return s.complete && (r.peer == s.peer || r.peer < 0) && s.tag == r.tag;
    });
    if (m == stash_.end()) {
      ++it;
      continue;
    }
    std::string bad;
    if (m->bytes != r.bytes)
      bad = str("recv from rank ", m->peer, " (tag ", r.tag, "): rank ", m->peer, " sent ", m->bytes,
                " bytes, this rank expects ", r.bytes);
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
  for (int p = 0; p < world_; ++p) {
    if (p == rank_) continue;
    // Skip the rest of a send whose recv failed.
    while (discarding_[p]) {
      const MsgHeader* h = p2p_->peek(p);
      if (!h) break;
      if (h->flags & kLast) discarding_[p] = 0;
      p2p_->release(p);
      progressed = true;
    }
    if (discarding_[p]) continue;
    if (!bound_[p] && !stashing_[p]) {
      const MsgHeader* h = p2p_->peek(p);
      if (!h) continue;
      if (h->flags & kAbort) {  // a sender gave up on a send we never matched
        p2p_->release(p);
        progressed = true;
        continue;
      }
      auto it = std::find_if(posted_.begin(), posted_.end(), [&](const std::unique_ptr<RecvOp>& r) {
        return (r->peer == p || r->peer < 0) && r->tag == h->tag;
      });
      if (it == posted_.end()) {
        // No recv for this send yet. If one waits on this source (another tag), the sends
        // behind this one may be what it waits for: stash this one.
        bool waiting = std::any_of(posted_.begin(), posted_.end(),
                                   [&](const std::unique_ptr<RecvOp>& r) { return r->peer == p || r->peer < 0; });
        if (!waiting) continue;
        Stashed& m = stash_.emplace_back();
        m.peer = p;
        m.tag = h->tag;
        m.bytes = h->pair_bytes;
        m.data.reserve(h->pair_bytes);
        stashing_[p] = &m;
      } else {
        std::unique_ptr<RecvOp> r = std::move(*it);
        posted_.erase(it);
        progressed = true;
        if (h->pair_bytes != r->bytes) {
          std::string bad = str("recv from rank ", p, " (tag ", r->tag, "): rank ", p, " sent ", h->pair_bytes,
                                " bytes, this rank expects ", r->bytes);
          LOG(WARNING) << "moelink: rank " << rank_ << ": " << bad;
          discarding_[p] = 1;
          r->done(bad, p);
          --p;  // discard this send now
          continue;
        }
        bound_[p] = std::move(r);
      }
    }
    if (stashing_[p]) {
      Stashed& m = *stashing_[p];
      while (const MsgHeader* h = p2p_->peek(p)) {
        progressed = true;
        if (h->flags & kAbort) {  // the sender gave up half way: forget the partial send
          p2p_->release(p);
          stashing_[p] = nullptr;
          stash_.remove_if([&](const Stashed& s) { return &s == &m; });
          break;
        }
        m.data.insert(m.data.end(), p2p_->payload(p), p2p_->payload(p) + h->bytes);
        const bool last = h->flags & kLast;
        p2p_->release(p);
        if (last) {
          m.complete = true;
          stashing_[p] = nullptr;
          break;
        }
      }
      continue;
    }
    RecvOp& r = *bound_[p];
    while (const MsgHeader* h = p2p_->peek(p)) {
      if (h->flags & kAbort) {
        std::string why = str("recv from rank ", p, ": the sender gave up on this send");
        p2p_->release(p);
        auto op = std::move(bound_[p]);
        op->done(why, p);
        progressed = true;
        break;
      }
      if (h->bytes) std::memcpy(r.data + r.got, p2p_->payload(p), h->bytes);
      r.got += h->bytes;
      bool last = h->flags & kLast;
      p2p_->release(p);
      progressed = true;
      if (last) {
        auto op = std::move(bound_[p]);
        op->done("", p);
        break;
      }
    }
    if (bound_[p] && Clock::now() > bound_[p]->deadline) {
      auto op = std::move(bound_[p]);
      discarding_[p] = 1;
      op->done(str("recv from rank ", p, ": Timed out in the middle of the message"), p);
      progressed = true;
    }
  }
  auto now = Clock::now();
  for (auto it = posted_.begin(); it != posted_.end();) {
    if (now > (*it)->deadline) {
      auto op = std::move(*it);
      it = posted_.erase(it);
      std::string from = op->peer < 0 ? std::string("any rank") : str("rank ", op->peer);
      std::string other;  // what did arrive from that source, under other tags
      for (const Stashed& m : stash_)
        if (op->peer < 0 || m.peer == op->peer) other += str(other.empty() ? "" : ", ", m.tag);
      op->done(str("recv from ", from, " (tag ", op->tag, ", ", op->bytes, " bytes): Timed out; nothing was sent",
                   other.empty() ? std::string() : str(" with this tag (unmatched sends with tags ", other, ")")),
               op->peer);
      progressed = true;
    } else {
      ++it;
    }
  }
  return progressed;
}

}  // namespace moelink::collective
