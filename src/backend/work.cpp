#include "moelink/backend/work.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "moelink/collective/worker.h"

namespace moelink::backend {

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

c10::intrusive_ptr<EpWork> submitToWorker(collective::CollectiveWorker& worker, c10::intrusive_ptr<EpWork> work,
                                          std::function<collective::OpSpec(const collective::AlgoContext&)> build,
                                          std::chrono::milliseconds timeout) {
  collective::CollectiveWorker* wk = &worker;
  wk->submit(collective::OpBuilder(std::move(build)),
             [work, wk](const std::string& err) {
               work->setLost(wk->opLost());
               work->complete(err);
             },
             timeout);
  return work;
}

std::exception_ptr distBackendError(const std::string& what) {
  return std::make_exception_ptr(
      c10::DistBackendError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, "moelink " + what));
}

}  // namespace moelink::backend
