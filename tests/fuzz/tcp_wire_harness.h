// Feeds arbitrary bytes to a live tcp transport, as a stray or hostile client would: the
// fuzz target (tcp_wire_fuzz.cpp, libFuzzer) and the regression test that replays the seed
// corpus and every input the fuzzer ever crashed on (tcp_wire_replay_test.cpp) share it.
//
// The transport (rank 0) has one registered segment. An input whose first byte is odd is sent
// after a valid handshake (the group's secret), so that the frame parser behind it is
// reached; an even first byte sends the input as it is. Checked on every input: the process
// survives (ASan guards every byte outside the segment), and without the handshake no byte
// of the segment changes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace moelink::transfer {
class LocalSegments;
namespace tcp {
class TcpTransport;
}
}  // namespace moelink::transfer

namespace moelink::fuzz {

class TcpWireHarness {
 public:
  static constexpr uint64_t kSecret = 0x5eC12e7A11ce0001ULL;
  static constexpr uint32_t kSegment = 1;
  static constexpr size_t kSegmentBytes = 4096;

  TcpWireHarness();
  ~TcpWireHarness();

  // Sends `data` over a fresh connection and returns once the transport has closed it (or
  // after a short quiet period), with the segment's bytes as the input left them (the
  // pattern is restored for the next input). Aborts, with a message, when a check fails.
  std::vector<uint8_t> feed(const uint8_t* data, size_t size);

  // The segment's bytes before any input.
  static std::vector<uint8_t> pattern();

 private:
  void restorePattern();

  std::unique_ptr<std::vector<uint8_t>> segment_;
  std::unique_ptr<transfer::LocalSegments> segs_;
  std::unique_ptr<transfer::tcp::TcpTransport> transport_;
  std::string host_;
  int port_ = 0;
};

}  // namespace moelink::fuzz
