#include "moelink/ep/proxy_ring.h"

#include <algorithm>
#include <cstdint>

namespace moelink::ep {

namespace {

bool wellFormed(const kernels::ProxyEntry& e, const ProxyLimits& l) {
  if (std::find(l.peers.begin(), l.peers.end(), e.peer) == l.peers.end()) return false;
  if (e.kind == kernels::kProxySignal) return e.length == 8;
  // (remote + length must not wrap: merging adds lengths to remote offsets)
  return e.kind == kernels::kProxyData && e.local <= l.outbox_bytes && e.length <= l.outbox_bytes - e.local &&
         e.remote <= UINT64_MAX - e.length;
}

ProxyWrite writeOf(const kernels::ProxyEntry& e) {
  return ProxyWrite{e.peer, e.kind == kernels::kProxySignal, e.local, e.remote, e.length};
}

}  // namespace

ProxyPlan planProxyBatch(const kernels::ProxyEntry* entries, size_t n, const ProxyLimits& limits) {
  ProxyPlan plan;
  std::vector<ProxyWrite> data, signals, in_order;
  for (size_t i = 0; i < n; ++i) {
    if (!wellFormed(entries[i], limits)) {
      plan.dropped.push_back(i);
      continue;
    }
    const ProxyWrite w = writeOf(entries[i]);
    in_order.push_back(w);
    if (w.length == 0 && !w.signal) continue;  // nothing to carry
    (w.signal ? signals : data).push_back(w);
  }
  std::stable_sort(data.begin(), data.end(), [](const ProxyWrite& a, const ProxyWrite& b) {
    return a.peer != b.peer ? a.peer < b.peer : a.remote < b.remote;
  });
  for (size_t i = 1; i < data.size(); ++i) {
    if (data[i].peer == data[i - 1].peer && data[i].remote < data[i - 1].remote + data[i - 1].length) {
      plan.writes = std::move(in_order);  // overlapping writes: keep the GPU's order
      return plan;
    }
  }
  for (const ProxyWrite& w : data) {
    if (!plan.writes.empty()) {
      ProxyWrite& last = plan.writes.back();
      if (last.peer == w.peer && last.remote + last.length == w.remote && last.local + last.length == w.local) {
        last.length += w.length;
        continue;
      }
    }
    plan.writes.push_back(w);
  }
  plan.writes.insert(plan.writes.end(), signals.begin(), signals.end());
  return plan;
}

}  // namespace moelink::ep
