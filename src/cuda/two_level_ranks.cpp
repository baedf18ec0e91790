// The two-level route's ranks (moelink/cuda/two_level.h).
#include "moelink/cuda/two_level.h"

#include <algorithm>
#include <map>

namespace moelink::cuda {

std::optional<TwoLevelRanks> twoLevelRanks(int size, int rank, const std::function<std::string(int)>& host_of,
                                           int max_local) {
  // The hosts in the order of their first ranks, each with its ranks ascending.
  std::vector<std::vector<int>> hosts;
  std::map<std::string, size_t> index;
  for (int q = 0; q < size; ++q) {
    auto [it, fresh] = index.emplace(host_of(q), hosts.size());
    if (fresh) hosts.emplace_back();
    hosts[it->second].push_back(q);
  }
  const size_t n = hosts.empty() ? 0 : hosts.front().size();
  if (hosts.size() < 2 || n < 2 || n > static_cast<size_t>(max_local)) return std::nullopt;
  for (const auto& h : hosts)
    if (h.size() != n) return std::nullopt;
  TwoLevelRanks t;
  t.local = hosts[index.at(host_of(rank))];
  t.me = static_cast<int>(std::find(t.local.begin(), t.local.end(), rank) - t.local.begin());
  t.rails.resize(n);
  for (size_t p = 0; p < n; ++p) {
    for (const auto& h : hosts) t.rails[p].push_back(h[p]);
    std::sort(t.rails[p].begin(), t.rails[p].end());
  }
  t.rail = t.rails[static_cast<size_t>(t.me)];
  t.hosts = static_cast<int>(hosts.size());
  return t;
}

}  // namespace moelink::cuda
