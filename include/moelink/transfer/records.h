// The engine's records in the group's store, and the one way each is read.
//
// A record comes from another process (a peer, or anything that can reach the store, which
// PyTorch binds on every interface), so each is parsed strictly and checked against what the
// reader asked for before a field of it is used: a malformed record raises moelink::Error
// naming the record and the field, never a crash or a mapping of the wrong size.
//
//   engine/group                      the group's size, as its first rank 0 created it
//   engine/refused                    why a rank cannot take part (a world size that differs):
//                                     the ranks waiting for it fail at once with this text
//   engine/claim/<rank>.<inc>         the process that won incarnation <inc> of the rank
//   engine/secret                     the group's secret (tcp handshakes)
//   engine/incarnation/<rank>         how many processes have held the rank (a counter)
//   engine/peer/<rank>.<inc>          endpoint: host id, tcp address, pid, start time, pid
//                                     namespace, cross-memory probe address (one per line)
//   engine/seg/<rank>.<inc>/<id>      segment descriptor (SegmentDesc::serialize)
#pragma once

#include <cstdint>
#include <string>

#include "moelink/transfer/transport.h"
#include "moelink/transfer/types.h"

namespace moelink::transfer {

inline constexpr const char* kGroupKey = "engine/group";
inline constexpr const char* kRefusedKey = "engine/refused";

// All of `text` as a decimal number below 2^64 (no sign, no spaces, no other characters), or
// throws naming `what`.
uint64_t parseCount(const std::string& text, const std::string& what);

std::string endpointRecord(const PeerInfo& me);
// The endpoint record of `rank`: every field present and well formed (an address "a.b.c.d:port"
// with a port in 1..65535, a positive pid).
PeerInfo parseEndpointRecord(const std::string& rec, int rank);

// The descriptor published for segment `id` of `rank`: it must name that rank and segment,
// and a shared-memory name must be one of moelink's ("/moelink.<...>", no other '/').
SegmentDesc parseSegmentRecord(const std::string& rec, int rank, SegmentId id);

}  // namespace moelink::transfer
