// The CPU unit (collectives.h): each op stages its tensors into contiguous host buffers, is
// built as an OpSpec over them when the worker starts it (over the ranks active then), and
// completes its EpWork on the worker thread, copying staged outputs back first.
#include <ATen/ATen.h>

#include "moelink/backend/collectives.h"
#include "moelink/backend/work.h"
#include "moelink/collective/algorithms.h"
#include "moelink/collective/worker.h"

namespace moelink::backend {

namespace {

using c10d::OpType;
namespace algo = collective;
using Work = Collectives::Work;
using Tensors = Collectives::Tensors;

char* ptr(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

// A contiguous buffer holding `t`'s values; written back into `t` on success when `t` itself
// is not contiguous (for ops that update `t` in place).
at::Tensor inplaceBuffer(EpWork& w, const at::Tensor& t) {
  if (t.is_contiguous()) {
    w.keep(t);
    return t;
  }
  at::Tensor buf = t.contiguous();
  w.copyBack(t, buf);
  return buf;
}

// A contiguous buffer for an output; written back into `t` on success when needed.
at::Tensor outputBuffer(EpWork& w, const at::Tensor& t) {
  if (t.is_contiguous()) {
    w.keep(t);
    return t;
  }
  at::Tensor buf = at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
  w.copyBack(t, buf);
  return buf;
}

// A contiguous copy (or `t` itself) kept alive by the work.
at::Tensor inputBuffer(EpWork& w, const at::Tensor& t) {
  at::Tensor buf = t.contiguous();
  w.keep(buf);
  return buf;
}

// Flat contiguous buffer of the given tensors' values, in order.
at::Tensor concat(EpWork& w, const Tensors& ts) {
  Tensors flat;
  flat.reserve(ts.size());
  for (const auto& t : ts) flat.push_back(t.reshape({-1}));
  at::Tensor buf = ts.empty() ? at::empty({0}) : at::cat(flat);
  w.keep(buf);
  return buf;
}

// Copies consecutive slices of `flat` into `outs` on success.
void scatterBack(EpWork& w, const at::Tensor& flat, const Tensors& outs) {
  w.keep(flat);
  w.onSuccess([flat, outs]() mutable {
    int64_t off = 0;
    for (auto& o : outs) {
      o.copy_(flat.narrow(0, off, o.numel()).view(o.sizes()));
      off += o.numel();
    }
  });
}

class CpuCollectives final : public Collectives {
 public:
  explicit CpuCollectives(const GroupContext& g) : g_(g), rank_(g.rank), size_(g.size) {}

  Work broadcast(at::Tensor& t, int root, const Call& call) override {
    auto w = makeWork(OpType::BROADCAST, "ep:broadcast", {t});
    at::Tensor buf = inplaceBuffer(*w, t);
    return enqueue(w, call, [=](const algo::AlgoContext& c) {
      auto spec = algo::broadcastOp(c, ptr(buf), nbytes(buf), root);
      spec.dtype = toDType(buf.scalar_type());
      return spec;
    });
  }

  Work allreduce(Tensors& ts, ReduceOp op, const Call& call) override {
    const bool one = ts.size() == 1;
    auto w = one ? makeWork(OpType::ALLREDUCE, "ep:all_reduce", ts)
                 : makeWork(OpType::ALLREDUCE_COALESCED, "ep:all_reduce_coalesced", ts);
    at::Tensor buf;
    if (one) {
      buf = inplaceBuffer(*w, ts[0]);
    } else {
      buf = concat(*w, ts);
      scatterBack(*w, buf, ts);
    }
    return enqueue(w, call, [=](const algo::AlgoContext& c) {
      return algo::allreduceOp(c, ptr(buf), buf.numel(), toDType(buf.scalar_type()), op);
    });
  }

  Work reduce(at::Tensor& t, ReduceOp op, int root, const Call& call) override {
    auto w = makeWork(OpType::REDUCE, "ep:reduce", {t});
    at::Tensor buf = inplaceBuffer(*w, t);
    return enqueue(w, call, [=](const algo::AlgoContext& c) {
      return algo::reduceOp(c, ptr(buf), ptr(buf), buf.numel(), toDType(buf.scalar_type()), op, root);
    });
  }

  Work allgather(at::Tensor& output, at::Tensor& input, const Call& call) override {
    auto w = makeWork(OpType::_ALLGATHER_BASE, "ep:_all_gather_base", {output});
    at::Tensor in = inputBuffer(*w, input);
    at::Tensor out = outputBuffer(*w, output);
    return enqueue(w, call, allgatherOf(in, out));
  }

  Work allgather(Tensors& outputs, at::Tensor& input, const Call& call) override {
    auto w = makeWork(OpType::ALLGATHER, "ep:all_gather", outputs);
    at::Tensor in = inputBuffer(*w, input);
    at::Tensor flat = at::empty({in.numel() * size_}, in.options());
    scatterBack(*w, flat, outputs);
    return enqueue(w, call, allgatherOf(in, flat));
  }

  Work allgatherCoalesced(Tensors& outputs, Tensors& inputs, const Call& call) override {
    auto w = makeWork(OpType::COALESCED, "ep:allgather_into_tensor_coalesced", outputs);
    at::Tensor in = concat(*w, inputs);
    at::Tensor flat = at::empty({in.numel() * size_}, in.options());
    w->keep(flat);
    // flat is [rank][input 0 | input 1 | ...]; output i gathers every rank's input i.
    w->onSuccess([flat, outputs, inputs, size = size_]() mutable {
      int64_t per_rank = flat.numel() / size, off = 0;
      for (size_t i = 0; i < outputs.size(); ++i) {
        int64_t n = inputs[i].numel();
        at::Tensor src = flat.view({size, per_rank}).narrow(1, off, n);
        outputs[i].copy_(src.reshape(outputs[i].sizes()));
        off += n;
      }
    });
    return enqueue(w, call, allgatherOf(in, flat));
  }

  Work allgatherLists(std::vector<Tensors>& outputs, Tensors& inputs, const Call& call) override {
    Tensors all_out;
    for (const auto& list : outputs) all_out.insert(all_out.end(), list.begin(), list.end());
    auto w = makeWork(OpType::ALLGATHER_COALESCED, "ep:all_gather_coalesced", all_out);
    at::Tensor in = concat(*w, inputs);
    at::Tensor flat = at::empty({in.numel() * size_}, in.options());
    w->keep(flat);
    // outputs[r][j] <- flat[r][input j]: one all-gather of the concatenated inputs.
    w->onSuccess([flat, outputs, inputs, size = size_]() mutable {
      copyGatheredLists(flat, outputs, inputs, size);
    });
    return enqueue(w, call, allgatherOf(in, flat));
  }

  Work gather(Tensors& outputs, at::Tensor& input, int root, const Call& call) override {
    auto w = makeWork(OpType::GATHER, "ep:gather", outputs);
    at::Tensor in = inputBuffer(*w, input);
    at::Tensor flat;
    if (rank_ == root) {
      flat = at::empty({in.numel() * size_}, in.options());
      scatterBack(*w, flat, outputs);
    }
    return enqueue(w, call, [=](const algo::AlgoContext& c) {
      auto spec = algo::gatherOp(c, ptr(in), flat.defined() ? ptr(flat) : nullptr, nbytes(in), root);
      spec.dtype = toDType(in.scalar_type());
      return spec;
    });
  }

  Work scatter(at::Tensor& output, const Tensors& inputs, int root, const Call& call) override {
    auto w = makeWork(OpType::SCATTER, "ep:scatter", {output});
    at::Tensor in;
    if (rank_ == root) in = concat(*w, inputs);
    at::Tensor out = outputBuffer(*w, output);
    return enqueue(w, call, [=](const algo::AlgoContext& c) {
      auto spec = algo::scatterOp(c, in.defined() ? ptr(in) : nullptr, ptr(out), nbytes(out), root);
      spec.dtype = toDType(out.scalar_type());
      return spec;
    });
  }

  Work reduceScatter(at::Tensor& output, at::Tensor& input, ReduceOp op, const Call& call) override {
    auto w = makeWork(OpType::_REDUCE_SCATTER_BASE, "ep:_reduce_scatter_base", {output});
    at::Tensor in = inputBuffer(*w, input);
    at::Tensor out = outputBuffer(*w, output);
    return enqueue(w, call, reduceScatterOf(in, out, out.numel(), op));
  }

  Work reduceScatter(at::Tensor& output, Tensors& inputs, ReduceOp op, const Call& call) override {
    auto w = makeWork(OpType::REDUCE_SCATTER, "ep:reduce_scatter", {output});
    at::Tensor in = concat(*w, inputs);
    at::Tensor out = outputBuffer(*w, output);
    return enqueue(w, call, reduceScatterOf(in, out, out.numel(), op));
  }

  Work reduceScatterCoalesced(Tensors& outputs, Tensors& inputs, ReduceOp op, const Call& call) override {
    auto w = makeWork(OpType::COALESCED, "ep:reduce_scatter_tensor_coalesced", outputs);
    at::Tensor in = blocksByRank(inputs, outputs, size_);
    w->keep(in);
    const int64_t total = in.numel() / size_;
    at::Tensor out = at::empty({total}, in.options());
    scatterBack(*w, out, outputs);
    return enqueue(w, call, reduceScatterOf(in, out, total, op));
  }

  Work alltoall(at::Tensor& output, at::Tensor& input, const PairLayout& l, const Call& call) override {
    auto w = makeWork(OpType::ALLTOALL_BASE, "ep:all_to_all", {output});
    at::Tensor in = inputBuffer(*w, input);
    at::Tensor out = outputBuffer(*w, output);
    return enqueue(w, call, alltoallOf(in, out, l));
  }

  Work alltoall(Tensors& outputs, Tensors& inputs, const PairLayout& l, const Call& call) override {
    auto w = makeWork(OpType::ALLTOALL, "ep:all_to_all", outputs);
    at::Tensor in = concat(*w, inputs);
    const uint64_t ro = l.recv_off.back() + l.recv_bytes.back();
    at::Tensor flat = at::empty({static_cast<int64_t>(ro / inputs[0].element_size())}, inputs[0].options());
    scatterBack(*w, flat, outputs);
    return enqueue(w, call, alltoallOf(in, flat, l));
  }

  Work send(at::Tensor& t, int dst, int tag, const Call& call) override {
    auto w = makeWork(OpType::SEND, "ep:send", {t});
    at::Tensor in = inputBuffer(*w, t);
    g_.worker->send(dst, ptr(in), nbytes(in), tag, [w](const std::string& err) { w->complete(err); }, call.timeout);
    return w;
  }

  Work recv(at::Tensor& t, int src, int tag, const Call& call) override {
    auto w = src < 0 ? makeWork(OpType::RECVANYSOURCE, "ep:recvAnySource", {t}) : makeWork(OpType::RECV, "ep:recv", {t});
    at::Tensor out = outputBuffer(*w, t);
    g_.worker->recv(src, ptr(out), nbytes(out), tag, [w](const std::string& err, int from) { w->complete(err, from); },
                    call.timeout);
    return w;
  }

 private:
  using Build = std::function<collective::OpSpec(const algo::AlgoContext&)>;

  c10::intrusive_ptr<EpWork> makeWork(OpType type, const char* title, Tensors outputs) const {
    auto w = c10::make_intrusive<EpWork>(rank_, type, title, std::move(outputs));
    w->setGroupSize(size_);
    return w;
  }

  Work enqueue(c10::intrusive_ptr<EpWork> work, const Call& call, Build build) const {
    return submitToWorker(*g_.worker, std::move(work), std::move(build), call.timeout);
  }

  static Build allgatherOf(const at::Tensor& in, const at::Tensor& out) {
    return [=](const algo::AlgoContext& c) {
      auto spec = algo::allgatherOp(c, ptr(in), ptr(out), nbytes(in));
      spec.dtype = toDType(in.scalar_type());
      return spec;
    };
  }

  static Build reduceScatterOf(const at::Tensor& in, const at::Tensor& out, int64_t n, ReduceOp op) {
    return [=](const algo::AlgoContext& c) {
      return algo::reduceScatterOp(c, ptr(in), ptr(out), n, toDType(out.scalar_type()), op);
    };
  }

  static Build alltoallOf(const at::Tensor& in, const at::Tensor& out, const PairLayout& l) {
    return [=](const algo::AlgoContext& c) {
      auto spec = algo::alltoallOp(c, ptr(in), l.send_off, l.send_bytes, ptr(out), l.recv_off, l.recv_bytes);
      spec.dtype = toDType(in.scalar_type());
      return spec;
    };
  }

  GroupContext g_;
  const int rank_, size_;
};

}  // namespace

std::unique_ptr<Collectives> makeCpuCollectives(const GroupContext& group) {
  return std::make_unique<CpuCollectives>(group);
}

}  // namespace moelink::backend
