// Checks of the headers peers write into this rank's mailboxes (mailbox.h): one function per
// message type, applied to the mailbox's private copy of a header (Mailbox::peek) before any
// byte the message carries is used. Every field a peer controls is compared with what this
// rank posted or allocated; a violation comes back as text naming the peer and the field, and
// the caller fails its op with it. Nothing here touches memory.
//
// The mailbox itself checks what it can without knowing the op (Mailbox::payload: a payload
// in a slot fits the slot); these add what the op expects.
#pragma once

#include <cstdint>
#include <string>

#include "moelink/collective/dtype.h"
#include "moelink/collective/mailbox.h"
#include "moelink/collective/operation.h"

namespace moelink::collective {

// The op-level fields every collective header carries, the worker's mailbox messages and the
// CUDA exchange's GPU headers (exchange.h) alike.
struct OpFields {
  uint8_t kind = 0;  // OpKind
  uint64_t seq = 0;
  int32_t root = -1;
  uint8_t dtype = 0;   // DType
  uint8_t redop = 0;   // ReduceOp
  uint64_t op_bytes = 0;  // 0: not compared
};

// "" when `theirs` (from `peer`) describes the op `mine` describes, else the first difference
// in words that name both sides ("allreduce #17: rank 2 sent 4096 bytes, this rank expects 8192").
std::string describeOpMismatch(const OpFields& mine, const OpFields& theirs, int peer);

// A collective's message: what this rank expects of the piece it is about to consume.
struct ExpectedPiece {
  OpFields op;
  uint64_t pair_bytes = 0;  // everything the peer sends this rank in the op
  uint64_t bytes = 0;       // this piece
};

// "" when `h` is the piece `want` describes. An ABORT, a newer op and every field that differs
// are reported; the piece's size is then exactly what this rank's buffers were laid out for.
std::string checkCollectivePiece(const MsgHeader& h, int peer, const ExpectedPiece& want);

// Point-to-point: one send in the course of being received (by a matched recv, or into the
// stash while no recv matches it).
struct IncomingSend {
  bool started = false;  // its first message has been taken
  int tag = 0;
  uint64_t total = 0;  // its size, as its first message says
  uint64_t got = 0;    // payload bytes taken so far
};

// "" when `h` can be the next message of `s` from `peer`: a send message (kind, flags), the
// first one first, the same tag and size throughout, a payload no larger than a slot
// (`chunk`) that stays within the size, and LAST exactly on the message that completes it.
// `prefix` names the op in the text ("recv from rank 1 (tag 0)").
std::string checkSendPiece(const MsgHeader& h, int peer, const IncomingSend& s, uint64_t chunk,
                           const std::string& prefix);

}  // namespace moelink::collective
