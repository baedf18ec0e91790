// Mailbox: per-peer FIFO message slots in one registered segment per rank.
//
// Every rank owns one segment laid out as
//   signals[src][depth+1] uint64, written by src: the sequence number of the message in
//                         that slot (a message is there when signal == its number)
//   acks[dst]             uint64, written by dst: how many of my messages dst consumed
//   slots[src][depth+1]   MsgHeader (64 B) + payload (chunk bytes), written by src
// A sender writes payload and header, then the 8-byte signal (the engine applies them in
// order, the signal as a release store). The receiver acquires the signal, reads, and
// acks by writing its consumed count into the sender's acks[receiver]. `depth` slots per
// pair make the pipeline: a sender may be `depth` messages ahead of its receiver, so that
// chunk k+1 is copied in while chunk k is being consumed. Data may fill `depth` slots; the
// one beyond is for a control message (ABORT), so that a sender whose op failed can put it
// behind its data even when the receiver has not consumed any of it yet.
//
// Pulled messages (same host, where the receiver can read the sender's memory: see
// transfer/shm/process_read.h): the slot carries the header only, with the address of the
// payload in the sender's memory, and the receiver copies it from there straight to where
// it ends up. One copy instead of two; the price is that the sender's memory must hold the
// payload until the receiver has read it. Each such message has a claim word,
//   claims[src][depth+1]  uint64, in the receiver's segment:
//                         POSTED(n) set by the sender before the signal of message n,
//                         DONE(n) by the receiver after its read (compare-and-swap),
//                         REVOKED(n) by a sender that gives up (compare-and-swap).
// A sender's pulled send completes once the word says DONE or the receiver has acked the
// message; a failing sender revokes what is not done and can return at once: a receiver
// whose compare-and-swap then fails has read memory that may have changed, and fails its op.
//   pull_ok[dst]          uint64, in the sender's segment, written by dst when it opens the
//                         sender's mailbox: 2 when dst can read the sender's memory, 1 when
//                         not, 0 until dst has said (cleared when a new process takes dst's
//                         rank). Sender and receiver thus agree on which pairs pull.
//
// Everything in a segment that peers write is untrusted input: a header is read once, into a
// private copy (peek), and used only from there; a payload in a slot must fit the slot, a
// pulled one lands only where the caller said and in the length it said (payload); a credit
// may not count more messages than were sent (creditFault). The fields that depend on the op
// are checked by the consumer (message_check.h) before it uses the payload.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "moelink/collective/dtype.h"
#include "moelink/transfer/transfer_engine.h"

namespace moelink::collective {

enum MsgFlags : uint8_t { kFirst = 1, kLast = 2, kAbort = 4, kPull = 8 };

// Carried by every message so that a receiver can check it against its own view of the op.
struct alignas(64) MsgHeader {
  uint8_t kind = 0;   // OpKind
  uint8_t dtype = 0;  // DType
  uint8_t redop = 0;  // ReduceOp
  uint8_t flags = 0;  // MsgFlags
  int32_t root = -1;
  uint64_t op_seq = 0;      // collective: the group's op number; p2p: the pair's send number
  uint64_t op_bytes = 0;    // the sender's op-level size in bytes (0: not compared)
  uint64_t pair_bytes = 0;  // everything this sender sends this receiver in the op
  uint64_t bytes = 0;       // this message's payload
  int32_t tag = 0;
  int32_t sender = -1;
  uint64_t epoch = 0;  // the sender's membership epoch (membership.h)
  uint64_t pull_addr = 0;  // kPull: where the payload is in the sender's memory
};
static_assert(sizeof(MsgHeader) == 64, "MsgHeader is one cache line");

class Mailbox {
 public:
  Mailbox(transfer::TransferEngine& engine, transfer::SegmentId id, uint64_t chunk_bytes,
          int depth);
  // Opens every peer's mailbox segment (all ranks must have constructed theirs), or those
  // of the ranks in `only` (per rank: 1 = open).
  void open(const std::vector<char>& only = {});
  // A new process has taken `peer`'s rank: forgets the pair's messages and credits in both
  // directions and opens its segment (the engine must have forgotten the old one).
  void resetPeer(int peer);
  // `peer`'s process is gone or about to be forgotten by the engine: completes the pulled
  // sends to it and stops using its mapping.
  void dropPeer(int peer);

  uint64_t chunkBytes() const { return chunk_; }
  // The payload bytes of a slot made for `chunk_bytes` (whole cache lines): what chunkBytes()
  // returns, and what ranks compare to agree on their layout.
  static uint64_t slotChunk(uint64_t chunk_bytes) { return (chunk_bytes + 63) / 64 * 64; }
  uint64_t depth() const { return depth_; }
  const std::string& transportTo(int peer) const { return transports_[peer]; }

  bool canSend(int peer) const;
  // Why `peer`'s credit for this rank's messages cannot be right (it acknowledged more
  // messages than were sent), or "". Such a pair sends nothing more: canSend stays false.
  std::string creditFault(int peer) const;
  // Whether a control message (an ABORT) can go: it may use the pair's spare slot, so that a
  // failing sender can always say so at once, even with every data slot full.
  bool canSendControl(int peer) const;
  // Sends one message (header.bytes payload bytes from `payload`). canSend must be true. The
  // batch completes once `payload` is no longer read: over tcp once the bytes are handed to the
  // network (no acknowledgement: the credits pace the sender, and a refused write breaks the
  // connection), over shm once copied.
  transfer::BatchPtr send(int peer, const MsgHeader& header, const void* payload);
  // Whether `peer` reads this rank's messages from its memory (sendPull) rather than out of
  // a slot.
  bool canPull(int peer) const;
  // Whether `peer` has said that it can read this rank's memory (thread-safe).
  bool peerReadsDirectly(int peer) const;
  // Whether `peer` has said either way (see pull_ok above).
  bool peerHasSaid(int peer) const;
  // Whether this rank reads `peer`'s pulled messages (what it told `peer`).
  bool readsFrom(int peer) const { return reads_from_[peer] != 0; }
  // Sends one message whose payload `peer` reads from `payload` itself (canPull must be
  // true, and canSend). The batch completes once the peer has read it, or once revoked.
  transfer::BatchPtr sendPull(int peer, const MsgHeader& header, const void* payload);
  // Completes the pulled sends that their receivers have read.
  void pollPulls();
  // Withdraws the pulled sends not yet read (to `peer`, or to every peer when -1) and
  // completes them: their memory may change from now on.
  void revokePulls(int peer = -1);

