// libFuzzer target: arbitrary messages in a rank's mailboxes, board and handshake (see
// message_harness.h). Built by scripts/fuzz.sh with clang (-fsanitize=fuzzer,address); an
// input that crashes it goes into tests/fuzz/regressions/messages/, which
// message_replay_test.cpp replays in every build.
#include <cstddef>
#include <cstdint>

#include "message_harness.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  moelink::fuzz::MessageHarness().feed(data, size);
  return 0;
}
