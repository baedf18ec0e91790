// Nouns of the transfer engine: segments, requests, batches.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace moelink::transfer {

using SegmentId = uint32_t;

// What a rank publishes about one registered segment (serialized into the store).
struct SegmentDesc {
  int rank = -1;
  SegmentId id = 0;
  uint64_t length = 0;
  std::string shm_name;  // non-empty when the segment lives in POSIX shared memory

  std::string serialize() const;
  static SegmentDesc parse(const std::string& bytes);
};

enum class Opcode : uint8_t { kWrite = 1, kRead = 2 };

// One-sided transfer: WRITE copies [local, local+length) into the peer's segment at
// offset; READ copies the other way.
struct TransferRequest {
  Opcode op = Opcode::kWrite;
  void* local = nullptr;
  int peer = -1;
  SegmentId segment = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  // After applying, ring the peer engine's doorbell (wakes a thread sleeping on it).
  bool notify = false;
  // A write that needs no acknowledgement of its own: transports with acknowledgements (tcp)
  // complete it once it is handed to the network (each part of a striped one once that part is),
  // and a rejection of it breaks the pair: the requests after it fail with the receiver's reason.
  // For a caller that never waits on this write (a credit word, a mailbox message); the engine
  // also sets it on a write followed in the same batch by an acknowledged write to the same peer
  // over the same transport (the batch completes with that one).
  bool no_ack = false;
  // A write that may land before earlier requests to the peer and beside later ones, as a
  // striped write does (every request after it is still applied after all of it): over tcp with
  // several streams such writes of at least 2 KiB spread over the streams, so that many small
  // writes (an EP proxy's rows) move at the streams' bandwidth, not one connection's.
  // Other transports apply it in order. no_ack applies to it as to any write (a rejection then
  // breaks the pair); it neither covers an earlier write's acknowledgement nor is covered by a
  // later one's.
  bool unordered = false;
};

enum class RequestState : int { kPending = 0, kCompleted = 1, kFailed = 2 };

// The completion record of one submitted batch. Transports complete entries from their
// own threads; callers poll or wait. Ordering contract of the engine: requests to the
// same peer are applied at the peer in submission order (within a batch and across
// batches), and an 8-byte write to an 8-byte-aligned offset is applied as one atomic
// store with release semantics, so it can serve as a signal for the data before it.
// One exception, over tcp with several streams (MOELINK_TCP_STREAMS): a large write that is
// striped over them, or one marked unordered, lands as its parts arrive, possibly before earlier
// requests and beside later such writes; every request after it is still applied after all of it. A caller
// therefore never has two writes to the same bytes of a peer in flight at once (the
// engine's users rewrite a buffer only after its receiver has said it consumed it).
class TransferBatch {
 public:
  explicit TransferBatch(size_t n);

  size_t size() const { return states_.size(); }
  RequestState state(size_t i) const {
    return static_cast<RequestState>(states_[i].load(std::memory_order_acquire));
  }
  bool done() const { return remaining_.load(std::memory_order_acquire) == 0; }
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  // The first failure's reason ("" when none).
  std::string error() const;
  std::string reason(size_t i) const;
  // Waits for every request to finish; false on timeout.
  bool wait(std::chrono::milliseconds timeout) const;

  void complete(size_t i);
  void fail(size_t i, const std::string& reason);

 private:
  void finishOne();

  std::vector<std::atomic<int>> states_;
  std::atomic<size_t> remaining_;
  std::atomic<bool> failed_{false};
  mutable std::mutex mu_;
  std::vector<std::string> reasons_;
};

using BatchPtr = std::shared_ptr<TransferBatch>;

}  // namespace moelink::transfer
