#include "moelink/collective/mailbox.h"

#include <cstring>

#include "moelink/common/error.h"

namespace moelink::collective {

using transfer::Opcode;
using transfer::TransferRequest;

Mailbox::Mailbox(transfer::TransferEngine& engine, transfer::SegmentId id, uint64_t chunk_bytes,
                 int depth)
    : engine_(engine),
      id_(id),
      rank_(engine.rank()),
      world_(engine.worldSize()),
      chunk_((chunk_bytes + 63) / 64 * 64),
      depth_(static_cast<uint64_t>(depth)) {
  MOELINK_CHECK(depth >= 1, "mailbox depth must be >= 1");
  uint64_t n = static_cast<uint64_t>(world_);
  acks_off_ = (n * depth_ * 8 + 63) / 64 * 64;
  slots_off_ = acks_off_ + (n * 8 + 63) / 64 * 64;
  slot_bytes_ = sizeof(MsgHeader) + chunk_;
  uint64_t total = slots_off_ + n * depth_ * slot_bytes_;
  base_ = static_cast<char*>(engine_.allocateSegment(id_, total));
  sent_.assign(n, 0);
  consumed_.assign(n, 0);
  out_headers_.resize(n * depth_);
  out_signals_.assign(n * depth_, 0);
  out_acks_.assign(n, 0);
  head_payload_.assign(n, nullptr);
  transports_.assign(n, "");
  tcp_.assign(n, 0);
}

void Mailbox::open(const std::vector<char>& only) {
  for (int p = 0; p < world_; ++p) {
    if (!only.empty() && !only[p]) continue;
    transports_[p] = engine_.openSegment(p, id_);
    tcp_[p] = transports_[p] == "tcp";
  }
}

void Mailbox::resetPeer(int peer) {
  std::memset(base_ + signalOffset(peer, 0), 0, depth_ * 8);
  __atomic_store_n(reinterpret_cast<uint64_t*>(base_ + ackOffset(peer)), 0, __ATOMIC_RELEASE);
  sent_[peer] = consumed_[peer] = 0;
  for (uint64_t s = 0; s < depth_; ++s) out_signals_[peer * depth_ + s] = 0;
  out_acks_[peer] = 0;
  head_payload_[peer] = nullptr;
  transports_[peer] = engine_.openSegment(peer, id_);
  tcp_[peer] = transports_[peer] == "tcp";
}

bool Mailbox::canSend(int peer) const {
  // NOTES: pairs with the fence in release(): our last signal store is ordered before this
  // load, so either we see the receiver's new credit or the receiver sees our message
  // and wakes us.
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  uint64_t acked = __atomic_load_n(reinterpret_cast<const uint64_t*>(base_ + ackOffset(peer)),
                                   __ATOMIC_ACQUIRE);
  return sent_[peer] - acked < depth_;
}

transfer::BatchPtr Mailbox::send(int peer, const MsgHeader& header, const void* payload) {
  MOELINK_CHECK(header.bytes <= chunk_, "message of ", header.bytes, " bytes exceeds the ",
                chunk_, "-byte mailbox slot");
  uint64_t seq = ++sent_[peer];
  uint64_t slot = seq % depth_;
  size_t idx = static_cast<size_t>(peer) * depth_ + slot;
  out_headers_[idx] = header;
  out_signals_[idx] = seq;
  std::vector<TransferRequest> reqs;
  reqs.reserve(3);
  uint64_t at = slotOffset(rank_, slot);
  if (header.bytes)
    reqs.push_back({Opcode::kWrite, const_cast<void*>(payload), peer, id_, at + sizeof(MsgHeader),
                    header.bytes});
  reqs.push_back({Opcode::kWrite, &out_headers_[idx], peer, id_, at, sizeof(MsgHeader)});
  // NOTES: the signal goes last; the engine orders it after the two writes above.
  reqs.push_back({Opcode::kWrite, &out_signals_[idx], peer, id_, signalOffset(rank_, slot), 8, true});
  return engine_.submit(reqs);
}

const MsgHeader* Mailbox::peek(int peer) const {
  uint64_t want = consumed_[peer] + 1;
  uint64_t slot = want % depth_;
  uint64_t sig = __atomic_load_n(reinterpret_cast<const uint64_t*>(base_ + signalOffset(peer, slot)),
                                 __ATOMIC_ACQUIRE);
  if (sig != want) return nullptr;
  return reinterpret_cast<const MsgHeader*>(base_ + slotOffset(peer, slot));
}

const char* Mailbox::payload(int peer) {
  if (!head_payload_[peer]) {
    uint64_t off = slotOffset(peer, (consumed_[peer] + 1) % depth_) + sizeof(MsgHeader);
    void* landed = tcp_[peer] ? engine_.claimExpected(id_, off) : nullptr;
    head_payload_[peer] = landed ? static_cast<const char*>(landed) : base_ + off;
  }
  return head_payload_[peer];
}

void Mailbox::landAhead(int peer, uint64_t ahead, void* dest, uint64_t length) {
  if (!tcp_[peer] || ahead >= depth_ || !dest || !length) return;
  uint64_t msg = consumed_[peer] + 1 + ahead;
  engine_.expectWrite(id_, slotOffset(peer, msg % depth_) + sizeof(MsgHeader), dest, length);
}

void Mailbox::clearLandings() { engine_.clearExpected(id_); }

void Mailbox::release(int peer, void* next_dest, uint64_t next_length) {
  // A landing request for this slot must not outlive its message (payload() claims it).
  payload(peer);
  head_payload_[peer] = nullptr;
  if (next_dest && next_length && tcp_[peer])
    engine_.expectWrite(id_, slotOffset(peer, (consumed_[peer] + 1) % depth_) + sizeof(MsgHeader),
                        next_dest, next_length);
  uint64_t n = ++consumed_[peer];
  // A newer value may overwrite this staging word while an older ack is still being sent;
  // the count only grows, so the sender reads the same or a newer count.
  __atomic_store_n(&out_acks_[peer], n, __ATOMIC_RELAXED);
  // Over tcp the ack always wakes the sender (its arrival order is not observable here).
  engine_.submit({TransferRequest{Opcode::kWrite, &out_acks_[peer], peer, id_, ackOffset(rank_), 8, tcp_[peer] != 0}});
  if (tcp_[peer]) return;
  // The sender can only be blocked on this credit if it has filled every slot, i.e. if
  // message n - 1 + depth is already here; only then is a wake-up worth its syscall.
  // NOTES: the ack store above (shm: synchronous) is ordered before this load.
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  uint64_t last = n - 1 + depth_;
  uint64_t sig = __atomic_load_n(reinterpret_cast<const uint64_t*>(base_ + signalOffset(peer, last % depth_)),
                                 __ATOMIC_ACQUIRE);
  if (sig == last) engine_.notify(peer);
}

}  // namespace moelink::collective
