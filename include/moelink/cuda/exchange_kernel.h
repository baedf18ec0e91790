// The launcher of the exchange kernel (src/collective/kernels/exchange.cu): raw device
// pointers, sizes and a stream, no torch types. See exchange.h for what an exchange is.
//
// One launch runs one exchange on `blocks` blocks. It reads this rank's op number from the
// staging area's counter and bumps it when every block is done, so launches on one stream
// number themselves (a captured CUDA graph replays with fresh numbers, no host involved).
// Waits on peers spin with a deadline (globaltimer) and give up when the host raises
// `abort` (a membership change); a failure (header mismatch, timeout, abort)
// ends every block of every rank involved and is written to `status`, host-mapped memory
// the host reads after the launch has completed.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "moelink/cuda/exchange.h"

namespace moelink::cuda {

struct ExchangeLaunch {
  // `blocks` cut every round into pieces (ExchangeTuning::blocks, the same on every rank);
  // `launched` of them run per role: those that have a piece of some pair in the first round
  // (the largest), so that a small exchange runs on a few blocks.
  int rank = 0, size = 0, blocks = 1, launched = 1;
  int roles = 1;  // 2: blocks [0, launched) push, [launched, 2 * launched) consume (exchangeSplits)
  uint64_t round = 0;  // bytes per pair and round (exchangeRoundBytes; within layout.round_bytes)
  // roles == 2: some range this rank's consuming blocks write lies in the input its pushing
  // blocks read (an in-place op; exchangeOutputMeetsInput), so that a consuming block waits
  // until every pushing block has read the round. Otherwise the roles meet only through peers.
  bool guard_input = true;
  // The Lamport protocol (exchangeLamport; src/cuda/kernels/lamport.cu): `launched` blocks of
  // `threads` (lamportThreadsFor) move the data, one more writes the header slots.
  bool lamport = false;
  int threads = 0;
  // The Lamport kernel launches as a programmatic dependent (ExchangeTuning::dependent_launch).
  bool dependent_launch = true;
  // The staged kernel: pairs of 1..lamport_pairs bytes travel as Lamport lines (exchangeLamportPairs),
  // and with `header_lines` the header goes to every peer as lines too, for a peer that runs the
  // Lamport kernel for this op (a copy whose pairs are all short there; or a disagreeing peer).
  uint64_t lamport_pairs = 0;
  bool header_lines = false;
  uint8_t mode = 0, dtype = 0, redop = 0;
  // kForward: the rank whose pair this rank passes on (Exchange::forward_from).
  int forward_from = -1;
  const char* in = nullptr;
  char* out = nullptr;
  uint64_t send_off[kExchangeMaxRanks] = {}, send_bytes[kExchangeMaxRanks] = {};
  uint64_t recv_off[kExchangeMaxRanks] = {}, recv_bytes[kExchangeMaxRanks] = {};
  uint64_t reduce_bytes = 0;
  // Every rank's staging area as this process maps it (its own included).
  char* staging[kExchangeMaxRanks] = {};
  ExchangeLayout layout;
  ExchangeHeader header[kExchangeMaxRanks] = {};  // what this rank sends each peer (seq unset)
  uint64_t timeout_ns = 0;
  ExchangeStatus* status = nullptr;  // device view of host-mapped memory
  // Host-mapped; non-zero ends the launch (a peer left the group): the waits give up.
  const uint32_t* abort = nullptr;
};

// Fills the launch from an exchange (pointers and staging set by the caller).
void describeLaunch(const Exchange& x, int rank, const ExchangeTuning& t, ExchangeLaunch& l);
// Launches the staged kernel, or the Lamport kernel when `l.lamport`.
cudaError_t launchExchange(const ExchangeLaunch& l, cudaStream_t stream);
cudaError_t launchLamport(const ExchangeLaunch& l, cudaStream_t stream);

}  // namespace moelink::cuda
