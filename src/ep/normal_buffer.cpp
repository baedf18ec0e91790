#include "moelink/ep/normal_buffer.h"

#include "moelink/common/error.h"
#include "moelink/common/settings.h"
#include "tensor_checks.h"

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace moelink::ep {

namespace {

void cudaCheck(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, "moelink normal-mode buffer: ", what, " failed: ", cudaGetErrorString(e));
}

uint64_t align(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

void checkCuda(const at::Tensor& t, const char* name, int device) {
  TORCH_CHECK_VALUE(t.is_cuda() && t.get_device() == device, "moelink normal mode: ", name,
                    " must be a CUDA tensor on device ", device, ", got ", t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), "moelink normal mode: ", name, " must be contiguous");
}

const char* errorWhat(int code) {
  switch (code) {
    case 1:
      return "the barrier that starts a call";
    case 2:
      return "ring space in dispatch (the peer stopped receiving)";
    case 3:
      return "dispatch data";
    case 4:
      return "ring space in combine (the peer stopped receiving)";
    default:
      return "combine data";
  }
}

}  // namespace

NormalBuffer::NormalBuffer(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, const std::string& key,
                           int64_t bytes, int64_t num_experts)
    : rank_(rank), size_(size), num_experts_(num_experts) {
  TORCH_CHECK_VALUE(size >= 1 && size <= normal::kMaxRanks, "moelink normal mode: the NVLink path serves up to ",
                    normal::kMaxRanks, " ranks, the group has ", size);
  TORCH_CHECK_VALUE(bytes > 0, "moelink normal mode: buffer bytes must be positive");
  try {
    default_timeout_us_ = static_cast<int64_t>(settings::number("MOELINK_EP_TIMEOUT_US"));
    use_tma_ = settings::flag("MOELINK_EP_TMA");
  } catch (const moelink::Error& e) {
    TORCH_CHECK_VALUE(false, "moelink normal mode: ", e.what());
  }
  cudaCheck(cudaGetDevice(&device_), "cudaGetDevice");
  bytes_ = align(static_cast<uint64_t>(bytes), 2u << 20);
  try {
    cudaCheck(cudaMalloc(&buffer_, bytes_), "cudaMalloc");
    cudaCheck(cudaMemset(buffer_, 0, bytes_), "cudaMemset");
    const size_t report_bytes = sizeof(normal::HostReport) + sizeof(int) * std::max<int64_t>(1, num_experts);
    cudaCheck(cudaHostAlloc(reinterpret_cast<void**>(&report_), report_bytes, cudaHostAllocMapped), "cudaHostAlloc");
    std::memset(static_cast<void*>(report_), 0, report_bytes);
    cudaCheck(cudaHostGetDevicePointer(reinterpret_cast<void**>(&report_dev_), report_, 0), "cudaHostGetDevicePointer");
    cudaIpcMemHandle_t handle;
    cudaCheck(cudaIpcGetMemHandle(&handle, buffer_), "cudaIpcGetMemHandle");
    const auto* hb = reinterpret_cast<const uint8_t*>(&handle);
    store->set(key + "/ipc/" + std::to_string(rank), std::vector<uint8_t>(hb, hb + sizeof handle));
    for (int r = 0; r < size; ++r) {
      if (r == rank) {
        peers_.base[r] = buffer_;
        continue;
      }
      auto b = store->get(key + "/ipc/" + std::to_string(r));
      TORCH_CHECK(b.size() == sizeof(cudaIpcMemHandle_t), "moelink normal mode: bad IPC handle from rank ", r);
      cudaIpcMemHandle_t ph;
      std::memcpy(&ph, b.data(), sizeof ph);
      void* p = nullptr;
      cudaCheck(cudaIpcOpenMemHandle(&p, ph, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
      peers_.base[r] = static_cast<char*>(p);
    }
    cudaCheck(cudaDeviceSynchronize(), "buffer setup");
    // Every rank has mapped every peer before any kernel writes (the store doubles as barrier).
    store->add(key + "/mapped", 1);
    const auto deadline = std::chrono::steady_clock::now() + store->getTimeout();
    while (store->add(key + "/mapped", 0) < size) {
      TORCH_CHECK(std::chrono::steady_clock::now() < deadline,
                  "moelink normal mode: timed out waiting for every rank to create its buffer (a collective call)");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  } catch (...) {
    release();  // the destructor does not run for a constructor that throws
    throw;
  }
}

NormalBuffer::~NormalBuffer() { release(); }

void NormalBuffer::release() noexcept {
  cudaDeviceSynchronize();
  for (int r = 0; r < size_; ++r)
    if (r != rank_ && peers_.base[r] != nullptr) cudaIpcCloseMemHandle(peers_.base[r]);
  if (buffer_ != nullptr) cudaFree(buffer_);
  if (report_ != nullptr) cudaFreeHost(report_);
  peers_ = normal::Peers{};
  buffer_ = nullptr;
  report_ = nullptr;
}

normal::RingLayout NormalBuffer::layoutFor(const NormalShape& shape, int64_t x_bytes, int64_t num_scales,
                                           int64_t num_topk) const {
  TORCH_CHECK_VALUE(shape.channels >= 1 && shape.channels <= normal::kMaxChannels,
                    "moelink normal mode: channels (num_sms / 2) must be 1..", normal::kMaxChannels, ", got ",
                    shape.channels);
  TORCH_CHECK_VALUE(shape.send_chunk >= 1 && shape.ring_tokens >= shape.send_chunk,
                    "moelink normal mode: num_max_nvl_chunked_recv_tokens (", shape.ring_tokens,
                    ") must be at least num_max_nvl_chunked_send_tokens (", shape.send_chunk, ")");
  auto L = normal::RingLayout::make(size_, static_cast<int>(shape.channels), static_cast<int>(shape.ring_tokens),
                                    static_cast<int>(x_bytes), static_cast<int>(num_scales),
                                    static_cast<int>(num_topk), static_cast<int>(num_experts_ / size_));
  TORCH_CHECK_VALUE(L.total <= bytes_, "moelink normal mode: this call needs ", L.total, " buffer bytes, the buffer has ",
                    bytes_);
  return L;
}

int64_t NormalBuffer::bytesNeeded(int64_t num_ranks, int64_t num_local_experts, const NormalShape& shape,
                                  int64_t x_bytes, int64_t num_scales, int64_t num_topk) {
  return static_cast<int64_t>(normal::RingLayout::make(static_cast<int>(num_ranks), static_cast<int>(shape.channels),
                                                       static_cast<int>(shape.ring_tokens), static_cast<int>(x_bytes),
                                                       static_cast<int>(num_scales), static_cast<int>(num_topk),
                                                       static_cast<int>(num_local_experts))
                                  .total);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> NormalBuffer::layout(const at::Tensor& topk_idx, int64_t num_experts,
                                                                     int64_t num_ranks) {
  TORCH_CHECK_VALUE(topk_idx.is_cuda() && topk_idx.scalar_type() == at::kLong && topk_idx.dim() == 2,
                    "moelink get_dispatch_layout: topk_idx must be an int64 [tokens, topk] CUDA tensor");
  TORCH_CHECK_VALUE(num_ranks >= 1 && num_ranks <= normal::kLayoutMaxRanks && num_experts >= num_ranks &&
                        num_experts <= normal::kLayoutMaxExperts && num_experts % num_ranks == 0,
                    "moelink get_dispatch_layout: the GPU layout takes up to ", normal::kLayoutMaxRanks, " ranks and ",
                    normal::kLayoutMaxExperts, " experts (a multiple of the ranks), got ", num_ranks, " and ",
                    num_experts);
  const at::Tensor idx = topk_idx.contiguous();
  auto iopt = idx.options().dtype(at::kInt);
  at::Tensor per_rank = at::zeros({num_ranks}, iopt);
  at::Tensor per_expert = at::zeros({num_experts}, iopt);
  at::Tensor in_rank = at::empty({idx.size(0), num_ranks}, idx.options().dtype(at::kBool));
  normal::LayoutArgs a;
  a.topk_idx = idx.data_ptr<int64_t>();
  a.num_tokens = static_cast<int>(idx.size(0));
  a.num_topk = static_cast<int>(idx.size(1));
  a.num_experts = static_cast<int>(num_experts);
  a.num_ranks = static_cast<int>(num_ranks);
  a.num_tokens_per_rank = per_rank.data_ptr<int>();
  a.num_tokens_per_expert = per_expert.data_ptr<int>();
  a.is_token_in_rank = in_rank.data_ptr<bool>();
  normal::layout(a, c10::cuda::getCurrentCUDAStream(idx.get_device()).stream());
  return {per_rank, per_expert, in_rank};
}

void NormalBuffer::barrier(const normal::RingLayout& L, int64_t timeout_us, cudaStream_t stream) {
  normal::PrepareArgs p;
  p.L = L;
  p.peers = peers_;
  p.rank = rank_;
  p.report = report_dev_;
  p.timeout_ns = timeoutNs(timeout_us);
  normal::prepare(p, stream);
}

int NormalBuffer::takeOverflow() {
  const int n = report_->overflow;
  if (n != 0) report_->overflow = 0;
  return n;
}

void NormalBuffer::raiseOverflow(int n) {
  if (n == 0) return;
  TORCH_CHECK_VALUE(false, "moelink normal mode: an earlier dispatch received ", n,
                    " tokens, more than its num_worst_tokens; the rows past num_worst_tokens were dropped, so its "
                    "outputs (and a combine of them) are incomplete. This call ran on every rank (the group stays in "
                    "step) and raises here because the GPU reported it since");
}

int64_t NormalBuffer::timeoutNs(int64_t timeout_us) const {
  const int64_t us = timeout_us < 0 ? default_timeout_us_ : timeout_us;
  return us * 1000;
}

void NormalBuffer::checkHealthy() {
  TORCH_CHECK(!broken_, "moelink normal mode: this buffer is unusable after an earlier call did not complete; "
              "create a new moelink.Buffer");
  const int code = report_->error;
  if (code != 0) {
    const int peer = report_->error_rank;
    broken_ = true;
    TORCH_CHECK(code != 6, "moelink normal mode: rank ", peer, " sent token counts that cannot be right (negative, or "
                "more than 2^30 rows in all): a corrupt or mismatched peer; nothing was placed by them and the buffer "
                "is unusable");
    TORCH_CHECK(false, "moelink normal mode: a kernel gave up waiting on rank ", peer, " for ", errorWhat(code),
                " (timeout_us / MOELINK_EP_TIMEOUT_US); its results are incomplete and the buffer is unusable");
  }
}

void NormalBuffer::checkDispatchInputs(const at::Tensor& x, const std::optional<at::Tensor>& scales,
                                       const std::optional<at::Tensor>& topk_idx,
                                       const std::optional<at::Tensor>& topk_weights, const at::Tensor& is_token_in_rank,
                                       const at::Tensor& num_tokens_per_expert) const {
  checkCuda(x, "x", device_);
  checkCuda(is_token_in_rank, "is_token_in_rank", device_);
  checkCuda(num_tokens_per_expert, "num_tokens_per_expert", device_);
  const int64_t T = x.size(0);
  const int64_t x_bytes = x.size(1) * x.element_size();
  TORCH_CHECK_VALUE(x.dim() == 2 && x_bytes % 16 == 0, "moelink normal mode: x rows must be a multiple of 16 bytes");
  checkAligned(x, "moelink normal mode: x");
  TORCH_CHECK_VALUE(is_token_in_rank.scalar_type() == at::kBool && is_token_in_rank.dim() == 2 &&
                        is_token_in_rank.size(0) == T && is_token_in_rank.size(1) == size_,
                    "moelink normal mode: is_token_in_rank must be bool [", T, ", ", size_, "]");
  TORCH_CHECK_VALUE(num_tokens_per_expert.scalar_type() == at::kInt && num_tokens_per_expert.numel() == num_experts_,
                    "moelink normal mode: num_tokens_per_expert must be int32 [", num_experts_, "]");
  if (scales) checkCuda(*scales, "scales", device_);
  if (topk_idx) {
    TORCH_CHECK_VALUE(topk_weights.has_value(), "moelink normal mode: topk_idx needs topk_weights");
    checkCuda(*topk_idx, "topk_idx", device_);
    checkCuda(*topk_weights, "topk_weights", device_);
  }
}

// Waits (on the host) for the notify launch `ticket` to report the received counts: the outputs
// are sized from them. Past twice the kernels' timeout the buffer is given up.
void NormalBuffer::waitForLayout(int ticket, int64_t timeout_us) {
  const int64_t limit_ns = timeoutNs(timeout_us) > 0 ? 2 * timeoutNs(timeout_us) : 0;
  const auto start = std::chrono::steady_clock::now();
  int spins = 0;
  while (report_->ticket != ticket && report_->error == 0) {
    if (++spins > 1024) std::this_thread::yield();
    if (limit_ns > 0 &&
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count() >
            limit_ns) {
      broken_ = true;
      TORCH_CHECK(false, "moelink normal mode: the layout exchange did not finish (is every rank calling "
                  "dispatch?); the buffer is unusable");
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  checkHealthy();
}

NormalDispatchResult NormalBuffer::dispatch(const at::Tensor& x, const std::optional<at::Tensor>& scales,
                                            const std::optional<at::Tensor>& topk_idx,
                                            const std::optional<at::Tensor>& topk_weights,
                                            const at::Tensor& is_token_in_rank,
                                            const at::Tensor& num_tokens_per_expert, const NormalShape& shape,
                                            int64_t num_worst_tokens, int64_t timeout_us) {
  checkHealthy();
  checkDispatchInputs(x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert);
  const int64_t T = x.size(0);
  const int64_t x_bytes = x.size(1) * x.element_size();
  const int64_t S = scales ? scales->size(1) : 0;
  const int64_t K = topk_idx ? topk_idx->size(1) : 0;
  auto L = layoutFor(shape, x_bytes, S, K);
  const int nle = static_cast<int>(num_experts_ / size_);
  auto stream = c10::cuda::getCurrentCUDAStream(device_).stream();
  auto iopt = at::TensorOptions().dtype(at::kInt).device(at::kCUDA, device_);
  NormalDispatchResult res;
  res.channel_prefix = at::empty({size_, shape.channels}, iopt);
  res.rank_prefix = at::empty({size_}, iopt);
  res.recv_channel_prefix = at::empty({size_, shape.channels + 1}, iopt);
  res.send_head = at::empty({T, size_}, iopt);

  normal::NotifyArgs n;
  n.L = L;
  n.peers = peers_;
  n.rank = rank_;
  n.ticket = ++ticket_;
  n.max_rows = static_cast<int>(std::max<int64_t>(num_worst_tokens, 0));
  n.num_tokens = static_cast<int>(T);
  n.num_experts = static_cast<int>(num_experts_);
  n.num_local_experts = nle;
  n.is_token_in_rank = is_token_in_rank.data_ptr<bool>();
  n.num_tokens_per_expert = num_tokens_per_expert.data_ptr<int>();
  n.channel_prefix = res.channel_prefix.data_ptr<int>();
  n.rank_prefix = res.rank_prefix.data_ptr<int>();
  n.recv_channel_prefix = res.recv_channel_prefix.data_ptr<int>();
  n.report = report_dev_;
  n.timeout_ns = timeoutNs(timeout_us);
  const int overflow = takeOverflow();  // reported before this call: raised after its launches
  normal::notify(n, stream);
  // num_worst_tokens: the outputs have that many rows and nothing waits on the host (the
  // received count stays on the device; a pad kernel fills the rest). Otherwise the host
  // needs the received count to size the outputs: it waits for the notify's report.
  const bool bounded = num_worst_tokens > 0;
  if (!bounded) {
    waitForLayout(n.ticket, timeout_us);
    res.num_recv = report_->num_recv;
    res.num_recv_per_expert.resize(nle);
    for (int e = 0; e < nle; ++e) res.num_recv_per_expert[e] = report_->per_expert[e];
  } else {
    res.num_recv = num_worst_tokens;  // rows of the outputs; the real count is rank_prefix[-1]
  }
  const int64_t rows = bounded ? num_worst_tokens : res.num_recv;
  res.recv_x = at::empty({rows, x.size(1)}, x.options());
  if (scales) res.recv_scales = at::empty({rows, S}, scales->options());
  if (topk_idx) {
    res.recv_topk_idx = at::empty({rows, K}, topk_idx->options());
    res.recv_topk_weights = at::empty({rows, K}, topk_weights->options());
  }
  res.recv_src_idx = at::empty({rows}, iopt);
  if (bounded) {
    normal::PadArgs p;
    p.num_ranks = static_cast<int>(size_);
    p.max_rows = static_cast<int>(rows);
    p.x_bytes = static_cast<int>(x_bytes);
    p.num_scales = static_cast<int>(S);
    p.num_topk = static_cast<int>(K);
    p.rank_prefix = res.rank_prefix.data_ptr<int>();
    p.recv_x = res.recv_x.data_ptr();
    p.recv_scales = scales ? res.recv_scales.data_ptr<float>() : nullptr;
    p.recv_topk_idx = topk_idx ? res.recv_topk_idx.data_ptr<int64_t>() : nullptr;
    p.recv_topk_weights = topk_idx ? res.recv_topk_weights.data_ptr<float>() : nullptr;
    p.recv_src_idx = res.recv_src_idx.data_ptr<int>();
    normal::pad(p, stream);
  }
  normal::DispatchArgs d;
  d.L = L;
  d.peers = peers_;
  d.rank = rank_;
  d.num_tokens = static_cast<int>(T);
  d.num_local_experts = nle;
  d.send_chunk = static_cast<int>(shape.send_chunk);
  d.x = x.data_ptr();
  d.scales = scales ? scales->data_ptr<float>() : nullptr;
  d.topk_idx = topk_idx ? topk_idx->data_ptr<int64_t>() : nullptr;
  d.topk_weights = topk_idx ? topk_weights->data_ptr<float>() : nullptr;
  d.is_token_in_rank = n.is_token_in_rank;
  d.channel_prefix = n.channel_prefix;
  d.rank_prefix = n.rank_prefix;
  d.recv_channel_prefix = n.recv_channel_prefix;
  d.recv_x = res.recv_x.data_ptr();
  d.recv_scales = scales ? res.recv_scales.data_ptr<float>() : nullptr;
  d.recv_topk_idx = topk_idx ? res.recv_topk_idx.data_ptr<int64_t>() : nullptr;
  d.recv_topk_weights = topk_idx ? res.recv_topk_weights.data_ptr<float>() : nullptr;
  d.recv_src_idx = res.recv_src_idx.data_ptr<int>();
  d.send_head = res.send_head.data_ptr<int>();
  d.report = report_dev_;
  d.timeout_ns = n.timeout_ns;
  d.max_rows = static_cast<int>(bounded ? rows : 0);
  normal::dispatch(d, stream);
  raiseOverflow(overflow);
  return res;
}

std::tuple<at::Tensor, std::optional<at::Tensor>> NormalBuffer::cachedDispatch(
    const at::Tensor& x, const std::optional<at::Tensor>& scales, const at::Tensor& is_token_in_rank,
    const at::Tensor& rank_prefix, const at::Tensor& channel_prefix, const at::Tensor& recv_channel_prefix,
    int64_t num_recv, int64_t num_out_rows, const NormalShape& shape, int64_t timeout_us) {
  checkHealthy();
  checkCuda(x, "x", device_);
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) * x.element_size() % 16 == 0,
                    "moelink normal mode: x rows must be a multiple of 16 bytes");
  checkAligned(x, "moelink normal mode: x");
  for (const at::Tensor* t : {&is_token_in_rank, &rank_prefix, &channel_prefix, &recv_channel_prefix})
    checkCuda(*t, "a handle tensor", device_);
  TORCH_CHECK_VALUE(is_token_in_rank.size(0) == x.size(0), "moelink normal mode: x has ", x.size(0),
                    " tokens, the handle's layout ", is_token_in_rank.size(0));
  TORCH_CHECK_VALUE(channel_prefix.size(1) == shape.channels, "moelink normal mode: the handle was made with ",
                    channel_prefix.size(1), " channels, this config has ", shape.channels,
                    " (a cached dispatch keeps the dispatch's num_sms)");
  const int64_t S = scales ? scales->size(1) : 0;
  if (scales) checkCuda(*scales, "scales", device_);
  auto L = layoutFor(shape, x.size(1) * x.element_size(), S, 0);
  auto stream = c10::cuda::getCurrentCUDAStream(device_).stream();
  const int overflow = takeOverflow();  // reported before this call: raised after its launches
  barrier(L, timeout_us, stream);
  at::Tensor recv_x = at::empty({num_out_rows, x.size(1)}, x.options());
  std::optional<at::Tensor> recv_scales;
  if (scales) recv_scales = at::empty({num_out_rows, S}, scales->options());
  auto send_head = at::empty({x.size(0), size_}, rank_prefix.options());  // rewritten, the same values
  auto src_idx = at::empty({num_out_rows}, rank_prefix.options());
  // num_recv < 0: a bounded (num_worst_tokens) dispatch's handle, whose count is on the device.
  const bool bounded = num_recv < 0;
  if (bounded) {
    normal::PadArgs p;
    p.num_ranks = static_cast<int>(size_);
    p.max_rows = static_cast<int>(num_out_rows);
    p.x_bytes = static_cast<int>(x.size(1) * x.element_size());
    p.num_scales = static_cast<int>(S);
    p.rank_prefix = rank_prefix.data_ptr<int>();
    p.recv_x = recv_x.data_ptr();
    p.recv_scales = scales ? recv_scales->data_ptr<float>() : nullptr;
    p.recv_src_idx = src_idx.data_ptr<int>();
    normal::pad(p, stream);
  } else if (num_out_rows > num_recv) {
    recv_x.narrow(0, num_recv, num_out_rows - num_recv).zero_();
    if (scales) recv_scales->narrow(0, num_recv, num_out_rows - num_recv).zero_();
  }
  normal::DispatchArgs d;
  d.L = L;
  d.peers = peers_;
  d.rank = rank_;
  d.num_tokens = static_cast<int>(x.size(0));
  d.num_local_experts = static_cast<int>(num_experts_ / size_);
  d.send_chunk = static_cast<int>(shape.send_chunk);
  d.x = x.data_ptr();
  d.scales = scales ? scales->data_ptr<float>() : nullptr;
  d.is_token_in_rank = is_token_in_rank.data_ptr<bool>();
  d.channel_prefix = channel_prefix.data_ptr<int>();
  d.rank_prefix = rank_prefix.data_ptr<int>();
  d.recv_channel_prefix = recv_channel_prefix.data_ptr<int>();
  d.recv_x = recv_x.data_ptr();
  d.recv_scales = scales ? recv_scales->data_ptr<float>() : nullptr;
  d.recv_src_idx = src_idx.data_ptr<int>();
  d.send_head = send_head.data_ptr<int>();
  d.report = report_dev_;
  d.timeout_ns = timeoutNs(timeout_us);
  d.max_rows = static_cast<int>(num_out_rows);
  normal::dispatch(d, stream);
  raiseOverflow(overflow);
  return {recv_x, recv_scales};
}

std::tuple<at::Tensor, std::optional<at::Tensor>> NormalBuffer::combine(
    const at::Tensor& x, const std::optional<at::Tensor>& topk_weights, const std::optional<at::Tensor>& bias0,
    const std::optional<at::Tensor>& bias1, const at::Tensor& rank_prefix, const at::Tensor& recv_channel_prefix,
    const at::Tensor& send_head, int64_t num_recv, const NormalShape& shape, int64_t timeout_us) {
  checkHealthy();
  checkCuda(x, "x", device_);
  TORCH_CHECK_VALUE(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(0) >= num_recv,
                    "moelink normal mode: combine's x must be bf16 [", num_recv, ", hidden]");
  TORCH_CHECK_VALUE(x.size(1) % 8 == 0, "moelink normal mode: combine's x rows must be a multiple of 16 bytes (hidden ",
                    x.size(1), " is not a multiple of 8)");
  checkAligned(x, "moelink normal mode: combine's x");
  for (const at::Tensor* t : {&rank_prefix, &recv_channel_prefix, &send_head}) checkCuda(*t, "a handle tensor", device_);
  TORCH_CHECK_VALUE(recv_channel_prefix.size(1) == shape.channels + 1, "moelink normal mode: the handle was made with ",
                    recv_channel_prefix.size(1) - 1, " channels, this config has ", shape.channels,
                    " (combine keeps the dispatch's num_sms)");
  const int64_t T = send_head.size(0);
  const int64_t K = topk_weights ? topk_weights->size(1) : 0;
  if (topk_weights) checkCuda(*topk_weights, "topk_weights", device_);
  for (const auto* b : {&bias0, &bias1})
    if (b->has_value()) {
      checkCuda(**b, "bias", device_);
      TORCH_CHECK_VALUE((*b)->scalar_type() == at::kBFloat16 && (*b)->size(0) == T && (*b)->size(1) == x.size(1),
                        "moelink normal mode: bias must be bf16 [", T, ", ", x.size(1), "]");
      checkAligned(**b, "moelink normal mode: bias");
    }
  auto L = layoutFor(shape, x.size(1) * 2, 0, K);
  auto stream = c10::cuda::getCurrentCUDAStream(device_).stream();
  const int overflow = takeOverflow();  // reported before this call: raised after its launches
  barrier(L, timeout_us, stream);
  at::Tensor out = at::empty({T, x.size(1)}, x.options());
  std::optional<at::Tensor> out_w;
  if (topk_weights) out_w = at::empty({T, K}, topk_weights->options());
  normal::CombineArgs c;
  c.L = L;
  c.peers = peers_;
  c.rank = rank_;
  c.num_tokens = static_cast<int>(T);
  c.send_chunk = static_cast<int>(shape.send_chunk);
  c.x = x.data_ptr();
  c.topk_weights = topk_weights ? topk_weights->data_ptr<float>() : nullptr;
  c.rank_prefix = rank_prefix.data_ptr<int>();
  c.recv_channel_prefix = recv_channel_prefix.data_ptr<int>();
  c.send_head = send_head.data_ptr<int>();
  c.bias0 = bias0 ? bias0->data_ptr() : nullptr;
  c.bias1 = bias1 ? bias1->data_ptr() : nullptr;
  c.out = out.data_ptr();
  c.out_weights = out_w ? out_w->data_ptr<float>() : nullptr;
  c.report = report_dev_;
  c.timeout_ns = timeoutNs(timeout_us);
  c.max_rows = static_cast<int>(x.size(0));
  c.bulk_warps = normal::bulkWarps(size_);
  c.piece_bytes = use_tma_ ? normal::bulkPieceBytes(size_ * c.bulk_warps, L.x_bytes) : 0;
  normal::combine(c, stream);
  raiseOverflow(overflow);
  return {out, out_w};
}

}  // namespace moelink::ep
