// The Work of a CUDA op, the pool of its end events, the outcome of its host-staged worker
// op, and the thread that completes the works once the GPU has finished them.
#pragma once

#include <cuda_runtime_api.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "moelink/backend/work.h"
#include "moelink/cuda/exchange.h"

namespace moelink::cuda {

using backend::BackendWork;

// What the collective worker reports of a host-staged op: set once, on the worker thread.
class HostOutcome {
 public:
  void set(const std::string& error, int source);
  std::vector<int> lost;  // written before set(): the ranks the worker op lost
  // Waits for set(); returns the error ("" on success).
  std::string wait();
  int source();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string error_;
  int source_ = -1;
};

// CUDA events for the ends of a unit's ops, reused: creating and destroying an event per op
// would cost the caller microseconds per op. Shared by the unit and its works (a Work may
// outlive the unit); any thread may hand an event back.
class EventPool {
 public:
  explicit EventPool(int device) : device_(device) {}
  ~EventPool();
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;
  cudaEvent_t take();
  void give(cudaEvent_t e);

 private:
  const int device_;
  std::mutex mu_;
  std::vector<cudaEvent_t> free_;
};

// An event taken from a pool, handed back when its last holder lets go (an op's Work, and the
// unit while the op is the group's latest): a holder can still wait on it, since no later op
// can have been given it.
class PooledEvent {
 public:
  explicit PooledEvent(std::shared_ptr<EventPool> pool) : pool_(std::move(pool)), e_(pool_->take()) {}
  ~PooledEvent();
  PooledEvent(const PooledEvent&) = delete;
  PooledEvent& operator=(const PooledEvent&) = delete;
  cudaEvent_t get() const { return e_; }
  // Destroyed rather than reused (an event a CUDA graph capture used).
  void retire() { pool_.reset(); }

 private:
  std::shared_ptr<EventPool> pool_;
  cudaEvent_t e_;
};

// A CUDA op's Work. wait() makes the caller's current stream wait for the op's end event
// (no host block; nothing to do on the stream the op ran on) and raises the op's error if it is already known; the future and
// isCompleted() follow the GPU, through the Completer.
class CudaWork : public BackendWork {
 public:
  CudaWork(int rank, c10d::OpType type, const char* title, std::vector<at::Tensor> outputs, int device,
           std::shared_ptr<EventPool> events);
  ~CudaWork() override;

  void keep(const at::Tensor& t) { keep_.push_back(t); }
  cudaEvent_t endEvent() const { return end_->get(); }
  const std::shared_ptr<PooledEvent>& endHolder() const { return end_; }
  // The stream the op runs on: wait() from that stream needs no event wait.
  void ranOn(cudaStream_t s) { stream_ = s; }
  int device() const { return device_; }
  // The exchange status slot this op's kernels report into (nullptr: none).
  ExchangeStatus* status = nullptr;
  std::vector<int> peers;  // the group rank of each rank the status may name (empty: the same)
  uint64_t timeout_ms = 0;
  // The host-staged worker op this op waits for (nullptr: none).
  std::shared_ptr<HostOutcome> host;
  // Called by the Completer once the GPU has finished: "" or the error.
  void complete(const std::string& error);
  // Captured into a CUDA graph: nothing to watch, the future is complete at once (and the
  // end event, which the capture used, is not reused).
  void completeCaptured();

  bool wait(std::chrono::milliseconds timeout) override;
  void synchronize() override;
  int sourceRank() const override;

 private:
  std::vector<at::Tensor> keep_;
  int device_;
  std::shared_ptr<PooledEvent> end_;
  cudaStream_t stream_ = nullptr;
};

// One thread per CUDA unit that completes works in submission order once their end event
// has passed, reading their kernel status and their host-staged op's outcome. Also bounds
// the ops in flight (the status and ticket rings have `slots` entries).
//
// The thread polls an op's event with pauses between queries (a query in a tight loop contends
// with the caller's own CUDA calls for the driver), 5 us at first and longer as the op lasts,
// and after its last op it keeps looking for the next for 2 ms before it parks, so that a
// caller issuing ops in a steady stream never pays for waking it.
class Completer {
 public:
  // `stalled` runs (on the completer's thread) every 100 ms while an op has been pending
  // that long: the group then checks its peers' liveness.
  Completer(int device, size_t slots, std::function<void()> stalled = nullptr);
  ~Completer();  // waits for the works handed in so far
  // Reserves the next ring slot, waiting while `slots` ops are in flight.
  size_t reserve();
  void add(c10::intrusive_ptr<CudaWork> w);

 private:
  void loop();
  int device_;
  size_t slots_;
  std::function<void()> stalled_;
  std::mutex mu_;
  std::condition_variable work_cv_;  // the thread, parked, waits for an op
  std::condition_variable slot_cv_;  // reserve() waits for a free slot
  std::deque<c10::intrusive_ptr<CudaWork>> queue_;
  uint64_t reserved_ = 0, completed_ = 0;
  bool stop_ = false;
  bool parked_ = false;
  std::thread thread_;
};

}  // namespace moelink::cuda
