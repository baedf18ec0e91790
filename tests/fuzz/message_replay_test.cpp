// Replays the message fuzzer's seed corpus and every input it has crashed on
// (tests/fuzz/message_corpus, tests/fuzz/message_regressions) in every build: none may crash
// the readers of what peers write (message_harness.h), under the sanitizers where the build has
// them.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include "message_harness.h"

TEST(MessageFuzz, ReplaysCorpusAndRegressions) {
  std::vector<std::filesystem::path> files;
  for (const char* dir : {"message_corpus", "message_regressions"}) {
    const std::filesystem::path d = std::filesystem::path(MOELINK_FUZZ_DIR) / dir;
    if (!std::filesystem::exists(d)) continue;
    for (const auto& e : std::filesystem::directory_iterator(d))
      if (e.is_regular_file() && e.path().filename().string()[0] != '.') files.push_back(e.path());
  }
  ASSERT_GE(files.size(), 10u) << "the seed corpus is missing from " << MOELINK_FUZZ_DIR;
  for (const auto& f : files) {
    SCOPED_TRACE(f.string());
    std::ifstream in(f, std::ios::binary);
    const std::vector<uint8_t> bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    moelink::fuzz::MessageHarness().feed(bytes.data(), bytes.size());
  }
}
