// State of in-flight operations, shared by worker.cpp (collectives, the loop) and
// point_to_point.cpp (send/recv). Worker-thread only.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "moelink/collective/worker.h"

namespace moelink::collective {

using Clock = std::chrono::steady_clock;

struct CollectiveWorker::Collective {
  OpBuilder build;     // null for a prebuilt spec
  OpSpec spec;
  bool built = false;
  std::vector<int> lost;  // ranks that left the group while it ran
  Clock::time_point last_progress;
  OpCallback done;
  uint64_t seq = 0;
  std::chrono::milliseconds timeout{0};
  Clock::time_point deadline;
  bool started = false;
  // Per peer: the (step, send index) pairs in send order, and how far they went.
  std::vector<std::vector<std::pair<uint32_t, uint32_t>>> sendq;
  std::vector<size_t> sendpos;
  std::vector<uint64_t> pair_send, pair_recv;  // bytes per peer over the whole op
  std::vector<uint32_t> recv_msgs;             // messages expected per peer
  std::vector<std::vector<const StepRecv*>> recvq;  // per peer, in order
  std::vector<std::vector<uint32_t>> recvq_step;   // per peer: the step of each recvq entry
  // Per peer, per recvq entry: the mailbox has been asked to receive it at its landing
  // (askLandings, or release() for the message `depth` places on); asked once at most.
  std::vector<std::vector<char>> land_asked;
  bool gated_landings = false;  // some recv with a landing is in a gated step (askLandings each pass)
  std::vector<char> gate_open;                     // per step: its gate (Step::gate) has opened
  bool must_poll = false;  // this pass stopped at what rings no doorbell: a closed gate, unfinished sends
  size_t sent_through = 0;                         // steps before it have all their sends done (after_all_sends)
  std::vector<uint32_t> recv_done;             // per peer: consumed so far
  std::vector<uint32_t> sends_issued;          // per step
  std::vector<std::vector<transfer::BatchPtr>> step_batches;
  std::vector<transfer::BatchPtr> inflight;
  std::vector<char> last_sent, last_seen;      // per peer
  std::vector<char> abort_sent;                // per peer: told that this op failed here
  size_t next_step = 0;
  std::string error;
  bool draining = false;
  Clock::time_point drain_deadline;
};

struct CollectiveWorker::SendOp {
  int peer = -1;
  const char* data = nullptr;
  uint64_t bytes = 0;
  int tag = 0;
  OpCallback done;
  Clock::time_point deadline;
  std::chrono::milliseconds timeout{0};
  std::function<bool()> ready;  // see OpSpec::ready
  uint64_t seq = 0;
  uint64_t issued_bytes = 0;
  bool all_issued = false;
  std::vector<transfer::BatchPtr> inflight;
};

std::string describeTimeout(const char* what, uint64_t seq, std::chrono::milliseconds timeout,
                            const std::vector<int>& waiting_for);

}  // namespace moelink::collective
