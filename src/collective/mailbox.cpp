#include "moelink/collective/mailbox.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

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
      chunk_(slotChunk(chunk_bytes)),
      depth_(static_cast<uint64_t>(depth)),
      ring_(depth_ + 1) {
  MOELINK_CHECK(depth >= 1, "mailbox depth must be >= 1");
  uint64_t n = static_cast<uint64_t>(world_);
  auto lines = [](uint64_t bytes) { return (bytes + 63) / 64 * 64; };
  acks_off_ = lines(n * ring_ * 8);
  claims_off_ = acks_off_ + lines(n * 8);
  pull_ok_off_ = claims_off_ + lines(n * ring_ * 8);
  slots_off_ = pull_ok_off_ + lines(n * 8);
  slot_bytes_ = sizeof(MsgHeader) + chunk_;
  total_ = slots_off_ + n * ring_ * slot_bytes_;
  base_ = static_cast<char*>(engine_.allocateSegment(id_, total_));
  sent_.assign(n, 0);
  consumed_.assign(n, 0);
  out_headers_.resize(n * ring_);
  out_signals_.assign(n * ring_, 0);
  out_acks_.assign(n, 0);
  head_payload_.assign(n, nullptr);
  head_.resize(n);
  head_valid_.assign(n, 0);
  lost_payload_.resize(n);
  credit_fault_.assign(n, 0);
  transports_.assign(n, "");
  tcp_.assign(n, 0);
  pulls_.resize(n);
  peer_base_.assign(n, nullptr);
  reads_from_.assign(n, 0);
}

namespace {

// Claim word values (mailbox.h).
uint64_t posted(uint64_t seq) { return seq * 4 + 1; }
uint64_t doneRead(uint64_t seq) { return seq * 4 + 2; }
uint64_t revoked(uint64_t seq) { return seq * 4 + 3; }

uint64_t* word(char* base, uint64_t off) { return reinterpret_cast<uint64_t*>(base + off); }

}  // namespace

// Tells `peer` whether this rank can read its memory (then it may send pulled messages).
void Mailbox::publishPullOk(int peer) {
  peer_base_[peer] = transports_[peer] == "shm"
                         ? static_cast<char*>(engine_.mappedAt(peer, id_, 0, total_))
                         : nullptr;
  reads_from_[peer] = peer_base_[peer] && engine_.canReadFrom(peer);
  if (peer_base_[peer])
    __atomic_store_n(word(peer_base_[peer], pullOkOffset(rank_)), reads_from_[peer] ? 2 : 1, __ATOMIC_RELEASE);
}

void Mailbox::open(const std::vector<char>& only) {
  for (int p = 0; p < world_; ++p) {
    if (!only.empty() && !only[p]) continue;
    transports_[p] = engine_.openSegment(p, id_);
    tcp_[p] = transports_[p] == "tcp";
    if (p != rank_) publishPullOk(p);
  }
}

void Mailbox::dropPeer(int peer) {
  for (auto& pp : pulls_[peer]) pp.batch->complete(0);  // the process is gone: nothing reads its memory
  pulls_[peer].clear();
  peer_base_[peer] = nullptr;
  reads_from_[peer] = 0;
}

void Mailbox::resetPeer(int peer) {
  dropPeer(peer);
  std::memset(base_ + signalOffset(peer, 0), 0, ring_ * 8);
  std::memset(base_ + claimOffset(peer, 0), 0, ring_ * 8);
  // The new process says for itself whether it reads this rank's memory; it opens this
  // mailbox only once admitted, after every active rank has come through here.
  __atomic_store_n(word(base_, pullOkOffset(peer)), 0, __ATOMIC_RELEASE);
  __atomic_store_n(reinterpret_cast<uint64_t*>(base_ + ackOffset(peer)), 0, __ATOMIC_RELEASE);
  sent_[peer] = consumed_[peer] = 0;
  for (uint64_t s = 0; s < ring_; ++s) out_signals_[peer * ring_ + s] = 0;
  out_acks_[peer] = 0;
  head_payload_[peer] = nullptr;
  head_valid_[peer] = 0;
  lost_payload_[peer].clear();
  credit_fault_[peer] = 0;
  transports_[peer] = engine_.openSegment(peer, id_);
  tcp_[peer] = transports_[peer] == "tcp";
  publishPullOk(peer);
}

