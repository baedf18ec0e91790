#include "moelink/backend/ep_backend.h"

#include <algorithm>
#include <numeric>
#include <set>
#include <condition_variable>

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "cuda_collectives.h"
#include "ep_work.h"
#include "moelink/backend/c10d_store.h"
#include "moelink/collective/worker.h"
#include "moelink/common/error.h"
#include "moelink/transfer/transfer_engine.h"

namespace moelink::backend {

using namespace std::chrono;

// ---- BackendWork, EpWork ----

BackendWork::BackendWork(int rank, c10d::OpType type, const char* title, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, type, title), outputs_(std::move(outputs)) {
  static const c10::TypePtr kListOfTensors = c10::ListType::create(c10::TensorType::get());
  future_ = c10::make_intrusive<c10::ivalue::Future>(kListOfTensors);
}

void BackendWork::settle(const std::string& error) {
  if (error.empty()) {
    future_->markCompleted(c10::IValue(outputs_));
    finish();
  } else {
    auto eptr = distBackendError(error);
    future_->setError(eptr);
    finish(eptr);
  }
  c10::intrusive_ptr<c10::ivalue::Future> f;
  {
    std::lock_guard<std::mutex> g(result_mu_);
    auto result = c10d::WorkResult::SUCCESS;
    if (!error.empty()) {
      // Timeouts read "...: Timed out ..." on every path (collectives, point-to-point, kernels).
      result = error.find(": Timed out") != std::string::npos ? c10d::WorkResult::TIMEOUT
                                                               : c10d::WorkResult::COMM_ERROR;
    }
    result_ = static_cast<uint8_t>(result);
    settled_ = true;
    f = result_future_;
  }
  if (f) f->markCompleted(c10::IValue(result_));
}

c10::intrusive_ptr<c10::ivalue::Future> BackendWork::getFutureResult() {
  bool mark = false;
  c10::intrusive_ptr<c10::ivalue::Future> f;
  {
    std::lock_guard<std::mutex> g(result_mu_);
    if (!result_future_) {
      result_future_ = c10::make_intrusive<c10::ivalue::Future>(c10::AnyEnumType::get());
      mark = settled_;  // completed before anyone asked: the new future is complete at once
    }
    f = result_future_;
  }
  if (mark) f->markCompleted(c10::IValue(result_));
  return f;
}

void EpWork::copyBack(const at::Tensor& dst, const at::Tensor& src) {
  keep(src);
  onSuccess([dst, src]() mutable { dst.copy_(src); });
}

void EpWork::complete(std::string error, int source_rank) {
  source_.store(source_rank);
  if (error.empty()) {
    try {
      at::NoGradGuard no_grad;
      for (auto& f : finishers_) f();
    } catch (const std::exception& e) {
      error = std::string("copying the results back failed: ") + e.what();
    }
  }
  finishers_.clear();
  keep_.clear();
  settle(error);
}

std::exception_ptr distBackendError(const std::string& what) {
  return std::make_exception_ptr(
      c10::DistBackendError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, "moelink " + what));
}

// ---- checks and staging ----

void checkTensor(const at::Tensor& t, const char* op) {
  TORCH_CHECK_VALUE(t.defined(), "moelink ", op, ": undefined tensor");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, "moelink ", op, ": only dense (strided) tensors are supported, got ",
                    t.layout());
}

DevicePlacement& DevicePlacement::add(const at::Tensor& t) {
  if (!t.defined()) return *this;
  const auto d = t.device();
  TORCH_CHECK_VALUE(d.is_cpu() || d.is_cuda(), "moelink ", op_, ": backend 'ep' runs collectives on CPU and CUDA "
                    "tensors; got a tensor on ", d);
  if (d.is_cpu()) {
    ++cpu_;
  } else {
    TORCH_CHECK_VALUE(device_ < 0 || device_ == d.index(), "moelink ", op_, ": tensors on two CUDA devices (cuda:",
                      device_, " and cuda:", d.index(), "); one op takes tensors of one device");
    device_ = d.index();
    ++cuda_;
  }
  TORCH_CHECK_VALUE(cpu_ == 0 || cuda_ == 0, "moelink ", op_, ": CPU and CUDA tensors mixed in one call; "
                    "pass tensors of one device");
  return *this;
}

DevicePlacement& DevicePlacement::add(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts) add(t);
  return *this;
}

DevicePlacement& DevicePlacement::add(const std::vector<std::vector<at::Tensor>>& lists) {
  for (const auto& l : lists) add(l);
  return *this;
}

