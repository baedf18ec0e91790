#include "moelink/backend/ep_backend.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "ep_work.h"
#include "moelink/backend/c10d_store.h"
#include "moelink/collective/worker.h"
#include "moelink/common/error.h"
#include "moelink/transfer/transfer_engine.h"

namespace moelink::backend {

using namespace std::chrono;

// ---- EpWork ----

EpWork::EpWork(int rank, c10d::OpType type, const char* title, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, type, title),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

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
  if (error.empty()) {
    future_->markCompleted(c10::IValue(outputs_));
    finish();
  } else {
    auto eptr = std::make_exception_ptr(
        c10::DistBackendError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, "moelink " + error));
    future_->setError(eptr);
    finish(eptr);
  }
}

// ---- checks and staging ----

void checkTensor(const at::Tensor& t, const char* op) {
  TORCH_CHECK_VALUE(t.defined(), "moelink ", op, ": undefined tensor");
  TORCH_CHECK_VALUE(t.device().is_cpu(), "moelink ", op,
                    ": backend 'ep' runs collectives on CPU tensors; got a tensor on ", t.device(),
                    " (CUDA tensors are not supported by this build's collectives: use "
                    "backend 'cpu:ep,cuda:nccl' or move the tensor to the CPU)");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, "moelink ", op, ": only dense (strided) tensors are supported, got ",
                    t.layout());
}

void checkSingle(const std::vector<at::Tensor>& ts, const char* op) {
  TORCH_CHECK_VALUE(ts.size() == 1, "moelink ", op, ": expects exactly one tensor per process, got ",
                    ts.size());
  checkTensor(ts[0], op);
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
    default:
      TORCH_CHECK_VALUE(false, "moelink ", opname, ": unsupported reduce op (PREMUL_SUM and custom "
                        "ops are not supported)");
  }
  collective::DType d = toDType(t);
  TORCH_CHECK_TYPE(d != collective::DType::kBytes, "moelink ", opname, ": cannot reduce dtype ", t);
  std::string why = collective::reduceUnsupportedReason(d, r);
  TORCH_CHECK_TYPE(why.empty(), "moelink ", opname, ": ", why);
  return r;
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

// ---- the backend ----

EpBackend::EpBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                     milliseconds timeout)
    : c10d::Backend(rank, size),
      timeout_(timeout),
      c10d_store_(store),
      store_(std::make_shared<C10dStore>(store)) {
  try {
    transfer::EngineOptions eo;
    eo.rank = rank;
    eo.world_size = size;
    eo.timeout = timeout;
    engine_ = std::make_unique<transfer::TransferEngine>(store_, eo);
    worker_ = std::make_unique<collective::CollectiveWorker>(
        *engine_, *store_, collective::WorkerOptions::fromEnv(timeout));
  } catch (const moelink::Error& e) {
    TORCH_CHECK(false, "moelink: could not set up backend 'ep' (rank ", rank, " of ", size, "): ", e.what());
  }
}

EpBackend::~EpBackend() { shutdown(); }

void EpBackend::shutdown() {
  worker_.reset();  // stops the worker thread first: it uses the engine
  engine_.reset();
}

collective::CollectiveWorker& EpBackend::worker() const {
  TORCH_CHECK(worker_, "moelink: the 'ep' process group has been shut down");
  return *worker_;
}

milliseconds EpBackend::timeoutOf(milliseconds requested) const {
  return requested == c10d::kUnsetTimeout || requested.count() <= 0 ? timeout_ : requested;
}

c10::intrusive_ptr<c10d::Work> EpBackend::enqueue(c10::intrusive_ptr<EpWork> work,
                                                  collective::OpSpec spec, milliseconds timeout) {
  worker().submit(std::move(spec), [work](const std::string& err) { work->complete(err); }, timeout);
  return work;
}

std::string EpBackend::transportOf(int peer) const {
  TORCH_CHECK_VALUE(peer >= 0 && peer < size_, "moelink: rank ", peer, " is outside the group of size ", size_);
  return worker().transportTo(peer);
}

std::vector<int64_t> EpBackend::activeRanks() const {
  std::vector<int64_t> r;
  for (int i = 0; i < size_; ++i)
    if (worker().isActive(i)) r.push_back(i);
  return r;
}

}  // namespace moelink::backend
