// Which route a normal-mode EP call takes, decided from what this rank knows of the group.
//
// The routes: the NVLink kernels (every rank of the group on this host's NVLink, active, and
// the GPU buffer connected at the group's membership epoch); the two-hop route across hosts
// (a host hop over the group, then an NVLink or group hop inside the host), when the group is
// hosts of 2..8 consecutive ranks each; else the group path (torch ops and one all_to_all over
// the group). Whether the two-hop route applies is a fact every rank must agree on, so the
// decision here can end in "ask the group": the caller runs that agreement (a collective
// over its process group) and takes the two-hop route only when every rank saw the same
// ranks per host. No torch and no CUDA here: the facts are plain values the binding gathers
// from the backend and the GPU buffer.
#pragma once

#include <string>
#include <vector>

namespace moelink::ep {

enum class NormalRoute {
  kNvlink,  // the normal-mode kernels over NVLink
  kGroup,   // torch ops and all_to_all over the group
  kAsk,     // the two-hop route if the group agrees on ranks per host (see agreedRanksPerHost), else kGroup
};

const char* routeName(NormalRoute route);

struct RouteFacts {
  int rank = 0;
  int world = 0;
  std::vector<int> active;  // the group's active-rank mask, one entry per rank
  // The call's tensors are on a GPU that has the normal-mode kernels and a GPU buffer; then
  // `kernel_paths` is that buffer's path to every rank ("local", "nvlink", "proxy", "ibgda").
  bool kernels = false;
  bool connected = false;  // the GPU buffer is connected at the group's current membership epoch
  std::vector<std::string> kernel_paths;
  // The backend's transport to every rank ("local", "shm", "tcp"): who shares this rank's
  // host when there are no kernels to ask.
  std::vector<std::string> group_paths;
  bool two_hop = true;     // MOELINK_EP_TWO_HOP
  int ranks_per_host = 0;  // MOELINK_EP_RANKS_PER_HOST, 0 when unset
};

// Ranks per host L when `same_host` (the ranks on `rank`'s host, itself included) is the block
// of L consecutive ranks that holds `rank`, with 2 <= L <= 8 and at least two hosts of L;
// else 0 (the two-hop route does not apply).
int twoHopRanksPerHost(int rank, int world, std::vector<int> same_host);

// Ranks per host for the two-hop route as this rank sees the group; 0 when the route is
// switched off or does not apply. Host membership comes from the GPU buffer's paths when
// there are kernels, else from MOELINK_EP_RANKS_PER_HOST, else from the backend's transports.
int ranksPerHostSeen(const RouteFacts& facts);

// The route of a call that is not a cached repeat. kAsk leaves the choice to the agreement.
NormalRoute chooseNormalRoute(const RouteFacts& facts);

// The agreement's outcome: every rank contributes its ranksPerHostSeen `mine`; `highest` and
// `lowest` are the largest and smallest contribution over the group. Two-hop with that many
// ranks per host when all agree, else 0 (the group path).
int agreedRanksPerHost(long long highest, long long lowest);

}  // namespace moelink::ep
