// libFuzzer target: arbitrary bytes on a live tcp transport's port (see tcp_wire_harness.h).
// Built by scripts/fuzz.sh with clang (-fsanitize=fuzzer,address); an input that crashes it
// goes into tests/fuzz/regressions/, which tcp_wire_replay_test.cpp replays in every build.
#include <cstddef>
#include <cstdint>

#include "tcp_wire_harness.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static moelink::fuzz::TcpWireHarness* harness = new moelink::fuzz::TcpWireHarness();  // one transport for the run
  harness->feed(data, size);
  return 0;
}