void checkSingle(const std::vector<at::Tensor>& ts, const char* op) {
  TORCH_CHECK_VALUE(ts.size() == 1, "moelink ", op, ": expects exactly one tensor per process, got ",
                    ts.size());
  checkTensor(ts[0], op);
}

void checkList(const std::vector<at::Tensor>& list, const at::Tensor& like, int size, const char* op,
               const char* what) {
  TORCH_CHECK_VALUE(static_cast<int>(list.size()) == size, "moelink ", op, ": ", what,
                    " must hold one tensor per rank (", size, "), got ", list.size());
  for (const auto& t : list) {
    checkTensor(t, op);
    checkSameDtype(t, like, op);
    TORCH_CHECK_VALUE(t.numel() == like.numel(), "moelink ", op, ": every tensor in ", what, " must have ",
                      like.numel(), " elements (like the input), got ", t.numel());
  }
}

PairLayout alltoallLayout(const at::Tensor& input, const at::Tensor& output, const std::vector<int64_t>& in_splits,
                          const std::vector<int64_t>& out_splits, int size, int rank) {
  const char* name = "all_to_all_single";
  auto splits = [&](const at::Tensor& t, std::vector<int64_t> s, const char* which) {
    int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    if (s.empty()) {
      TORCH_CHECK_VALUE(rows % size == 0, "moelink ", name, ": ", which, " dim 0 (", rows,
                        ") is not divisible by the group size ", size, "; pass split sizes");
      s.assign(size, rows / size);
    }
    TORCH_CHECK_VALUE(static_cast<int>(s.size()) == size, "moelink ", name, ": ", which,
                      " split sizes need one entry per rank (", size, "), got ", s.size());
    int64_t sum = 0;
    for (int64_t v : s) {
      TORCH_CHECK_VALUE(v >= 0, "moelink ", name, ": negative split size ", v);
      sum += v;
    }
    TORCH_CHECK_VALUE(sum == rows, "moelink ", name, ": ", which, " split sizes sum to ", sum,
                      " but dim 0 is ", rows);
    return s;
  };
  auto is = splits(input, in_splits, "input");
  auto os = splits(output, out_splits, "output");
  int64_t in_rows = input.dim() == 0 ? 1 : input.size(0), out_rows = output.dim() == 0 ? 1 : output.size(0);
  uint64_t in_row = in_rows ? nbytes(input) / in_rows : 0, out_row = out_rows ? nbytes(output) / out_rows : 0;
  TORCH_CHECK_VALUE(in_rows == 0 || out_rows == 0 || in_row == out_row, "moelink ", name,
                    ": input and output rows differ in size (", in_row, " vs ", out_row, " bytes)");
  TORCH_CHECK_VALUE(is[rank] == os[rank], "moelink ", name, ": this rank sends itself ", is[rank],
                    " rows but expects ", os[rank]);
  PairLayout l;
  uint64_t so = 0, ro = 0;
  for (int r = 0; r < size; ++r) {
    l.send_bytes.push_back(static_cast<uint64_t>(is[r]) * in_row);
    l.recv_bytes.push_back(static_cast<uint64_t>(os[r]) * out_row);
    l.send_off.push_back(so);
    l.recv_off.push_back(ro);
    so += l.send_bytes.back();
    ro += l.recv_bytes.back();
  }
  return l;
}

PairLayout alltoallLayout(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs) {
  PairLayout l;
  uint64_t so = 0, ro = 0;
  for (size_t r = 0; r < inputs.size(); ++r) {
    l.send_bytes.push_back(nbytes(inputs[r]));
    l.recv_bytes.push_back(nbytes(outputs[r]));
    l.send_off.push_back(so);
    l.recv_off.push_back(ro);
    so += l.send_bytes.back();
    ro += l.recv_bytes.back();
  }
  return l;
}

void checkSameDtype(const at::Tensor& a, const at::Tensor& b, const char* op) {
  TORCH_CHECK_TYPE(a.scalar_type() == b.scalar_type(), "moelink ", op, ": dtype mismatch between ",
                   a.scalar_type(), " and ", b.scalar_type());
}

void checkRoot(int64_t root, int size, const char* op) {
  TORCH_CHECK_VALUE(root >= 0 && root < size, "moelink ", op, ": invalid root rank ", root,
                    " for a group of size ", size);
}

