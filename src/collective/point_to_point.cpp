// The send side of send / recv over the p2p mailbox (the recv side: p2p_receiver.h; the
// matching rules: worker.h).
#include <glog/logging.h>

#include <algorithm>

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
  auto op = std::make_unique<P2PReceiver::Recv>();
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
  abort_pending_[p] = 0;
  receiver_->failPeer(p, why);
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
      if (!s.all_issued && !p2p_->canSend(p)) {
        std::string fault = p2p_->creditFault(p);
        const bool settled = std::all_of(s.inflight.begin(), s.inflight.end(), [](auto& b) { return b->done(); });
        if (!fault.empty() && settled) {  // (writes in flight still read the caller's memory)
          failPeerP2P(p, fault);
          progressed = true;
          break;
        }
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

}  // namespace moelink::collective
