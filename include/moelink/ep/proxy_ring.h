// The ring between the EP kernels and the CPU proxy (plain C++: no CUDA, no torch): the
// requests the GPU posts, and how the proxy turns one batch of them into transfer-engine
// writes (planProxyBatch).
//
// The GPU posts a request per message to a proxy peer: a data request per row or slot-entry
// range it wrote into the outbox, a signal request (an 8-byte count or flag, applied as a
// release store) after the data it covers. The proxy takes what has been posted as one
// batch. No request of a batch can depend on the delivery of another request of the same
// batch (the GPU posted all of them before the proxy applied any), so within a batch the
// proxy may reorder data requests and merge them, as long as every signal still follows
// every data request posted before it. planProxyBatch cuts the batch, in ring order, into
// waves of at least kProxyWaveBytes of data each (a wave ends at a signal): a wave's data,
// rows of consecutive tokens to one peer merged into one write (their outbox and inbox
// ranges continue each other), may be carried in any order and in parallel; its signals
// follow all of it. A signal waits for at most a wave's worth of data posted after it (not
// for the whole batch: a combine's route flag, posted before its rows, is not held behind
// them), and a wave is large enough to split over several copying threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace moelink::ep::kernels {

// One request for the CPU proxy, in host-mapped memory. `seq` is written last (ticket + 1).
struct alignas(16) ProxyEntry {
  uint64_t seq;
  int32_t kind;  // kProxyData or kProxySignal
  int32_t peer;
  uint64_t local;   // data: offset in the outbox; signal: the 8-byte value
  uint64_t remote;  // offset in the peer's inbox segment
  uint64_t length;  // data bytes (signals: 8)
  uint64_t pad;
};
constexpr int kProxyData = 1;
constexpr int kProxySignal = 2;

// A host thread's post into entry `ticket` of a ring of `capacity` (the poster has waited for
// room), as the GPU's (kernels/sync.cuh) writes it: the fields, then `seq` with a release. For
// host-side posters in place of the GPU (the carrier's tests and benchmark).
inline void postProxyEntryFromHost(ProxyEntry* ring, uint64_t capacity, uint64_t ticket, int kind, int peer,
                                   uint64_t local, uint64_t remote, uint64_t length) {
  ProxyEntry& e = ring[ticket % capacity];
  e.kind = kind;
  e.peer = peer;
  e.local = local;
  e.remote = remote;
  e.length = length;
  __atomic_store_n(&e.seq, ticket + 1, __ATOMIC_RELEASE);
}

struct ProxyRing {
  ProxyEntry* entries = nullptr;            // host-mapped, `capacity` entries
  const uint64_t* head = nullptr;           // host-mapped: entries the proxy has consumed
  unsigned long long* tail = nullptr;       // device: tickets handed out
  unsigned long long* head_seen = nullptr;  // device: the highest `head` a post has read
  uint64_t capacity = 0;
  const char* outbox = nullptr;  // device address of the outbox (data offsets are from here)
};

}  // namespace moelink::ep::kernels

namespace moelink::ep {

// One write the proxy hands to the engine.
struct ProxyWrite {
  int peer = -1;
  bool signal = false;
  uint64_t local = 0;   // data: offset in the outbox; signal: the 8-byte value
  uint64_t remote = 0;  // offset in the peer's inbox
  uint64_t length = 0;
};

struct ProxyLimits {
  std::vector<int> peers;     // the proxy peers; a request to any other rank is malformed
  uint64_t outbox_bytes = 0;  // a data request's outbox range must lie inside the outbox
  // (the inbox range is the engine's to check: peers' inboxes differ in size)
};

// Data to carry, in any order, then signals to apply in order, after all of the data.
struct ProxyWave {
  std::vector<ProxyWrite> data;
  std::vector<ProxyWrite> signals;
  uint64_t bytes = 0;  // of the data
};

struct ProxyPlan {
  std::vector<ProxyWave> waves;  // carried one after the other
  std::vector<size_t> dropped;   // indices of malformed entries (not sent)
  // Some data entries overlap (see planProxyBatch): the waves must land in ring order, so no
  // data write may overtake another.
  bool in_ring_order = false;
};

// The least data a wave holds before a signal may end it.
constexpr uint64_t kProxyWaveBytes = 256 << 10;

// The waves that carry entries [0, n) of one batch, given in ring order. A wave takes the
// entries in ring order until a signal comes after at least `wave_bytes` of its data (or the
// batch ends); its data entries to one peer are sorted by their inbox offset (stable) and
// merged where both ranges continue the previous entry's; its signals keep their order.
// Where two data entries of the batch overlap in a peer's inbox (the kernels never post that:
// a byte is rewritten two rounds later, after its receiver consumed it), nothing is
// reordered or merged: every entry is a wave of its own, in ring order.
ProxyPlan planProxyBatch(const kernels::ProxyEntry* entries, size_t n, const ProxyLimits& limits,
                          uint64_t wave_bytes = kProxyWaveBytes);

}  // namespace moelink::ep
