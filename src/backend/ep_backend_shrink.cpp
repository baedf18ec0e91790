// torch.distributed.shrink_group on backend "ep": the ranks that stay (all of them call it,
// the excluded ones do not) get a new backend over themselves, ranks renumbered in order. It
// is built as new_group builds one, through this group's store under a name of its own, so
// nothing of this group's transport is needed: a rank excluded because it died is never
// waited for. This group stays as it was; shrink_group destroys it right after.
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "moelink/backend/ep_backend.h"

namespace moelink::backend {

#if MOELINK_C10D_SHRINK

c10::intrusive_ptr<c10d::Backend> EpBackend::shrink(const std::vector<int64_t>& ranks_to_exclude, int shrink_flags,
                                                    const c10::intrusive_ptr<c10d::Backend::Options>& opts_override) {
  TORCH_CHECK(worker_, "moelink: the 'ep' process group has been shut down");
  TORCH_CHECK_VALUE(shrink_flags == 0 || shrink_flags == 1, "moelink: shrink_flags must be SHRINK_DEFAULT (0) or ",
                    "SHRINK_ABORT (1), got ", shrink_flags);
  TORCH_CHECK_VALUE(!ranks_to_exclude.empty(), "moelink: shrink needs at least one rank to exclude");
  std::vector<char> excluded(size_, 0);
  for (int64_t r : ranks_to_exclude) {
    TORCH_CHECK_VALUE(r >= 0 && r < size_, "moelink: cannot exclude rank ", r, ": the group has ranks 0..", size_ - 1);
    TORCH_CHECK_VALUE(!excluded[r], "moelink: rank ", r, " is listed twice in ranks_to_exclude");
    excluded[r] = 1;
  }
  TORCH_CHECK_VALUE(!excluded[rank_], "moelink: rank ", rank_,
                    " is in ranks_to_exclude; only the ranks that stay call shrink");
  int new_rank = 0, new_size = 0;
  std::string stay;
  for (int r = 0; r < size_; ++r) {
    if (excluded[r]) continue;
    if (r == rank_) new_rank = new_size;
    ++new_size;
    stay += (stay.empty() ? "" : ",") + std::to_string(r);
  }
  std::chrono::milliseconds timeout = this->timeout();
  if (opts_override && opts_override->timeout.count() > 0) timeout = opts_override->timeout;
  // The same name on every rank that stays: how many times this group was shrunk, and to whom.
  auto store = c10::make_intrusive<c10d::PrefixStore>(
      "moelink/shrink/" + std::to_string(shrinks_.fetch_add(1) + 1) + "/" + stay, c10d_store_);
  Options o;
  o.raise_on_peer_failure = options_.raise_on_peer_failure;
  return c10::make_intrusive<EpBackend>(store, new_rank, new_size, timeout, o);
}

#endif

}  // namespace moelink::backend
