#include "staging.h"

#include <cuda.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <thread>

namespace moelink::cuda {

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

void StreamMemOps::waitAtLeast(cudaStream_t s, uint32_t* dev_word, uint32_t value) {
  static WaitValue32Fn fn = driverEntry<WaitValue32Fn>("cuStreamWaitValue32");
  checkDriver(fn(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(dev_word), value,
                 CU_STREAM_WAIT_VALUE_GEQ),
              "cuStreamWaitValue32");
}

// ---- ExchangeStaging ----

namespace {
std::vector<uint8_t> bytesOf(const void* p, size_t n) {
  auto* c = static_cast<const uint8_t*>(p);
  return {c, c + n};
}
}  // namespace

std::unique_ptr<ExchangeStaging> ExchangeStaging::open(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                       int size, const ExchangeTuning& tuning,
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
  // Room for every member (the kernels index sources by position among them, at most
  // kExchangeMaxRanks): a host's ranks of a larger group (the two-level route) fit too.
  s->layout_ = ExchangeLayout::make(std::min(size, kExchangeMaxRanks), tuning.round_bytes);
  s->areas_.assign(size, nullptr);
  cudaCheck(cudaMalloc(&s->areas_[rank], s->layout_.total), "cudaMalloc(staging)");
  cudaCheck(cudaMemset(s->areas_[rank], 0, s->layout_.total), "cudaMemset(staging)");
  // The handle, then the round size that shapes the area and the Lamport threshold that picks
  // the protocol: peers write into it before they have checked an op's header (exchange.cu,
  // lamport.cu), so every rank must lay it out and choose alike.
  cudaIpcMemHandle_t handle;
  cudaCheck(cudaIpcGetMemHandle(&handle, s->areas_[rank]), "cudaIpcGetMemHandle");
  std::vector<uint8_t> published = bytesOf(&handle, sizeof handle);
  const uint64_t shape[2] = {tuning.round_bytes, tuning.lamport_bytes};
  const std::vector<uint8_t> rb = bytesOf(shape, sizeof shape);
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
    if (h.size() != sizeof(cudaIpcMemHandle_t) + sizeof shape) {
      mine = "rank " + std::to_string(q) + " published a malformed handle";
      break;
    }
    uint64_t theirs[2] = {0, 0};
    std::memcpy(theirs, h.data() + sizeof(cudaIpcMemHandle_t), sizeof theirs);
    if (theirs[0] != shape[0]) {
      mine = "rank " + std::to_string(q) + " stages rounds of " + std::to_string(theirs[0]) + " bytes, rank " +
             std::to_string(rank) + " of " + std::to_string(shape[0]) +
             " (MOELINK_CUDA_ROUND_BYTES must be the same on every rank)";
      break;
    }
    if (theirs[1] != shape[1]) {
      mine = "rank " + std::to_string(q) + " sends pairs of up to " + std::to_string(theirs[1]) +
             " bytes by the Lamport protocol, rank " + std::to_string(rank) + " up to " + std::to_string(shape[1]) +
             " (MOELINK_CUDA_LAMPORT_BYTES must be the same on every rank)";
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

}  // namespace moelink::cuda
