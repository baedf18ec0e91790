#include "work.h"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <sys/prctl.h>

#include <glog/logging.h>

#include <chrono>
#include <functional>
#include <thread>

#include "staging.h"

namespace moelink::cuda {

// ---- HostOutcome ----

void HostOutcome::set(const std::string& error, int source) {
  {
    std::lock_guard<std::mutex> g(mu_);
    error_ = error;
    source_ = source;
    done_ = true;
  }
  cv_.notify_all();
}

std::string HostOutcome::wait() {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return done_; });
  return error_;
}

int HostOutcome::source() {
  wait();
  std::lock_guard<std::mutex> g(mu_);
  return source_;
}

// ---- CudaWork ----

// ---- EventPool ----

EventPool::~EventPool() {
  for (cudaEvent_t e : free_) cudaEventDestroy(e);
}

cudaEvent_t EventPool::take() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!free_.empty()) {
      cudaEvent_t e = free_.back();
      free_.pop_back();
      return e;
    }
  }
  c10::cuda::CUDAGuard dg(static_cast<c10::DeviceIndex>(device_));
  cudaEvent_t e = nullptr;
  cudaCheck(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  return e;
}

void EventPool::give(cudaEvent_t e) {
  std::lock_guard<std::mutex> g(mu_);
  free_.push_back(e);
}

// ---- CudaWork ----

PooledEvent::~PooledEvent() {
  if (pool_)
    pool_->give(e_);
  else
    cudaEventDestroy(e_);
}

CudaWork::CudaWork(int rank, c10d::OpType type, const char* title, std::vector<at::Tensor> outputs, int device,
                   std::shared_ptr<EventPool> events)
    : BackendWork(rank, type, title, std::move(outputs)),
      device_(device),
      end_(std::make_shared<PooledEvent>(std::move(events))) {}

CudaWork::~CudaWork() = default;

void CudaWork::complete(const std::string& error) {
  keep_.clear();
  settle(error);
}

void CudaWork::completeCaptured() {
  end_->retire();
  settle("");
}

void CudaWork::synchronize() {
  c10::cuda::CUDAStream cur = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_));
  if (cur.stream() == stream_) return;  // ordered after the op already
  cudaCheck(cudaStreamWaitEvent(cur.stream(), end_->get(), 0), "cudaStreamWaitEvent");
}

bool CudaWork::wait(std::chrono::milliseconds) {
  synchronize();
  std::lock_guard<std::mutex> g(mutex_);
  if (exception_) std::rethrow_exception(exception_);
  return true;
}

int CudaWork::sourceRank() const {
  // Known once the host-staged receive has completed (recv from any source).
  return host ? host->source() : -1;
}

// ---- Completer ----

Completer::Completer(int device, size_t slots, std::function<void()> stalled)
    : device_(device), slots_(slots), stalled_(std::move(stalled)) {
  thread_ = std::thread([this] { loop(); });
}

Completer::~Completer() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  thread_.join();
}

size_t Completer::reserve() {
  std::unique_lock<std::mutex> lk(mu_);
  slot_cv_.wait(lk, [&] { return reserved_ - completed_ < slots_; });
  return reserved_++ % slots_;
}

void Completer::add(c10::intrusive_ptr<CudaWork> w) {
  bool wake;
  {
    std::lock_guard<std::mutex> g(mu_);
    queue_.push_back(std::move(w));
    wake = parked_;
  }
  if (wake) work_cv_.notify_one();
}

namespace {

using Clock = std::chrono::steady_clock;

// The pause between two looks (for the next op, or at an op's event) after waiting `waited`:
// short at first, so that a short op completes promptly, longer as the wait goes on, so that a
// long one costs few wake-ups.
std::chrono::microseconds pauseAfter(Clock::duration waited) {
  using std::chrono::microseconds;
  using std::chrono::milliseconds;
  if (waited < microseconds(100)) return microseconds(5);
  if (waited < milliseconds(2)) return microseconds(20);
  if (waited < milliseconds(50)) return microseconds(100);
  return microseconds(200);
}

}  // namespace

void Completer::loop() {
  cudaSetDevice(device_);
  // Pauses of a few microseconds, not the default 50 us of timer slack.
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
  constexpr auto kLinger = std::chrono::milliseconds(2);  // looking for the next op before parking
  while (true) {
    c10::intrusive_ptr<CudaWork> w;
    {
      std::unique_lock<std::mutex> lk(mu_);
      const auto idle_since = Clock::now();
      while (queue_.empty() && !stop_) {
        const auto idle = Clock::now() - idle_since;
        if (idle < kLinger) {
          lk.unlock();
          std::this_thread::sleep_for(pauseAfter(idle));
          lk.lock();
          continue;
        }
        parked_ = true;
        work_cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        parked_ = false;
      }
      if (queue_.empty()) return;  // stop_ and nothing left
      w = std::move(queue_.front());
      queue_.pop_front();
    }
    std::string error;
    // Polled, so that a long wait can have the group check its peers (a dead peer otherwise
    // holds a kernel until its timeout).
    cudaError_t e;
    const auto since = Clock::now();
    auto next_watch = since + std::chrono::milliseconds(100);
    while (true) {
      e = cudaEventQuery(w->endEvent());
      if (e != cudaErrorNotReady) break;
      const auto now = Clock::now();
      if (stalled_ && now >= next_watch) {
        stalled_();
        next_watch = now + std::chrono::milliseconds(100);
      }
      std::this_thread::sleep_for(pauseAfter(now - since));
    }
    if (e != cudaSuccess) error = std::string("the GPU failed while running this op: ") + cudaGetErrorString(e);
    if (error.empty() && w->status) {
      auto* code = reinterpret_cast<volatile uint32_t*>(&w->status->code);
      if (*code != ExchangeStatus::kOk) {
        ExchangeStatus s;
        std::memcpy(&s, w->status, sizeof s);
        if (s.peer >= 0 && s.peer < static_cast<int>(w->peers.size())) s.peer = w->peers[s.peer];
        error = describeStatus(s, w->timeout_ms);
        *code = ExchangeStatus::kOk;
      }
    }
    // Receives and collectives: set already (the stream waited for it); sends: once delivered.
    if (error.empty() && w->host) {
      error = w->host->wait();
      w->setLost(w->host->lost);
    }
    if (!error.empty()) LOG(WARNING) << "moelink: " << error;
    w->complete(error);
    w.reset();
    {
      std::lock_guard<std::mutex> g(mu_);
      ++completed_;
    }
    slot_cv_.notify_all();
  }
}

}  // namespace moelink::cuda
