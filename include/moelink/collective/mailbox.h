// Mailbox: per-peer FIFO message slots in one registered segment per rank.
//
// Every rank owns one segment laid out as
//   signals[src][depth]   uint64, written by src: the sequence number of the message in
//                         that slot (a message is there when signal == its number)
//   acks[dst]             uint64, written by dst: how many of my messages dst consumed
//   slots[src][depth]     MsgHeader (64 B) + payload (chunk bytes), written by src
// A sender writes payload and header, then the 8-byte signal (the engine applies them in
// order, the signal as a release store). The receiver acquires the signal, reads, and
// acks by writing its consumed count into the sender's acks[receiver]. `depth` slots per
// pair make the pipeline: a sender may be `depth` messages ahead of its receiver, so that
// chunk k+1 is copied in while chunk k is being consumed.
#pragma once

#include <cstdint>
#include <vector>

#include "moelink/collective/dtype.h"
#include "moelink/transfer/transfer_engine.h"

namespace moelink::collective {

enum MsgFlags : uint8_t { kFirst = 1, kLast = 2, kAbort = 4 };

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

  uint64_t chunkBytes() const { return chunk_; }
  uint64_t depth() const { return depth_; }
  const std::string& transportTo(int peer) const { return transports_[peer]; }

  bool canSend(int peer) const;
  // Sends one message (header.bytes payload bytes from `payload`). canSend must be true.
  transfer::BatchPtr send(int peer, const MsgHeader& header, const void* payload);

  // The next message from `peer` if it has arrived, else nullptr.
  const MsgHeader* peek(int peer) const;
  // Its payload: in the slot, or where release() asked it to land.
  const char* payload(int peer);
  // Frees the peeked slot and returns its credit to the sender. The credit lets the
  // sender send the message `depth` places after this one, into the same slot; when
  // `next_dest` is given and the transport receives into memory itself (tcp), that
  // message's payload (at most `next_length` bytes) is received straight into
  // `next_dest`, which saves the copy out of the slot. The request is in place before the
  // credit leaves, so the sender cannot overtake it.
  void release(int peer, void* next_dest = nullptr, uint64_t next_length = 0);
  // Like release()'s request, for the message `ahead` places after the current head
  // (0: the head itself), which may already be arriving: if the transport has started on
  // it, it simply lands in its slot. ahead < depth.
  void landAhead(int peer, uint64_t ahead, void* dest, uint64_t length);
  // Drops every landing request (after a failed op: later messages go to the slots).
  void clearLandings();

 private:
  uint64_t signalOffset(int src, uint64_t slot) const { return (src * depth_ + slot) * 8; }
  uint64_t ackOffset(int dst) const { return acks_off_ + dst * 8ull; }
  uint64_t slotOffset(int src, uint64_t slot) const {
    return slots_off_ + (src * depth_ + slot) * slot_bytes_;
  }

  transfer::TransferEngine& engine_;
  transfer::SegmentId id_;
  int rank_, world_;
  uint64_t chunk_;
  uint64_t depth_;
  uint64_t acks_off_, slots_off_, slot_bytes_;
  char* base_ = nullptr;
  std::vector<uint64_t> sent_;      // messages sent to each peer
  std::vector<uint64_t> consumed_;  // messages consumed from each peer
  std::vector<MsgHeader> out_headers_;  // [peer][slot]: staged until the write completes
  std::vector<uint64_t> out_signals_;   // [peer][slot]
  std::vector<uint64_t> out_acks_;      // [peer]
  std::vector<const char*> head_payload_;  // [peer]: resolved payload of the head message
  std::vector<std::string> transports_;
  std::vector<char> tcp_;  // [peer]: reached over tcp (receive redirection applies, acks always wake)
};

}  // namespace moelink::collective
