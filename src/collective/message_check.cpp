#include "moelink/collective/message_check.h"

#include "moelink/common/error.h"

namespace moelink::collective {

namespace {

const char* kindName(uint8_t k) { return opKindName(static_cast<OpKind>(k)); }

// An op's size as the headers carry it, "in pieces" where marked (kOpBytesInPieces).
std::string opBytesText(uint64_t b, const char* unit) {
  return str(b & ~kOpBytesInPieces, unit, b & kOpBytesInPieces ? " in pieces" : "");
}

}  // namespace

std::string describeOpMismatch(const OpFields& mine, const OpFields& theirs, int peer) {
  // Runs for every message: an agreeing header only compares (the text is built on a difference).
  auto who = [&] { return str(kindName(mine.kind), " #", mine.seq, ": rank ", peer); };
  if (theirs.seq > mine.seq)
    return str(who(), " is already at op #", theirs.seq, " (", kindName(theirs.kind),
               "); the ranks called different sequences of collectives");
  if (theirs.kind != mine.kind)
    return str(who(), " called ", kindName(theirs.kind), ", this rank called ", kindName(mine.kind));
  if (theirs.root != mine.root) return str(who(), " used root ", theirs.root, ", this rank root ", mine.root);
  if (theirs.dtype != mine.dtype)
    return str(who(), " sent dtype ", dtypeName(static_cast<DType>(theirs.dtype)), ", this rank expects ",
               dtypeName(static_cast<DType>(mine.dtype)));
  if (theirs.redop != mine.redop)
    return str(who(), " reduces with ", reduceOpName(static_cast<ReduceOp>(theirs.redop)), ", this rank with ",
               reduceOpName(static_cast<ReduceOp>(mine.redop)));
  if (theirs.op_bytes && mine.op_bytes && theirs.op_bytes != mine.op_bytes)
    return str(who(), " sent ", opBytesText(theirs.op_bytes, " bytes"), ", this rank expects ",
               opBytesText(mine.op_bytes, ""));
  return "";
}

std::string checkCollectivePiece(const MsgHeader& h, int peer, const ExpectedPiece& want) {
  const OpFields theirs{h.kind, h.op_seq, h.root, h.dtype, h.redop, h.op_bytes};
  auto who = [&] { return str(kindName(want.op.kind), " #", want.op.seq, ": rank ", peer); };
  if (h.op_seq > want.op.seq) return describeOpMismatch(want.op, theirs, peer);
  if (h.flags & kAbort) return str(who(), " aborted this op (it failed there)");
  if (std::string why = describeOpMismatch(want.op, theirs, peer); !why.empty()) return why;
  if (h.pair_bytes != want.pair_bytes)
    return str(who(), " sent ", h.pair_bytes, " bytes to this rank, this rank expects ", want.pair_bytes);
  if (h.bytes != want.bytes) return str(who(), " sent a ", h.bytes, "-byte piece, this rank expects ", want.bytes);
  if (h.sender != peer) return str(who(), " sent a message that names rank ", h.sender, " as its sender");
  return "";
}

std::string checkSendPiece(const MsgHeader& h, int peer, const IncomingSend& s, uint64_t chunk,
                           const std::string& prefix) {
  auto bad = [&](const auto&... what) { return str(prefix, ": rank ", peer, " sent a malformed message: ", what...); };
  if (h.kind != static_cast<uint8_t>(OpKind::kSend)) return bad("kind ", static_cast<int>(h.kind), ", not a send");
  if (h.sender != peer) return bad("sender field names rank ", h.sender);
  if (h.flags & ~(kFirst | kLast)) return bad("flags 0x", std::hex, static_cast<int>(h.flags));
  const bool first = h.flags & kFirst;
  if (first == s.started) return bad(first ? "a FIRST flag in the middle of a send" : "no FIRST flag on a new send");
  if (s.started && (h.tag != s.tag || h.pair_bytes != s.total))
    return bad("tag ", h.tag, " and size ", h.pair_bytes, " in the middle of a send of tag ", s.tag, " and size ",
               s.total);
  if (h.bytes > chunk) return bad("a ", h.bytes, "-byte piece, larger than a mailbox slot (", chunk, " bytes)");
  const uint64_t got = s.started ? s.got : 0;
  if (h.bytes > h.pair_bytes - got || got > h.pair_bytes)
    return bad("a ", h.bytes, "-byte piece after ", got, " of ", h.pair_bytes, " bytes");
  const bool completes = got + h.bytes == h.pair_bytes;
  if (completes != static_cast<bool>(h.flags & kLast))
    return bad(completes ? "no LAST flag on the piece that completes the send" : "a LAST flag before the send is complete",
               " (", got + h.bytes, " of ", h.pair_bytes, " bytes)");
  return "";
}

}  // namespace moelink::collective