collective::DType toDType(at::ScalarType t) {
  using collective::DType;
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kDouble: return DType::kFloat64;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kChar: return DType::kInt8;
    case at::kShort: return DType::kInt16;
    case at::kInt: return DType::kInt32;
    case at::kLong: return DType::kInt64;
    case at::kByte: return DType::kUInt8;
    case at::kBool: return DType::kBool;
    case at::kComplexFloat: return DType::kComplex64;
    case at::kComplexDouble: return DType::kComplex128;
    default: return DType::kBytes;
  }
}

namespace {
// PREMUL_SUM's factor (nullptr for other ops, or one made without it).
const c10d::NCCLPreMulSumSupplement* preMulOf(const c10d::ReduceOp& op) {
  if (op.op_ != c10d::ReduceOp::PREMUL_SUM) return nullptr;
  return dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
}
}  // namespace

collective::ReduceOp toReduceOp(const c10d::ReduceOp& op, at::ScalarType t, const char* opname) {
  using collective::ReduceOp;
  ReduceOp r;
  switch (op.op_) {
    case c10d::ReduceOp::SUM: r = ReduceOp::kSum; break;
    case c10d::ReduceOp::AVG: r = ReduceOp::kAvg; break;
    case c10d::ReduceOp::PRODUCT: r = ReduceOp::kProduct; break;
    case c10d::ReduceOp::MIN: r = ReduceOp::kMin; break;
    case c10d::ReduceOp::MAX: r = ReduceOp::kMax; break;
    case c10d::ReduceOp::BAND: r = ReduceOp::kBand; break;
    case c10d::ReduceOp::BOR: r = ReduceOp::kBor; break;
    case c10d::ReduceOp::BXOR: r = ReduceOp::kBxor; break;
    case c10d::ReduceOp::PREMUL_SUM: {
      TORCH_CHECK_TYPE(at::isFloatingType(t) || at::isComplexType(t), "moelink ", opname,
                       ": PREMUL_SUM needs floating-point or complex tensors, got ", t);
      const auto* s = preMulOf(op);
      TORCH_CHECK_VALUE(s != nullptr, "moelink ", opname, ": PREMUL_SUM without its factor (make it with "
                        "torch.distributed._make_nccl_premul_sum)");
      TORCH_CHECK_VALUE(!s->tensor_factor.defined() || s->tensor_factor.numel() == 1, "moelink ", opname,
                        ": the PREMUL_SUM factor must be a one-element tensor");
      r = ReduceOp::kSum;
      break;
    }
    default:
      TORCH_CHECK_VALUE(false, "moelink ", opname, ": unsupported reduce op (custom reduce ops are not supported)");
  }
  collective::DType d = toDType(t);
  TORCH_CHECK_TYPE(d != collective::DType::kBytes, "moelink ", opname, ": cannot reduce dtype ", t);
  std::string why = collective::reduceUnsupportedReason(d, r);
  TORCH_CHECK_TYPE(why.empty(), "moelink ", opname, ": ", why);
  return r;
}

at::Tensor preMultiplied(const c10d::ReduceOp& op, const at::Tensor& x) {
  const auto* s = preMulOf(op);
  if (s == nullptr) return x;
  if (s->tensor_factor.defined()) return x * s->tensor_factor.to(x.device()).reshape({}).to(x.scalar_type());
  return x * s->double_factor;
}

void preMultiplyInPlace(const c10d::ReduceOp& op, at::Tensor& x) {
  const auto* s = preMulOf(op);
  if (s == nullptr) return;
  if (s->tensor_factor.defined())
    x.mul_(s->tensor_factor.to(x.device()).reshape({}).to(x.scalar_type()));
  else
    x.mul_(s->double_factor);
}

at::Tensor inplaceBuffer(EpWork& w, const at::Tensor& t) {
  if (t.is_contiguous()) {
    w.keep(t);
    return t;
  }
  at::Tensor buf = t.contiguous();
  w.copyBack(t, buf);
  return buf;
}

at::Tensor outputBuffer(EpWork& w, const at::Tensor& t) {
  if (t.is_contiguous()) {
    w.keep(t);
    return t;
  }
  at::Tensor buf = at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
  w.copyBack(t, buf);
  return buf;
}

at::Tensor inputBuffer(EpWork& w, const at::Tensor& t) {
  at::Tensor buf = t.contiguous();
  w.keep(buf);
  return buf;
}

uint64_t nbytes(const at::Tensor& t) { return static_cast<uint64_t>(t.numel()) * t.element_size(); }

