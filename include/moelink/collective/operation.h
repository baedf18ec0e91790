// The shape every collective takes inside the worker: an ordered list of steps, each
// sending pieces of memory to some peers and receiving pieces from others, then
// consuming what arrived (copy or reduce). Algorithms (algorithms.h) build these; the
// worker (worker.h) runs them over the mailboxes, pipelined by the mailbox depth.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "moelink/collective/dtype.h"

namespace moelink::collective {

enum class OpKind : uint8_t {
  kBroadcast = 1, kAllreduce, kReduce, kAllgather, kGather, kScatter, kReduceScatter,
  kAlltoall, kBarrier, kSend,
};
const char* opKindName(OpKind k);

struct StepSend {
  int peer;
  const char* data;
  uint64_t bytes;
};

struct StepRecv {
  int peer;
  uint64_t bytes;
  // Where the payload ends up when the consumer only copies it (nullptr otherwise). The
  // worker may have it received there directly (tcp); consume then sees that address.
  char* landing = nullptr;
};

struct Step {
  std::vector<StepSend> sends;
  std::vector<StepRecv> recvs;
  // Called once every recv of this step has arrived, with their payloads in recvs order.
  std::function<void(const std::vector<const char*>&)> consume;
  // When the sends may go: at once, once step `after` (an earlier one) has been consumed
  // (it produces their data), or once this step itself has been consumed (forwarding what
  // it received, as in a pipelined chain).
  enum class SendAfter : uint8_t { kAnytime, kAfterStep, kThisStep };
  SendAfter send_after = SendAfter::kAnytime;
  size_t after = 0;  // kAfterStep: the step whose consumption the sends wait for
  // Consume waits until this step's own sends have completed (it overwrites their source).
  bool consume_after_sends = false;
  // Consume waits until every send of the steps before it has been issued and has completed
  // (the memory they read may be reused after it).
  bool after_all_sends = false;
  // When set, nothing of this step happens before it returns true: its sends wait (their
  // data is still being produced elsewhere, e.g. copied off a GPU), and its receives are
  // neither received in place nor consumed (the memory they land in is still being read
  // elsewhere); until then they wait in the mailbox. Polled by the worker; once true it is
  // not asked again.
  std::function<bool()> gate;
};

// OpSpec::op_bytes of an op that runs in pieces (a size with this bit set): ranks that run one op
// the two ways, whole and in pieces, fail it on the header check instead of mixing messages.
constexpr uint64_t kOpBytesInPieces = 1ull << 63;

struct OpSpec {
  OpKind kind = OpKind::kBarrier;
  DType dtype = DType::kBytes;
  ReduceOp redop = ReduceOp::kNone;
  int root = -1;
  // Compared across ranks when non-zero on both sides; with kOpBytesInPieces set, the op runs
  // in pieces through a pipeline outside the worker (the CUDA host route's).
  uint64_t op_bytes = 0;
  // Consuming a step overwrites the op's own input (an in-place reduction): once a step has
  // been consumed, the op cannot be run again from its inputs.
  bool inplace = false;
  // Receivers may read the sends' data straight from this process's memory (a pulled
  // message, mailbox.h): no send's source is written while the op runs, so it holds the
  // data until the op ends.
  bool pullable = false;
  std::vector<Step> steps;
  // Runs after the last step (for example the local copy of this rank's own block).
  std::function<void()> finish;
  // When set, the op starts only once this returns true (its data is being produced
  // elsewhere, e.g. copied off a GPU); the deadline counts from then. Polled by the worker.
  std::function<bool()> ready;
};

// Completion: "" on success, else the reason. Called on the worker thread.
using OpCallback = std::function<void(const std::string& error)>;

}  // namespace moelink::collective
