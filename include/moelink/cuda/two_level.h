// The two-level route's ranks (plain C++, tested without a GPU): which of a group's ranks share
// this rank's host, and which make up its rail, the ranks at its position on every host (the
// CUDA unit's TwoLevel, src/cuda/unit.h).
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace moelink::cuda {

struct TwoLevelRanks {
  std::vector<int> local;  // this rank's host's ranks, ascending
  int me = 0;              // this rank's position among them
  std::vector<int> rail;   // the rank at position `me` of every host, ascending
  std::vector<std::vector<int>> rails;  // the rail of each position (rails[me] is `rail`)
  int hosts = 0;
};

// For a group of `size` ranks whose rank q is on host `host_of(q)` (equal strings: one host):
// this rank's place, when there are at least 2 hosts and every host has the same number of
// ranks, 2 to `max_local`; otherwise nothing (the route does not apply). Every rank of the
// group gets the same answer about whether it applies.
std::optional<TwoLevelRanks> twoLevelRanks(int size, int rank, const std::function<std::string(int)>& host_of,
                                           int max_local);

}  // namespace moelink::cuda