// The tcp listener's address when nothing beyond this host can be in the group: every rank
// reached the store at a loopback address (a local launch: torchrun --standalone, or a
// TCPStore at 127.0.0.1 / localhost), the transport is automatic and MOELINK_HOST_IP is not
// set. Then the listener (probes, and tcp between ranks if shm is ruled out) binds 127.0.0.1
// and no port is open to the network. "" otherwise (the usual address).
static std::string localOnlyListener(const c10::intrusive_ptr<c10d::Store>& store) {
  if (const char* ip = std::getenv("MOELINK_HOST_IP"); ip && *ip) return "";
  if (const char* t = std::getenv("MOELINK_TRANSPORT"); t && *t && std::string(t) != "auto") return "";
  c10::intrusive_ptr<c10d::Store> s = store;
  while (auto* p = dynamic_cast<c10d::PrefixStore*>(s.get())) s = p->getUnderlyingStore();
  auto* tcp = dynamic_cast<c10d::TCPStore*>(s.get());
  if (tcp == nullptr) return "";
  const std::string host = tcp->getHost();
  const bool loopback = host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
  return loopback ? "127.0.0.1" : "";
}

// ---- the backend ----

namespace {

// The backends of this process that have not been destroyed (EpBackend::shutdownAll).
struct LiveBackends {
  std::mutex mu;
  std::set<EpBackend*> all;
};
LiveBackends& liveBackends() {
  static auto* b = new LiveBackends;  // never destroyed: backends may outlive static destruction
  return *b;
}

}  // namespace

EpBackend::EpBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                     milliseconds timeout, Options options)
    : c10d::Backend(rank, size),
      timeout_(timeout),
      options_(options),
      c10d_store_(store),
      store_(std::make_shared<C10dStore>(store)) {
  try {
    transfer::EngineOptions eo;
    eo.rank = rank;
    eo.world_size = size;
    eo.timeout = timeout;
    eo.extension = options.extension;
    eo.listen_ip = localOnlyListener(store);
    engine_ = std::make_unique<transfer::TransferEngine>(store_, eo);
    auto wo = collective::WorkerOptions::fromEnv(timeout);
    wo.raise_on_peer_failure = options.raise_on_peer_failure;
    wo.extension = options.extension;
    wo.initial_size = options.initial_size;
    worker_ = std::make_unique<collective::CollectiveWorker>(*engine_, *store_, wo);
  } catch (const moelink::Error& e) {
    TORCH_CHECK(false, "moelink: could not set up backend 'ep' (rank ", rank, " of ", size, "): ", e.what());
  }
  std::lock_guard<std::mutex> g(liveBackends().mu);
  liveBackends().all.insert(this);
}

EpBackend::~EpBackend() {
  {
    std::lock_guard<std::mutex> g(liveBackends().mu);
    liveBackends().all.erase(this);
  }
  shutdown();
}

void EpBackend::shutdownAll() {
  // NOTES: under the registry's lock, so that a backend being destroyed meanwhile waits in its
  // destructor (still whole) until this is done with it.
  std::lock_guard<std::mutex> g(liveBackends().mu);
  for (EpBackend* b : liveBackends().all) b->shutdown();
}

void EpBackend::shutdown() {
  std::lock_guard<std::mutex> once(shutdown_mu_);
  // The worker first: it fails what has not finished, which also releases GPU streams that
  // wait for host-staged ops; then the CUDA unit drains its streams; the engine last.
  worker_.reset();
  {
    std::lock_guard<std::mutex> g(cuda_mu_);
    cuda_.reset();
  }
  engine_.reset();
}

CudaCollectives& EpBackend::cuda() {
  std::lock_guard<std::mutex> g(cuda_mu_);
  TORCH_CHECK(worker_, "moelink: the 'ep' process group has been shut down");
  if (!cuda_) cuda_ = makeCudaCollectives(*this);
  return *cuda_;
}

std::string EpBackend::cudaPath() const {
  std::lock_guard<std::mutex> g(cuda_mu_);
  return cuda_ ? cuda_->path() : "";
}

std::string EpBackend::hostIdOf(int peer) const {
  TORCH_CHECK_VALUE(peer >= 0 && peer < size_, "moelink: rank ", peer, " is outside the group of size ", size_);
  TORCH_CHECK(engine_, "moelink: the 'ep' process group has been shut down");
  return engine_->hostIdOf(peer);
}

collective::CollectiveWorker& EpBackend::worker() const {
  TORCH_CHECK(worker_, "moelink: the 'ep' process group has been shut down");
  return *worker_;
}

