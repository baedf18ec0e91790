// Replays the tcp wire fuzzer's seed corpus and every input it has crashed on
// (tests/fuzz/corpus, tests/fuzz/regressions) against a live transport, in every build: none
// may crash it, an unauthenticated one may not change registered memory, and the transport
// still applies a valid write afterwards.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "moelink/transfer/tcp/transport.h"
#include "tcp_wire_harness.h"

namespace {

std::vector<std::filesystem::path> inputs() {
  std::vector<std::filesystem::path> files;
  for (const char* dir : {"corpus", "regressions"}) {
    const std::filesystem::path d = std::filesystem::path(MOELINK_FUZZ_DIR) / dir;
    if (!std::filesystem::exists(d)) continue;
    for (const auto& e : std::filesystem::directory_iterator(d))
      if (e.is_regular_file() && e.path().filename().string()[0] != '.') files.push_back(e.path());
  }
  return files;
}

std::vector<uint8_t> read(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

TEST(TcpWire, ReplaysCorpusAndRegressions) {
  moelink::fuzz::TcpWireHarness h;
  const auto files = inputs();
  ASSERT_GE(files.size(), 10u) << "the seed corpus is missing from " << MOELINK_FUZZ_DIR;
  for (const auto& f : files) {
    SCOPED_TRACE(f.string());
    const auto bytes = read(f);
    h.feed(bytes.data(), bytes.size());
  }
  // Still serving: an authenticated, in-bounds write lands.
  using namespace moelink::transfer::tcp;
  wire::FrameHeader w{};
  w.type = wire::kWrite;
  w.request_id = 1;
  w.segment = moelink::fuzz::TcpWireHarness::kSegment;
  w.offset = 100;
  w.length = 4;
  std::vector<uint8_t> in{1};
  in.insert(in.end(), reinterpret_cast<const uint8_t*>(&w), reinterpret_cast<const uint8_t*>(&w) + sizeof w);
  for (char c : std::string("moel")) in.push_back(static_cast<uint8_t>(c));
  const auto after = h.feed(in.data(), in.size());
  EXPECT_EQ(std::string(after.begin() + 100, after.begin() + 104), "moel");
}
