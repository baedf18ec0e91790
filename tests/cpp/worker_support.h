// Ranks of a collective worker as threads of one process (test_support.h), for the tests of
// the worker and of what runs over it.
#pragma once

#include <future>
#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "moelink/collective/worker.h"
#include "moelink/transfer/metadata_store.h"
#include "moelink/transfer/transfer_engine.h"

namespace moelink::testing {

struct Rank {
  std::unique_ptr<transfer::TransferEngine> engine;
  std::unique_ptr<collective::CollectiveWorker> worker;
};

// transport "pull": shm, with every piece of a pullable op read by its receiver from the
// sender's memory (the ranks are threads of one process, which may read its own memory).
inline Rank makeRank(std::shared_ptr<transfer::InProcessStore> store, int rank, int world,
                     const std::string& transport, uint64_t chunk = 4096) {
  using namespace std::chrono;
  transfer::EngineOptions o;
  o.rank = rank;
  o.world_size = world;
  o.transport = transport == "pull" ? "shm" : transport;
  o.cross_memory_reads = transport == "pull";
  o.timeout = seconds(30);
  Rank r;
  r.engine = std::make_unique<transfer::TransferEngine>(store, o);
  collective::WorkerOptions w;
  w.chunk_bytes = chunk;  // small, so that tests cross many chunks
  w.allreduce_small_bytes = 1024;
  w.pull_min_bytes = transport == "pull" ? 1 : UINT64_MAX;
  w.pull_chunk_bytes = 5000;  // all_to_all pieces of a pulling pair: larger than a slot, and several
  w.timeout = seconds(30);
  r.worker = std::make_unique<collective::CollectiveWorker>(*r.engine, *store, w);
  if (transport == "pull") {
    for (int p = 0; p < world; ++p) {
      if (p == rank) continue;
      EXPECT_TRUE(r.worker->peerReadsDirectly(p)) << "rank " << p << " cannot read rank " << rank;
    }
  }
  return r;
}

inline std::string run(collective::CollectiveWorker& w, collective::OpSpec op,
                       std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  std::promise<std::string> p;
  auto f = p.get_future();
  w.submit(std::move(op), [&](const std::string& e) { p.set_value(e); }, timeout);
  return f.get();
}

}  // namespace moelink::testing
