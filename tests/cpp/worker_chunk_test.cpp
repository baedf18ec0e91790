// The mailbox slot size (WorkerOptions::chunk_bytes, MOELINK_CHUNK_BYTES): chosen by the group
// where unset, the same on every rank, and taken from the group by a process that joins it.
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "moelink/collective/worker.h"
#include "moelink/common/error.h"
#include "moelink/transfer/metadata_store.h"
#include "moelink/transfer/transfer_engine.h"

using namespace moelink;
using namespace std::chrono;

namespace {

struct Made {
  std::unique_ptr<transfer::TransferEngine> engine;
  std::unique_ptr<collective::CollectiveWorker> worker;
  std::string error;  // what the worker's construction threw
};

transfer::EngineOptions engineOptions(int rank, int world, const std::string& transport, bool extension) {
  transfer::EngineOptions o;
  o.rank = rank;
  o.world_size = world;
  o.transport = transport;
  o.extension = extension;
  o.timeout = seconds(10);
  return o;
}

collective::WorkerOptions workerOptions(uint64_t chunk, int initial, bool extension) {
  collective::WorkerOptions w;
  w.chunk_bytes = chunk;
  w.initial_size = initial;
  w.extension = extension;
  w.timeout = seconds(10);
  return w;
}

// Ranks 0..n-1 of a new group, each with its own slot setting (0: unset), made at once.
std::vector<Made> makeGroup(const std::shared_ptr<transfer::InProcessStore>& store, const std::string& transport,
                            const std::vector<uint64_t>& chunks) {
  const int n = static_cast<int>(chunks.size());
  std::vector<Made> made(n);
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      made[r].engine = std::make_unique<transfer::TransferEngine>(store, engineOptions(r, n, transport, false));
      try {
        made[r].worker = std::make_unique<collective::CollectiveWorker>(*made[r].engine, *store,
                                                                         workerOptions(chunks[r], 0, false));
      } catch (const Error& e) {
        made[r].error = e.what();
      }
    });
  for (auto& t : ts) t.join();
  return made;
}

// Rank 1 of a tcp group of up to 2 whose rank 0 is running, joining (extension) with `chunk` as
// its own setting: the joiner's error ("" when it joined).
std::string joinError(const std::shared_ptr<transfer::InProcessStore>& store, uint64_t chunk) {
  auto joiner = std::make_unique<transfer::TransferEngine>(store, engineOptions(1, 2, "tcp", true));
  try {
    collective::CollectiveWorker w(*joiner, *store, workerOptions(chunk, 0, true));
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(WorkerChunk, UnsetTheGroupChoosesByItsTransport) {
  for (const std::string transport : {"shm", "tcp"}) {
    auto store = std::make_shared<transfer::InProcessStore>();
    auto made = makeGroup(store, transport, {0, 0});
    for (auto& m : made) {
      ASSERT_EQ(m.error, "") << transport;
      EXPECT_EQ(m.worker->context().chunk, transport == "tcp" ? 2u << 20 : 512u << 10) << transport;
    }
  }
}

TEST(WorkerChunk, RanksThatDifferFailTheGroupOnEveryRank) {
  auto store = std::make_shared<transfer::InProcessStore>();
  auto made = makeGroup(store, "shm", {4096, 8192, 4096});
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(made[r].worker, nullptr) << r;
    EXPECT_NE(made[r].error.find("MOELINK_CHUNK_BYTES must be the same on every rank"), std::string::npos)
        << r << ": " << made[r].error;
  }
  // Equal settings, rounded up to whole cache lines alike, form the group.
  auto store2 = std::make_shared<transfer::InProcessStore>();
  auto ok = makeGroup(store2, "shm", {1000, 1024});
  for (auto& m : ok) {
    ASSERT_EQ(m.error, "");
    EXPECT_EQ(m.worker->context().chunk, 1024u);
  }
}

TEST(WorkerChunk, AJoiningProcessWhoseSettingDiffersFromTheGroupsIsRefused) {
  auto store = std::make_shared<transfer::InProcessStore>();
  // A group of up to 2 ranks that starts with rank 0 alone, over tcp: slots of 2 MiB.
  auto founder = std::make_unique<transfer::TransferEngine>(store, engineOptions(0, 2, "tcp", false));
  auto worker = std::make_unique<collective::CollectiveWorker>(*founder, *store, workerOptions(0, 1, false));
  EXPECT_EQ(worker->context().chunk, 2u << 20);
  const std::string error = joinError(store, 4096);
  EXPECT_NE(error.find("MOELINK_CHUNK_BYTES is 4096 in this process, but the group it joins uses slots of 2097152"),
            std::string::npos)
      << error;
}

TEST(WorkerChunk, AJoiningProcessTakesOnlyASlotSizeThatAGroupMakes) {
  // The group's record sizes the joiner's segments: a size no group makes is refused, not allocated.
  for (const char* forged : {"100", "0", "2199023255552"}) {
    auto store = std::make_shared<transfer::InProcessStore>();
    auto founder = std::make_unique<transfer::TransferEngine>(store, engineOptions(0, 2, "tcp", false));
    auto worker = std::make_unique<collective::CollectiveWorker>(*founder, *store, workerOptions(0, 1, false));
    store->set("worker/chunk_bytes", forged);
    const std::string error = joinError(store, 0);
    EXPECT_NE(error.find("is not one a group makes"), std::string::npos) << forged << ": " << error;
  }
}
