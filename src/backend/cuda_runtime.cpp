#include "cuda_runtime.h"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda.h>
#include <sys/prctl.h>

#include <glog/logging.h>

#include <chrono>
#include <functional>
#include <thread>

#include "ep_work.h"

namespace moelink::backend {

void cudaCheck(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, "moelink CUDA collectives: ", what, " failed: ", cudaGetErrorString(e));
}

// ---- stream memory operations ----

namespace {

using WriteValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using WaitValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

template <typename Fn>
Fn driverEntry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
  cudaError_t e = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q);
  TORCH_CHECK(e == cudaSuccess && q == cudaDriverEntryPointSuccess && fn, "moelink: the CUDA driver offers no ",
              name, " (", cudaGetErrorString(e), ")");
  return reinterpret_cast<Fn>(fn);
}

void checkDriver(CUresult r, const char* what) {
  TORCH_CHECK(r == CUDA_SUCCESS, "moelink CUDA collectives: ", what, " failed (CUresult ", static_cast<int>(r), ")");
}

}  // namespace

void StreamMemOps::write(cudaStream_t s, uint32_t* dev_word, uint32_t value) {
  static WriteValue32Fn fn = driverEntry<WriteValue32Fn>("cuStreamWriteValue32");
  checkDriver(fn(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(dev_word), value,
                 CU_STREAM_WRITE_VALUE_DEFAULT),
              "cuStreamWriteValue32");
}

void StreamMemOps::wait(cudaStream_t s, uint32_t* dev_word, uint32_t value) {
  static WaitValue32Fn fn = driverEntry<WaitValue32Fn>("cuStreamWaitValue32");
  checkDriver(fn(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(dev_word), value,
                 CU_STREAM_WAIT_VALUE_EQ),
              "cuStreamWaitValue32");
}

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
      if (*code != collective::ExchangeStatus::kOk) {
        collective::ExchangeStatus s;
        std::memcpy(&s, w->status, sizeof s);
        if (s.peer >= 0 && s.peer < static_cast<int>(w->peers.size())) s.peer = w->peers[s.peer];
        error = collective::describeStatus(s, w->timeout_ms);
        *code = collective::ExchangeStatus::kOk;
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

// ---- ExchangeStaging ----

namespace {
std::vector<uint8_t> bytesOf(const void* p, size_t n) {
  auto* c = static_cast<const uint8_t*>(p);
  return {c, c + n};
}
}  // namespace

std::unique_ptr<ExchangeStaging> ExchangeStaging::open(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                       int size, const collective::ExchangeTuning& tuning,
                                                       std::string* why_not, const std::string& tag,
                                                       const std::vector<int>& members,
                                                       const std::function<bool()>& cancelled) {
  const std::string prefix = tag.empty() ? "moelink_cuda/" : "moelink_cuda/" + tag + "/";
  std::vector<int> who = members;
  if (who.empty())
    for (int q = 0; q < size; ++q) who.push_back(q);
  // Waits for a member's key: a blocking get, or, when the wait can be cancelled, a poll.
  auto fetch = [&](const std::string& key, std::vector<uint8_t>* v) {
    if (cancelled) {
      const auto deadline = std::chrono::steady_clock::now() + store->getTimeout();
      while (!store->check({key})) {
        if (cancelled()) return false;
        if (std::chrono::steady_clock::now() > deadline) return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    *v = store->get(key);
    return true;
  };
  std::unique_ptr<ExchangeStaging> s(new ExchangeStaging());
  s->rank_ = rank;
  s->layout_ = collective::ExchangeLayout::make(size, tuning.round_bytes);
  s->areas_.assign(size, nullptr);
  cudaCheck(cudaMalloc(&s->areas_[rank], s->layout_.total), "cudaMalloc(staging)");
  cudaCheck(cudaMemset(s->areas_[rank], 0, s->layout_.total), "cudaMemset(staging)");
  // The handle, then the round size that shapes the area: peers write into it before they
  // have checked an op's header (exchange.cu), so every rank must lay it out alike.
  cudaIpcMemHandle_t handle;
  cudaCheck(cudaIpcGetMemHandle(&handle, s->areas_[rank]), "cudaIpcGetMemHandle");
  std::vector<uint8_t> published = bytesOf(&handle, sizeof handle);
  const uint64_t round_bytes = tuning.round_bytes;
  const std::vector<uint8_t> rb = bytesOf(&round_bytes, sizeof round_bytes);
  published.insert(published.end(), rb.begin(), rb.end());
  store->set(prefix + "ipc/" + std::to_string(rank), published);
  std::string mine;
  for (int q : who) {
    if (q == rank || !mine.empty()) continue;
    std::vector<uint8_t> h;
    if (!fetch(prefix + "ipc/" + std::to_string(q), &h)) {
      if (why_not) *why_not = "rank " + std::to_string(q) + " did not set up its staging area";
      return nullptr;
    }
    if (h.size() != sizeof(cudaIpcMemHandle_t) + sizeof(uint64_t)) {
      mine = "rank " + std::to_string(q) + " published a malformed handle";
      break;
    }
    uint64_t theirs = 0;
    std::memcpy(&theirs, h.data() + sizeof(cudaIpcMemHandle_t), sizeof theirs);
    if (theirs != round_bytes) {
      mine = "rank " + std::to_string(q) + " stages rounds of " + std::to_string(theirs) + " bytes, rank " +
             std::to_string(rank) + " of " + std::to_string(round_bytes) +
             " (MOELINK_CUDA_ROUND_BYTES must be the same on every rank)";
      break;
    }
    cudaIpcMemHandle_t ph;
    std::memcpy(&ph, h.data(), sizeof ph);
    void* p = nullptr;
    cudaError_t e = cudaIpcOpenMemHandle(&p, ph, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      cudaGetLastError();
      mine = "rank " + std::to_string(rank) + " cannot map rank " + std::to_string(q) +
             "'s memory: " + cudaGetErrorString(e);
    } else {
      s->areas_[q] = static_cast<char*>(p);
    }
  }
  store->set(prefix + "ok/" + std::to_string(rank), bytesOf(mine.data(), mine.size()));
  std::string why;
  for (int q : who) {
    std::vector<uint8_t> v;
    if (!fetch(prefix + "ok/" + std::to_string(q), &v)) {
      if (why_not) *why_not = "rank " + std::to_string(q) + " did not finish setting up its staging area";
      return nullptr;
    }
    if (!v.empty() && why.empty()) why.assign(v.begin(), v.end());
  }
  if (!why.empty()) {
    if (why_not) *why_not = why;
    return nullptr;  // the destructor closes what was mapped
  }
  return s;
}

void ExchangeStaging::abortWaits() {
  // Counter::failed (exchange.cu) at counter + 12: the largest value fails every wait.
  static const uint32_t kAll = 0xffffffffu;
  cudaStream_t s = nullptr;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) return;
  cudaMemcpyAsync(areas_[rank_] + layout_.counter + 12, &kAll, sizeof kAll, cudaMemcpyHostToDevice, s);
  cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
}

ExchangeStaging::~ExchangeStaging() {
  for (size_t q = 0; q < areas_.size(); ++q) {
    if (!areas_[q]) continue;
    if (static_cast<int>(q) == rank_)
      cudaFree(areas_[q]);
    else
      cudaIpcCloseMemHandle(areas_[q]);
  }
}

}  // namespace moelink::backend