  // The next message from `peer` if it has arrived, else nullptr: this rank's copy of its
  // header, taken once when it is first seen (the sender cannot change it afterwards), valid
  // until release().
  const MsgHeader* peek(int peer);
  // Its payload (header.bytes bytes): in the slot, or where release() asked it to land. A
  // pulled message is read from the sender's memory into `landing` when given (at most
  // `landing_bytes`), else into the slot. nullptr, with the reason in *error naming the peer,
  // when the message claims more than the slot (or the landing) holds or the read fails.
  const char* payload(int peer, std::string* error, char* landing = nullptr, uint64_t landing_bytes = 0);
  // Frees the peeked slot and returns its credit to the sender. The credit lets the
  // sender send the message `depth` places after this one; when
  // `next_dest` is given and the transport receives into memory itself (tcp), that
  // message's payload (at most `next_length` bytes) is received straight into
  // `next_dest`, which saves the copy out of the slot. The request is in place before the
  // credit leaves, so the sender cannot overtake it.
  void release(int peer, void* next_dest = nullptr, uint64_t next_length = 0);
  // Like release()'s request, for the message `ahead` places after the current head
  // (0: the head itself), which may already be arriving: if the transport has started on
  // it, it simply lands in its slot; one that has arrived is left there. ahead < depth.
  void landAhead(int peer, uint64_t ahead, void* dest, uint64_t length);
  // Drops every landing request (after a failed op: later messages go to the slots). A
  // message whose payload a request has already received elsewhere, not yet consumed, is
  // put back in its slot once it has arrived whole (waiting up to `wait` for it), so that
  // whatever consumes it reads it there and not from the failed op's memory; one that does not
  // arrive in time (its sender alive) is lost: payload() refuses it, naming why.
  void clearLandings(std::chrono::milliseconds wait = std::chrono::milliseconds(2000));

  // Where message `seq` from `src` goes in this rank's segment: its header (the payload follows
  // it) and its signal word. For tools that write a mailbox by hand (tests, fuzzers).
  uint64_t headerOffsetOf(int src, uint64_t seq) const { return slotOffset(src, seq % ring_); }
  uint64_t signalOffsetOf(int src, uint64_t seq) const { return signalOffset(src, seq % ring_); }

 private:
  uint64_t signalOffset(int src, uint64_t slot) const { return (src * ring_ + slot) * 8; }
  // Whether message `msg` from `src` is in its slot: its signal (written last, a release store) says so.
  bool arrived(int src, uint64_t msg) const;
  uint64_t ackOffset(int dst) const { return acks_off_ + dst * 8ull; }
  uint64_t claimOffset(int src, uint64_t slot) const { return claims_off_ + (src * ring_ + slot) * 8; }
  uint64_t pullOkOffset(int dst) const { return pull_ok_off_ + dst * 8ull; }
  // Messages sent to `peer` that it has not consumed yet.
  uint64_t unacked(int peer) const;
  // Resolves the head message's tcp landing (if any) without reading a pulled payload.
  const char* slotPayload(int peer);
  void publishPullOk(int peer);
  uint64_t slotOffset(int src, uint64_t slot) const {
    return slots_off_ + (src * ring_ + slot) * slot_bytes_;
  }

  transfer::TransferEngine& engine_;
  transfer::SegmentId id_;
  int rank_, world_;
  uint64_t chunk_;
  uint64_t depth_;
  uint64_t ring_;  // slots per pair: depth_ for data, one more for a control message
  uint64_t acks_off_, claims_off_, pull_ok_off_, slots_off_, slot_bytes_, total_;
  char* base_ = nullptr;
  struct PendingPull {
    uint64_t seq;
    transfer::BatchPtr batch;
  };
  std::vector<std::deque<PendingPull>> pulls_;  // [peer], in send order
  std::vector<char*> peer_base_;                 // [peer]: its mapped segment (shm), else nullptr
  std::vector<char> reads_from_;                 // [peer]: what this rank told it (pull_ok)
  std::vector<uint64_t> sent_;      // messages sent to each peer
  std::vector<uint64_t> consumed_;  // messages consumed from each peer
  std::vector<MsgHeader> out_headers_;  // [peer][slot]: staged until the write completes
  std::vector<uint64_t> out_signals_;   // [peer][slot]
  std::vector<uint64_t> out_acks_;      // [peer]
  std::vector<const char*> head_payload_;  // [peer]: resolved payload of the head message
  std::vector<MsgHeader> head_;            // [peer]: the head message's header, as first read
  std::vector<char> head_valid_;           // [peer]: head_ holds the current head
  std::vector<std::vector<uint64_t>> lost_payload_;  // [peer]: messages whose data clearLandings lost
  mutable std::vector<char> credit_fault_;  // [peer]: its credit exceeded what was sent
  std::vector<std::string> transports_;
  std::vector<char> tcp_;  // [peer]: reached over tcp (receive redirection applies, acks always wake)
};

}  // namespace moelink::collective
