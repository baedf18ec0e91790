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

bool byInbox(const ProxyWrite& a, const ProxyWrite& b) {
  return a.peer != b.peer ? a.peer < b.peer : a.remote < b.remote;
}

// Sorts a wave's data by inbox offset and merges the writes that continue each other.
void mergeData(ProxyWave& wave) {
  std::stable_sort(wave.data.begin(), wave.data.end(), byInbox);
  size_t out = 0;
  for (size_t i = 0; i < wave.data.size(); ++i) {
    const ProxyWrite& w = wave.data[i];
    if (out > 0) {
      ProxyWrite& last = wave.data[out - 1];
      if (last.peer == w.peer && last.remote + last.length == w.remote && last.local + last.length == w.local) {
        last.length += w.length;
        continue;
      }
    }
    wave.data[out++] = w;
  }
  wave.data.resize(out);
}

}  // namespace

ProxyPlan planProxyBatch(const kernels::ProxyEntry* entries, size_t n, const ProxyLimits& limits,
                         uint64_t wave_bytes) {
  ProxyPlan plan;
  std::vector<ProxyWrite> in_order;
  in_order.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (!wellFormed(entries[i], limits)) {
      plan.dropped.push_back(i);
      continue;
    }
    const ProxyWrite w = writeOf(entries[i]);
    if (w.length == 0 && !w.signal) continue;  // nothing to carry
    in_order.push_back(w);
  }
  std::vector<ProxyWrite> data;
  for (const ProxyWrite& w : in_order)
    if (!w.signal) data.push_back(w);
  std::stable_sort(data.begin(), data.end(), byInbox);
  for (size_t i = 1; i < data.size(); ++i) {
    if (data[i].peer == data[i - 1].peer && data[i].remote < data[i - 1].remote + data[i - 1].length) {
      // Overlapping writes: keep the GPU's order, one entry after the other.
      plan.in_ring_order = true;
      for (const ProxyWrite& w : in_order) {
        ProxyWave wave;
        (w.signal ? wave.signals : wave.data).push_back(w);
        wave.bytes = w.signal ? 0 : w.length;
        plan.waves.push_back(std::move(wave));
      }
      return plan;
    }
  }
  ProxyWave wave;
  for (const ProxyWrite& w : in_order) {
    if (!w.signal) {
      wave.data.push_back(w);
      wave.bytes += w.length;
      continue;
    }
    wave.signals.push_back(w);
    if (wave.bytes >= wave_bytes) {
      mergeData(wave);
      plan.waves.push_back(std::move(wave));
      wave = ProxyWave{};
    }
  }
  if (!wave.data.empty() || !wave.signals.empty()) {
    mergeData(wave);
    plan.waves.push_back(std::move(wave));
  }
  return plan;
}

}  // namespace moelink::ep