milliseconds EpBackend::timeoutOf(milliseconds requested) const {
  return requested == c10d::kUnsetTimeout || requested.count() <= 0 ? timeout_ : requested;
}

c10::intrusive_ptr<c10d::Work> EpBackend::enqueue(c10::intrusive_ptr<EpWork> work,
                                                  std::function<collective::OpSpec(const collective::AlgoContext&)> build,
                                                  milliseconds timeout) {
  collective::CollectiveWorker* wk = &worker();
  wk->submit(collective::OpBuilder(std::move(build)),
             [work, wk](const std::string& err) {
               work->setLost(wk->opLost());
               work->complete(err);
             },
             timeout);
  return work;
}

std::vector<int32_t> EpBackend::activeMask() const {
  auto m = worker().mask();
  return std::vector<int32_t>(m.begin(), m.end());
}

uint64_t EpBackend::epoch() const { return worker().epoch(); }

std::optional<std::vector<int64_t>> EpBackend::lostRanksOf(const c10::intrusive_ptr<c10d::Work>& work) {
  auto* w = dynamic_cast<const LostRanks*>(work.get());
  if (!w) return std::nullopt;
  return w->lostRanks();
}

std::vector<int32_t> EpBackend::peerState(const std::vector<int64_t>& ranks) {
  std::vector<int32_t> out;
  for (int64_t r : ranks) {
    TORCH_CHECK_VALUE(r >= 0 && r < size_, "moelink get_peer_state: rank ", r, " is outside the group of size ", size_);
    try {
      out.push_back(worker().peerWaiting(static_cast<int>(r)) ? 1 : 0);
    } catch (const moelink::Error&) {  // its record cannot be read: not reachable, not waiting
      out.push_back(0);
    }
  }
  return out;
}

int64_t EpBackend::numSyncedRanks() {
  std::vector<int64_t> all(size_);
  for (int r = 0; r < size_; ++r) all[r] = r;
  auto state = peerState(all);
  return std::accumulate(state.begin(), state.end(), int64_t{0});
}

void EpBackend::recoverRanks(const std::vector<int64_t>& ranks) {
  std::vector<int> rs;
  for (int64_t r : ranks) {
    TORCH_CHECK_VALUE(r >= 0 && r < size_, "moelink recover_ranks: rank ", r, " is outside the group of size ", size_);
    TORCH_CHECK_VALUE(!worker().isActive(static_cast<int>(r)), "moelink recover_ranks: rank ", r, " is active");
    TORCH_CHECK_VALUE(std::find(rs.begin(), rs.end(), r) == rs.end(), "moelink recover_ranks: rank ", r, " is listed twice");
    rs.push_back(static_cast<int>(r));
  }
  if (rs.empty()) return;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::string error;
  worker().readmit(rs,
                   [&](const std::string& err) {
                     std::lock_guard<std::mutex> g(mu);
                     error = err;
                     done = true;
                     cv.notify_all();
                   },
                   timeout_);
  std::unique_lock<std::mutex> lk(mu);
  cv.wait(lk, [&] { return done; });
  TORCH_CHECK(error.empty(), "moelink recover_ranks: ", error);
}

std::string EpBackend::tcpAddress() const {
  TORCH_CHECK(engine_, "moelink: the 'ep' process group has been shut down");
  return engine_->tcpAddress();
}

std::string EpBackend::transportOf(int peer) const {
  TORCH_CHECK_VALUE(peer >= 0 && peer < size_, "moelink: rank ", peer, " is outside the group of size ", size_);
  return worker().transportTo(peer);
}

bool EpBackend::readsDirectly(int peer) const {
  TORCH_CHECK_VALUE(peer >= 0 && peer < size_, "moelink: rank ", peer, " is outside the group of size ", size_);
  return worker().peerReadsDirectly(peer);
}

std::vector<int64_t> EpBackend::activeRanks() const {
  std::vector<int64_t> r;
  for (int i = 0; i < size_; ++i)
    if (worker().isActive(i)) r.push_back(i);
  return r;
}

#ifndef MOELINK_WITH_CUDA
std::unique_ptr<CudaCollectives> makeCudaCollectives(EpBackend&) {
  TORCH_CHECK_VALUE(false, "moelink: this build of moelink has no CUDA support (nvcc was not found when it was "
                    "built); CUDA tensors cannot be used with backend 'ep'. Rebuild where nvcc is installed, or use "
                    "backend 'cpu:ep,cuda:nccl'");
}
#endif

}  // namespace moelink::backend
