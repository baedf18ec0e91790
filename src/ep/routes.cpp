// The normal-mode route decision (see moelink/ep/routes.h).
#include "moelink/ep/routes.h"

#include <algorithm>

#include "moelink/common/error.h"

namespace moelink::ep {

namespace {

constexpr int kMaxRanksPerHost = 8;  // the NVLink hop's kernels serve at most 8 ranks

bool onThisHost(const std::string& path, bool kernels) {
  return path == "local" || (kernels ? path == "nvlink" : path == "shm");
}

void checkFacts(const RouteFacts& f) {
  if (f.world <= 0 || f.rank < 0 || f.rank >= f.world) {
    throw Error("moelink EP route: rank " + std::to_string(f.rank) + " of a group of " + std::to_string(f.world));
  }
  auto sized = [&](size_t n, bool needed, const char* what) {
    if (needed && n != static_cast<size_t>(f.world)) {
      throw Error(std::string("moelink EP route: ") + what + " has " + std::to_string(n) + " entries for a group of " +
                  std::to_string(f.world));
    }
  };
  sized(f.active.size(), true, "the active-rank mask");
  sized(f.kernel_paths.size(), f.kernels, "the GPU buffer's path list");
  sized(f.group_paths.size(), !f.kernels && f.ranks_per_host <= 0, "the backend's transport list");
}

}  // namespace

const char* routeName(NormalRoute route) {
  switch (route) {
    case NormalRoute::kNvlink: return "nvlink";
    case NormalRoute::kGroup: return "group";
    case NormalRoute::kAsk: return "ask";
  }
  return "group";
}

int twoHopRanksPerHost(int rank, int world, std::vector<int> same_host) {
  const int n = static_cast<int>(same_host.size());
  if (n < 2 || n > kMaxRanksPerHost || world <= 0 || world % n != 0 || world / n < 2) return 0;
  std::sort(same_host.begin(), same_host.end());
  const int first = rank / n * n;
  for (int i = 0; i < n; ++i) {
    if (same_host[i] != first + i) return 0;
  }
  return n;
}

int ranksPerHostSeen(const RouteFacts& f) {
  checkFacts(f);
  if (!f.two_hop) return 0;
  std::vector<int> same;
  for (int r = 0; r < f.world; ++r) {
    bool here;
    if (f.kernels) {
      here = onThisHost(f.kernel_paths[r], true);
    } else if (f.ranks_per_host > 0) {
      here = r / f.ranks_per_host == f.rank / f.ranks_per_host;
    } else {
      here = onThisHost(f.group_paths[r], false);
    }
    if (here) same.push_back(r);
  }
  return twoHopRanksPerHost(f.rank, f.world, std::move(same));
}

NormalRoute chooseNormalRoute(const RouteFacts& f) {
  checkFacts(f);
  // A masked-out rank: the kernels and the two-hop route both need every rank.
  if (std::any_of(f.active.begin(), f.active.end(), [](int a) { return a == 0; })) return NormalRoute::kGroup;
  if (!f.kernels) return NormalRoute::kAsk;
  // Membership changed since the GPU buffer last connected (update_members not yet called).
  if (!f.connected) return NormalRoute::kGroup;
  const bool all_nvlink = std::all_of(f.kernel_paths.begin(), f.kernel_paths.end(),
                                      [](const std::string& p) { return onThisHost(p, true); });
  if (f.world <= kMaxRanksPerHost && all_nvlink) return NormalRoute::kNvlink;
  return NormalRoute::kAsk;
}

int agreedRanksPerHost(long long highest, long long lowest) {
  return highest == lowest && highest > 0 && highest <= kMaxRanksPerHost ? static_cast<int>(highest) : 0;
}

}  // namespace moelink::ep