uint64_t Mailbox::unacked(int peer) const {
  // NOTES: pairs with the fence in release(): our last signal store is ordered before this
  // load, so either we see the receiver's new credit or the receiver sees our message
  // and wakes us.
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  uint64_t acked = __atomic_load_n(reinterpret_cast<const uint64_t*>(base_ + ackOffset(peer)),
                                   __ATOMIC_ACQUIRE);
  if (acked > sent_[peer]) {  // the word is the peer's to write: never trust it past what was sent
    credit_fault_[peer] = 1;
    return ring_;
  }
  return sent_[peer] - acked;
}

bool Mailbox::canSend(int peer) const { return unacked(peer) < depth_; }

std::string Mailbox::creditFault(int peer) const {
  if (!credit_fault_[peer]) return "";
  return str("rank ", peer, " acknowledged ",
             __atomic_load_n(reinterpret_cast<const uint64_t*>(base_ + ackOffset(peer)), __ATOMIC_ACQUIRE),
             " messages of this rank, which sent it ", sent_[peer], " (a corrupt or forged credit: nothing more is sent "
             "to it on this mailbox)");
}

bool Mailbox::canSendControl(int peer) const { return unacked(peer) < ring_; }

transfer::BatchPtr Mailbox::send(int peer, const MsgHeader& header, const void* payload) {
  MOELINK_CHECK(header.bytes <= chunk_, "message of ", header.bytes, " bytes exceeds the ",
                chunk_, "-byte mailbox slot");
  uint64_t seq = ++sent_[peer];
  uint64_t slot = seq % ring_;
  size_t idx = static_cast<size_t>(peer) * ring_ + slot;
  out_headers_[idx] = header;
  out_signals_[idx] = seq;
  std::vector<TransferRequest> reqs;
  reqs.reserve(3);
  uint64_t at = slotOffset(rank_, slot);
  if (header.bytes)
    reqs.push_back({Opcode::kWrite, const_cast<void*>(payload), peer, id_, at + sizeof(MsgHeader),
                    header.bytes});
  reqs.push_back({Opcode::kWrite, &out_headers_[idx], peer, id_, at, sizeof(MsgHeader)});
  // NOTES: the signal goes last; the engine orders it after the two writes above. Over tcp it
  // is not acknowledged either: waiting for the receiver's reply would hold the op (a broadcast
  // root) for a round trip through both progress threads after its data has left.
  reqs.push_back({Opcode::kWrite, &out_signals_[idx], peer, id_, signalOffset(rank_, slot), 8, true,
                  tcp_[peer] != 0});
  return engine_.submit(reqs);
}

bool Mailbox::peerReadsDirectly(int peer) const {
  return peer >= 0 && peer < world_ && __atomic_load_n(word(base_, pullOkOffset(peer)), __ATOMIC_ACQUIRE) == 2;
}

bool Mailbox::peerHasSaid(int peer) const {
  return __atomic_load_n(word(base_, pullOkOffset(peer)), __ATOMIC_ACQUIRE) != 0;
}

bool Mailbox::canPull(int peer) const { return peer_base_[peer] && peerReadsDirectly(peer); }

transfer::BatchPtr Mailbox::sendPull(int peer, const MsgHeader& header, const void* payload) {
  MOELINK_CHECK(canPull(peer), "rank ", peer, " cannot read this rank's memory");
  uint64_t seq = ++sent_[peer];
  uint64_t slot = seq % ring_;
  size_t idx = static_cast<size_t>(peer) * ring_ + slot;
  out_headers_[idx] = header;
  out_headers_[idx].flags |= kPull;
  out_headers_[idx].pull_addr = reinterpret_cast<uint64_t>(payload);
  out_signals_[idx] = seq;
  // NOTES: the claim word is set before the signal below is stored (release): a receiver that
  // sees the message sees it POSTED.
  __atomic_store_n(word(peer_base_[peer], claimOffset(rank_, slot)), posted(seq), __ATOMIC_RELEASE);
  uint64_t at = slotOffset(rank_, slot);
  auto sent = engine_.submit({TransferRequest{Opcode::kWrite, &out_headers_[idx], peer, id_, at, sizeof(MsgHeader)},
                              TransferRequest{Opcode::kWrite, &out_signals_[idx], peer, id_,
                                              signalOffset(rank_, slot), 8, true}});
  auto batch = std::make_shared<transfer::TransferBatch>(1);
  if (sent->failed())
    batch->fail(0, sent->error());
  else
    pulls_[peer].push_back({seq, batch});
  return batch;
}

