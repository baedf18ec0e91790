// Feeds arbitrary bytes to a live tcp transport, as a stray or hostile client would: the
// fuzz target (tcp_wire_fuzz.cpp, libFuzzer) and the regression test that replays the seed
// corpus and every input the fuzzer ever crashed on (tcp_wire_replay_test.cpp) share it.
//
// Two transports (rank 0), each with one registered segment. An input whose first byte is odd
// goes to the first after a valid handshake (the group's secret), so that the frame parser
// behind it is reached; an even first byte sends the input as it is to the second, which no
// connection ever authenticates to. Checked on every input: the process survives (ASan guards
// every byte outside the segments), and the second transport's segment never changes.
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

  // Sends `data` over a fresh connection, ends it, and returns the authenticated transport's
  // segment as it is then (its pattern is restored before the next input). Ends: the input is
  // followed by bytes the transport rejects, so that it closes the connection itself once it has
  // applied every frame before them; where those bytes land inside a payload instead, this side
  // resets the connection after a short wait. Aborts, with a message, when a check fails.
  std::vector<uint8_t> feed(const uint8_t* data, size_t size);

  // A segment's bytes before any input.
  static std::vector<uint8_t> pattern();

 private:
  struct Target;
  std::unique_ptr<Target> auth_, open_;
  uint64_t sessions_ = 0;
};

}  // namespace moelink::fuzz
