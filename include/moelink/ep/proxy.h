// EpProxy: the CPU-proxy path of the EP buffer, for peers that are neither this rank nor
// reachable over NVLink and have no IBGDA (different hosts, or different virtual hosts
// under MOELINK_EP_RANKS_PER_HOST).
//
// The GPU kernels write a proxy peer's messages into this rank's outbox (pinned host
// memory mapped into the GPU) and post requests into a ring in mapped host memory (see
// proxy_ring.h). The proxy's threads (proxy_carrier.h) take what has been posted as a batch
// and carry it in waves (planProxyBatch) as transfer-engine WRITEs into the peers' inbox
// segments: a wave's data from the outbox (rows of consecutive tokens merged into one write),
// then its 8-byte signals (counts and flags) in ring order. The engine applies each peer's
// requests in submission order and an 8-byte write as one release store, so the receiving
// GPU, which reads its inbox through a mapping, sees a signal only after the data posted
// before it.
//
// The inbox is a transfer-engine segment (POSIX shm when the peers share a host, so that
// their proxies write it with a memcpy; reachable over tcp otherwise), registered with
// CUDA as mapped memory. Its shared-memory name stays while the process lives (a readmitted
// rank's new process opens it by name; the names of a process that died are reclaimed by the
// next one to create a region). Layouts (per buffer half) are in low_latency_buffer.cpp. No torch here.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moelink/ep/low_latency_kernels.h"
#include "moelink/ep/proxy_carrier.h"

namespace moelink::transfer {
class TransferEngine;
class MetadataStore;
}  // namespace moelink::transfer

namespace moelink::ep {

class EpProxy {
 public:
  // Collective over the group (every rank constructs one, also ranks without proxy
  // peers, so that the engines' rendezvous completes). `peers`: this rank's proxy peers.
  // `joining`: this process takes the place of a failed rank in a running group; it opens
  // no peer's inbox here (reopen() does, once the others have readmitted it).
  EpProxy(std::shared_ptr<transfer::MetadataStore> store, int rank, int size, std::vector<int> peers,
          uint64_t inbox_bytes, uint64_t outbox_bytes, std::chrono::milliseconds timeout, bool joining = false);
  ~EpProxy();
  EpProxy(const EpProxy&) = delete;
  EpProxy& operator=(const EpProxy&) = delete;

  char* inbox() const { return inbox_dev_; }    // device address of this rank's inbox
  char* outbox() const { return outbox_dev_; }  // device address of this rank's outbox
  kernels::ProxyRing ring() const { return ring_; }
  // Waits (up to the timeout) until every request the GPU has posted is carried out; the
  // caller has synchronized the device. False if the time ran out.
  bool settle();
  // Connects to the process that now has `peer`'s rank (a readmitted rank): forgets the old
  // one and opens the new one's inbox. No request may be in the ring (settle() first).
  void reopen(int peer);
  // Zeroes this rank's inbox (no peer writes into it meanwhile).
  void clearInbox();
  // The engine transport that carries this rank's requests to `peer` ("shm" or "tcp").
  std::string transportTo(int peer) const;

 private:
  int rank_;
  std::vector<int> peers_;
  std::unique_ptr<transfer::TransferEngine> engine_;
  uint64_t inbox_bytes_ = 0, outbox_bytes_ = 0;
  char* inbox_host_ = nullptr;
  char* inbox_dev_ = nullptr;
  char* outbox_host_ = nullptr;
  char* outbox_dev_ = nullptr;
  kernels::ProxyEntry* entries_host_ = nullptr;  // followed by the head word
  uint64_t* head_host_ = nullptr;
  unsigned long long* tail_dev_ = nullptr;
  uint64_t capacity_ = 0;
  kernels::ProxyRing ring_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<ProxyCarrier> carrier_;  // the proxy thread (none without proxy peers)
};

}  // namespace moelink::ep