void Mailbox::pollPulls() {
  for (int p = 0; p < world_; ++p) {
    auto& q = pulls_[p];
    if (q.empty()) continue;
    uint64_t acked = __atomic_load_n(word(base_, ackOffset(p)), __ATOMIC_ACQUIRE);
    while (!q.empty()) {
      uint64_t seq = q.front().seq;
      if (acked < seq &&
          __atomic_load_n(word(peer_base_[p], claimOffset(rank_, seq % ring_)), __ATOMIC_ACQUIRE) != doneRead(seq))
        break;
      q.front().batch->complete(0);
      q.pop_front();
    }
  }
}

void Mailbox::revokePulls(int peer) {
  for (int p = 0; p < world_; ++p) {
    if (peer >= 0 && p != peer) continue;
    for (auto& pp : pulls_[p]) {
      uint64_t expect = posted(pp.seq);
      // Whatever the word says now (DONE: read in time; POSTED: now REVOKED), the memory is free.
      __atomic_compare_exchange_n(word(peer_base_[p], claimOffset(rank_, pp.seq % ring_)), &expect,
                                  revoked(pp.seq), false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
      pp.batch->complete(0);
    }
    pulls_[p].clear();
  }
}

bool Mailbox::arrived(int src, uint64_t msg) const {
  return __atomic_load_n(reinterpret_cast<const uint64_t*>(base_ + signalOffset(src, msg % ring_)), __ATOMIC_ACQUIRE) ==
         msg;
}

const MsgHeader* Mailbox::peek(int peer) {
  if (head_valid_[peer]) return &head_[peer];
  uint64_t want = consumed_[peer] + 1;
  uint64_t slot = want % ring_;
  if (!arrived(peer, want)) return nullptr;
  // NOTES: the one read of this header: over shm the sender can rewrite the slot at any time,
  // so every decision about the message is taken on this copy (ordered after the signal).
  std::memcpy(&head_[peer], base_ + slotOffset(peer, slot), sizeof(MsgHeader));
  head_valid_[peer] = 1;
  return &head_[peer];
}

const char* Mailbox::payload(int peer, std::string* error, char* landing, uint64_t landing_bytes) {
  if (head_payload_[peer]) return head_payload_[peer];
  const MsgHeader* h = peek(peer);
  if (!h) {
    *error = str("no message from rank ", peer);
    return nullptr;
  }
  if (const auto& lost = lost_payload_[peer];
      !lost.empty() && std::find(lost.begin(), lost.end(), consumed_[peer] + 1) != lost.end()) {
    *error = str("rank ", peer, "'s message #", consumed_[peer] + 1, " was being received into the memory of an op "
                 "that failed and had not arrived whole when that op ended: its data is lost");
    return nullptr;
  }
  const bool pulled = h->flags & kPull;
  if (!pulled || !landing) {
    if (h->bytes > chunk_) {
      *error = str("rank ", peer, " sent a ", h->bytes, "-byte message, larger than a mailbox slot (", chunk_,
                   " bytes)");
      return nullptr;
    }
    if (!pulled) return slotPayload(peer);
  } else if (h->bytes > landing_bytes) {
    *error = str("rank ", peer, " sent a ", h->bytes, "-byte message where this rank expects at most ", landing_bytes);
    return nullptr;
  }
  const uint64_t want = consumed_[peer] + 1;
  const uint64_t slot = want % ring_;
  if (!peer_base_[peer] || !reads_from_[peer]) {
    *error = str("rank ", peer, " sent a message to be read from its memory, which this rank cannot read");
    return nullptr;
  }
  char* dst = landing ? landing : base_ + slotOffset(peer, slot) + sizeof(MsgHeader);
  std::string why = engine_.readFrom(peer, dst, h->pull_addr, h->bytes);
  if (!why.empty()) {
    *error = str("rank ", peer, "'s data could not be read: ", why);
    return nullptr;
  }
  uint64_t expect = posted(want);
  if (!__atomic_compare_exchange_n(word(base_, claimOffset(peer, slot)), &expect, doneRead(want), false,
                                   __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    *error = str("rank ", peer, " withdrew its data while this rank was reading it (the op failed there)");
    return nullptr;
  }
  engine_.notify(peer);  // its send is complete now
  head_payload_[peer] = dst;
  return dst;
}

const char* Mailbox::slotPayload(int peer) {
  if (!head_payload_[peer]) {
    uint64_t off = slotOffset(peer, (consumed_[peer] + 1) % ring_) + sizeof(MsgHeader);
    void* landed = tcp_[peer] ? engine_.claimExpected(id_, off) : nullptr;
    head_payload_[peer] = landed ? static_cast<const char*>(landed) : base_ + off;
  }
  return head_payload_[peer];
}

void Mailbox::landAhead(int peer, uint64_t ahead, void* dest, uint64_t length) {
  if (!tcp_[peer] || ahead >= depth_ || !dest || !length) return;
  uint64_t msg = consumed_[peer] + 1 + ahead;
  // A message that is here already stays in its slot: its payload may have been taken from there
  // (payload()), and a request nobody claims would catch the next message into that slot. (One
  // that arrives from here on has not been taken: its request is claimed when it is.)
  if (arrived(peer, msg)) return;
  engine_.expectWrite(id_, slotOffset(peer, msg % ring_) + sizeof(MsgHeader), dest, length);
}

void Mailbox::clearLandings(std::chrono::milliseconds wait) {
  const auto until = std::chrono::steady_clock::now() + wait;
  for (const auto& used : engine_.clearExpected(id_)) {
    // Whose slot, and which message: the only one that may be written there now is the next
    // one due in it (a request is made for a message less than ring_ places ahead).
    const uint64_t slot_index = (used.offset - sizeof(MsgHeader) - slots_off_) / slot_bytes_;
    const int src = static_cast<int>(slot_index / ring_);
    const uint64_t slot = slot_index % ring_, next = consumed_[src] + 1;
    const uint64_t msg = next + (slot + ring_ - next % ring_) % ring_;
    // The signal follows the payload: once it is here, the whole payload is at used.dest.
    while (!arrived(src, msg) && engine_.lostReason(src).empty() && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    if (!arrived(src, msg)) {
      lost_payload_[src].push_back(msg);
      continue;
    }
    MsgHeader h;
    std::memcpy(&h, base_ + slotOffset(src, slot), sizeof h);
    std::memcpy(base_ + used.offset, used.dest, std::min({h.bytes, used.length, chunk_}));
  }
}

void Mailbox::release(int peer, void* next_dest, uint64_t next_length) {
  // A landing request for this slot must not outlive its message (slotPayload() claims it).
  slotPayload(peer);
  head_payload_[peer] = nullptr;
  head_valid_[peer] = 0;
  if (auto& lost = lost_payload_[peer]; !lost.empty())
    lost.erase(std::remove(lost.begin(), lost.end(), consumed_[peer] + 1), lost.end());
  if (next_dest && next_length && tcp_[peer])
    engine_.expectWrite(id_, slotOffset(peer, (consumed_[peer] + 1 + depth_) % ring_) + sizeof(MsgHeader),
                        next_dest, next_length);
  uint64_t n = ++consumed_[peer];
  // A newer value may overwrite this staging word while an older ack is still being sent;
  // the count only grows, so the sender reads the same or a newer count.
  __atomic_store_n(&out_acks_[peer], n, __ATOMIC_RELAXED);
  // Over tcp the ack always wakes the sender (its arrival order is not observable here).
  // Nobody waits for the credit's completion: no acknowledgement of its own (no_ack).
  engine_.submit({TransferRequest{Opcode::kWrite, &out_acks_[peer], peer, id_, ackOffset(rank_), 8, tcp_[peer] != 0,
                                  true}});
  if (tcp_[peer]) return;
  // The sender can only be blocked on this credit if it has filled every data slot, i.e. if
  // message n - 1 + depth is already here; only then is a wake-up worth its syscall.
  // NOTES: the ack store above (shm: synchronous) is ordered before this load.
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  uint64_t last = n - 1 + depth_;
  if (arrived(peer, last)) engine_.notify(peer);
}

}  // namespace moelink::collective
