// EpProxy: the CPU-proxy path of the EP buffer, for peers that are neither this rank nor
// reachable over NVLink and have no IBGDA (different hosts, or different virtual hosts
// under MOELINK_EP_RANKS_PER_HOST).
//
// The GPU kernels write a proxy peer's messages into this rank's outbox (pinned host
// memory mapped into the GPU) and post requests into a ring in mapped host memory (see
// kernels.h: ProxyRing). A proxy thread turns each request into a transfer-engine WRITE
// into the peer's inbox segment: data from the outbox, or an 8-byte signal (a count or a
// flag). Requests to one peer are applied in ring order, and the engine applies an
// 8-byte write as one release store after the data before it, so the receiving GPU,
// which reads its inbox through a mapping, sees a signal only after its data.
//
// The inbox is a transfer-engine segment (POSIX shm when the peers share a host, so that
// their proxies write it with a memcpy; reachable over tcp otherwise), registered with
// CUDA as mapped memory. Layouts (per buffer half) are in ep_buffer.cpp. No torch here.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "moelink/ep/kernels.h"

namespace moelink::transfer {
class TransferEngine;
class MetadataStore;
}  // namespace moelink::transfer

namespace moelink::ep {

class EpProxy {
 public:
  // Collective over the group (every rank constructs one, also ranks without proxy
  // peers, so that the engines' rendezvous completes). `peers`: this rank's proxy peers.
  EpProxy(std::shared_ptr<transfer::MetadataStore> store, int rank, int size, std::vector<int> peers,
          uint64_t inbox_bytes, uint64_t outbox_bytes, std::chrono::milliseconds timeout);
  ~EpProxy();
  EpProxy(const EpProxy&) = delete;
  EpProxy& operator=(const EpProxy&) = delete;

  char* inbox() const { return inbox_dev_; }    // device address of this rank's inbox
  char* outbox() const { return outbox_dev_; }  // device address of this rank's outbox
  kernels::ProxyRing ring() const { return ring_; }
  // Removes the inbox's shared-memory name once every peer has opened it.
  void unlinkNames();
  // The engine transport that carries this rank's requests to `peer` ("shm" or "tcp").
  std::string transportTo(int peer) const;

 private:
  void run();

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
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace moelink::ep
