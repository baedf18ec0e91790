#include "moelink/backend/tensor_checks.h"

#include <c10/util/Exception.h>

namespace moelink::backend {

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

uint64_t nbytes(const at::Tensor& t) { return static_cast<uint64_t>(t.numel()) * t.element_size(); }

at::Tensor blocksByRank(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs, int size) {
  std::vector<at::Tensor> pieces;
  for (int r = 0; r < size; ++r)
    for (size_t i = 0; i < inputs.size(); ++i) {
      const int64_t n = outputs[i].numel();
      pieces.push_back(inputs[i].reshape({-1}).narrow(0, r * n, n));
    }
  return at::cat(pieces);
}

void copyGatheredLists(const at::Tensor& gathered, std::vector<std::vector<at::Tensor>>& outputs,
                       const std::vector<at::Tensor>& inputs, int size) {
  const int64_t per_rank = gathered.numel() / size;
  for (int r = 0; r < size; ++r) {
    int64_t off = 0;
    for (size_t j = 0; j < inputs.size(); ++j) {
      const int64_t n = inputs[j].numel();
      outputs[r][j].copy_(gathered.narrow(0, r * per_rank + off, n).view(outputs[r][j].sizes()));
      off += n;
    }
  }
}

}  // namespace moelink::backend
