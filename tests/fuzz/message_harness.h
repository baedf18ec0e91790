// Feeds arbitrary messages to the code that reads what peers write into a rank's memory: the
// fuzz target (message_fuzz.cpp, libFuzzer) and the regression test that replays its seed
// corpus and every input it ever crashed on (message_replay_test.cpp) share it.
//
// The first byte of an input picks the reader:
//   0  point-to-point: recvs posted into exact-size heap buffers, then a stream of messages
//      written into the p2p mailbox's slots as rank 1 would, taken by the real P2PReceiver;
//   1  collective: a step's expected pieces (some received in place, into exact-size landing
//      buffers), the messages taken as the worker takes them (Mailbox::peek,
//      checkCollectivePiece, Mailbox::payload) and copied into exact-size buffers;
//   2  membership: a board slot decoded by decodeBoardMessage for a group of 1-64 ranks;
//   3  tcp handshake: wire::checkHello on the bytes.
// Messages are written through the engine into a real mailbox segment (rank 0 of a group of 2
// whose rank 1 never exists), header, payload and signal, each at the offset the mailbox reads.
// Checked on every input: ASan guards every buffer a payload may land in, every payload pointer
// the mailbox hands out lies inside the slot or landing it claims, and a recv completed without
// an error received exactly what was sent to it. Aborts, with a message, when a check fails.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moelink::fuzz {

class MessageHarness {
 public:
  static constexpr uint64_t kChunk = 1536;  // the mailbox segment is then 16 KiB exactly
  static constexpr int kDepth = 4;

  void feed(const uint8_t* data, size_t size);
};

}  // namespace moelink::fuzz
