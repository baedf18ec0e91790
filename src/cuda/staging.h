// The in-host route's memory: pinned host words the GPU reaches, the stream memory operations
// that raise and wait on them, and the staging areas that the exchange kernels push into,
// allocated per rank and mapped by its peers over CUDA IPC.
#pragma once

#include <cuda_runtime_api.h>

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "moelink/cuda/exchange.h"

namespace moelink::cuda {

void cudaCheck(cudaError_t e, const char* what);

// Pinned host memory that the GPU reaches too (cudaHostAllocMapped): `n` zeroed T.
template <typename T>
class MappedArray {
 public:
  explicit MappedArray(size_t n) : n_(n) {
    cudaCheck(cudaHostAlloc(reinterpret_cast<void**>(&host_), n * sizeof(T), cudaHostAllocMapped), "cudaHostAlloc");
    std::memset(static_cast<void*>(host_), 0, n * sizeof(T));
    cudaCheck(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_), host_, 0), "cudaHostGetDevicePointer");
  }
  ~MappedArray() { cudaFreeHost(host_); }
  MappedArray(const MappedArray&) = delete;
  MappedArray& operator=(const MappedArray&) = delete;
  T* host(size_t i) const { return host_ + i; }
  T* dev(size_t i) const { return dev_ + i; }
  size_t size() const { return n_; }

 private:
  T* host_ = nullptr;
  T* dev_ = nullptr;
  size_t n_;
};

// cuStreamWriteValue32 / cuStreamWaitValue32, reached through the runtime's driver entry
// points so that the module does not link libcuda (it must import on machines without a GPU).
struct StreamMemOps {
  static void write(cudaStream_t s, uint32_t* dev_word, uint32_t value);
  // Waits until the word equals `value`.
  static void wait(cudaStream_t s, uint32_t* dev_word, uint32_t value);
  // Waits until the word is at least `value` (wrap-safe: (int32_t)(word - value) >= 0).
  static void waitAtLeast(cudaStream_t s, uint32_t* dev_word, uint32_t value);
};

// The in-host staging area: one device allocation per rank, laid out by ExchangeLayout and
// mapped by every other rank through CUDA IPC. open() is collective; it returns nullptr on
// every rank unless every rank could map every peer's area.
class ExchangeStaging {
 public:
  // Collective over `members` (sorted ranks of the group; empty: all): allocates this rank's
  // area, maps every member's. `tag` names the set of areas in the store ("" for the group's
  // first; after a membership change, the epoch, so that nobody reads a failed process's
  // handle). `cancelled` (polled while waiting for the members) gives up the wait.
  static std::unique_ptr<ExchangeStaging> open(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                               const ExchangeTuning& tuning,
                                               std::string* why_not, const std::string& tag = "",
                                               const std::vector<int>& members = {},
                                               const std::function<bool()>& cancelled = nullptr);
  ~ExchangeStaging();
  const ExchangeLayout& layout() const { return layout_; }
  char* area(int rank) const { return areas_[rank]; }
  // Makes running kernels give up their waits (at shutdown): written through a stream of its
  // own, since the group's streams may be the ones blocked.
  void abortWaits();

 private:
  ExchangeStaging() = default;
  ExchangeLayout layout_;
  int rank_ = 0;
  std::vector<char*> areas_;
};

}  // namespace moelink::cuda
