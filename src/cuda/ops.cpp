// The CUDA unit's ops (unit.h): each one's GPU-side preparation and its flat collective.
#include "unit.h"

namespace moelink::cuda {

// ---- the collectives ----

// The host pipeline's form of an all-gather / reduce-scatter over flat buffers.
CudaCollectives::Piped CudaCollectives::gatherPieces(const at::Tensor& in, const at::Tensor& out) {
  return [in, out](HostPipeline& p, const HostPipeline::Call& c) { p.allgather(c, ptr(in), ptr(out), nbytes(in)); };
}

void CudaCollectives::reduceScatterAny(Op& op, const at::Tensor& in, const at::Tensor& out, ReduceOp rop) {
  if (!inHost() && twoLevel()) {
    reduceScatterTwoLevel(op, in, out, rop);
    return;
  }
  const auto dt = toDType(out.scalar_type());
  const uint64_t count = static_cast<uint64_t>(out.numel());
  flat(op, exchangeReduceScatter(size_, rank_, count, dt, rop), in, out,
       [=](const algo::AlgoContext& c, char* i, char* o) { return algo::reduceScatterOp(c, i, o, count, dt, rop); },
       scatterPieces(in, out, rop));
}

void CudaCollectives::allgatherAny(Op& op, const at::Tensor& in, const at::Tensor& out) {
  if (!inHost() && twoLevel()) {
    allgatherTwoLevel(op, in, out);
    return;
  }
  flat(op, exchangeAllgather(size_, rank_, nbytes(in)), in, out,
       [=](const algo::AlgoContext& c, char* i, char* o) { return algo::allgatherOp(c, i, o, nbytes(in)); },
       gatherPieces(in, out));
}

CudaCollectives::Piped CudaCollectives::scatterPieces(const at::Tensor& in, const at::Tensor& out, ReduceOp rop) {
  return [in, out, rop](HostPipeline& p, const HostPipeline::Call& c) {
    p.reduceScatter(c, ptr(in), ptr(out), static_cast<uint64_t>(out.numel()), toDType(out.scalar_type()), rop);
  };
}

CudaCollectives::Piped CudaCollectives::alltoallPieces(const at::Tensor& in, const at::Tensor& out,
                                                       const PairLayout& l) {
  return [in, out, l](HostPipeline& p, const HostPipeline::Call& c) {
    p.alltoall(c, ptr(in), ptr(out), l.send_off, l.send_bytes, l.recv_off, l.recv_bytes);
  };
}

Work CudaCollectives::broadcast(at::Tensor& t, int root, const Call& call) {
  return run({"broadcast", OpType::BROADCAST, "ep:broadcast", true}, {t}, {t}, Route::kGroup, call, [&](Op& op) {
    at::Tensor buf = t.contiguous();
    broadcastFlat(op, buf, root);
    settle(t, buf);
  });
}

Work CudaCollectives::allreduce(Tensors& ts, ReduceOp rop, const Call& call) {
  const bool one = ts.size() == 1;
  Kind k = one ? Kind{"allreduce", OpType::ALLREDUCE, "ep:all_reduce", true}
               : Kind{"allreduce_coalesced", OpType::ALLREDUCE_COALESCED, "ep:all_reduce_coalesced", true};
  return run(k, ts, ts, Route::kGroup, call, [&](Op& op) {
    at::Tensor buf = one ? ts[0].contiguous() : flatten(ts);
    allreduceFlat(op, buf, rop);
    if (one)
      settle(ts[0], buf);
    else
      unflatten(buf, ts);
  });
}

Work CudaCollectives::reduce(at::Tensor& t, ReduceOp rop, int root, const Call& call) {
  return run({"reduce", OpType::REDUCE, "ep:reduce"}, {t}, {t}, Route::kGroup, call, [&](Op& op) {
    at::Tensor buf = t.contiguous();
    const auto dt = toDType(buf.scalar_type());
    const uint64_t count = static_cast<uint64_t>(buf.numel());
    flat(op, exchangeReduce(size_, rank_, count, dt, rop, root), buf, buf,
         [=](const algo::AlgoContext& c, char* in, char*) { return algo::reduceOp(c, in, in, count, dt, rop, root); });
    settle(t, buf);
  });
}

Work CudaCollectives::allgather(at::Tensor& output, at::Tensor& input, const Call& call) {
  Kind k{"all_gather_into_tensor", OpType::_ALLGATHER_BASE, "ep:_all_gather_base", true};
  return run(k, {output}, {input, output}, Route::kGroup, call, [&](Op& op) {
    at::Tensor in = input.contiguous(), out = contiguousOut(output);
    allgatherAny(op, in, out);
    settle(output, out);
  });
}

Work CudaCollectives::allgather(Tensors& outputs, at::Tensor& input, const Call& call) {
  return run({"allgather", OpType::ALLGATHER, "ep:all_gather", true}, outputs, joined(outputs, {input}),
             Route::kGroup, call, [&](Op& op) {
               at::Tensor in = input.contiguous();
               at::Tensor out = at::empty({in.numel() * size_}, in.options());
               allgatherAny(op, in, out);
               unflatten(out, outputs);
             });
}

Work CudaCollectives::allgatherCoalesced(Tensors& outputs, Tensors& inputs, const Call& call) {
  Kind k{"allgather_into_tensor_coalesced", OpType::COALESCED, "ep:allgather_into_tensor_coalesced", true};
  return run(k, outputs, joined(outputs, inputs), Route::kGroup, call, [&](Op& op) {
    at::Tensor in = flatten(inputs);
    at::Tensor out = at::empty({in.numel() * size_}, in.options());
    allgatherAny(op, in, out);
    // out is [rank][input 0 | input 1 | ...]; output i gathers every rank's input i.
    int64_t off = 0;
    for (size_t i = 0; i < outputs.size(); ++i) {
      int64_t n = inputs[i].numel();
      outputs[i].copy_(out.view({size_, in.numel()}).narrow(1, off, n).reshape(outputs[i].sizes()));
      off += n;
    }
  });
}

// outputs[r][j] <- rank r's inputs[j]: one all-gather of the concatenated inputs, then copies
// on the caller's current stream behind it.
Work CudaCollectives::allgatherLists(std::vector<Tensors>& outputs, Tensors& inputs, const Call& call) {
  at::Tensor in = flatten(inputs);
  at::Tensor out = at::empty({in.numel() * size_}, in.options());
  Work work = allgather(out, in, call);
  work->wait();  // the current stream waits for the op; the copies below follow it
  copyGatheredLists(out, outputs, inputs, size_);
  return work;
}

Work CudaCollectives::gather(Tensors& outputs, at::Tensor& input, int root, const Call& call) {
  return run({"gather", OpType::GATHER, "ep:gather"}, outputs, joined(outputs, {input}), Route::kGroup, call,
             [&](Op& op) {
               at::Tensor in = input.contiguous();
               at::Tensor out = rank_ == root ? at::empty({in.numel() * size_}, in.options()) : at::Tensor();
               flat(op, exchangeGather(size_, rank_, nbytes(in), root), in, out,
                    [=](const algo::AlgoContext& c, char* i, char* o) {
                      return algo::gatherOp(c, i, o, nbytes(in), root);
                    });
               if (rank_ == root) unflatten(out, outputs);
             });
}

Work CudaCollectives::scatter(at::Tensor& output, const Tensors& inputs, int root, const Call& call) {
  return run({"scatter", OpType::SCATTER, "ep:scatter"}, {output}, joined({output}, inputs), Route::kGroup, call,
             [&](Op& op) {
               at::Tensor in = rank_ == root ? flatten(inputs) : at::Tensor();
               at::Tensor out = contiguousOut(output);
               flat(op, exchangeScatter(size_, rank_, nbytes(out), root), in, out,
                    [=](const algo::AlgoContext& c, char* i, char* o) {
                      return algo::scatterOp(c, i, o, nbytes(out), root);
                    });
               settle(output, out);
             });
}

Work CudaCollectives::reduceScatter(at::Tensor& output, at::Tensor& input, ReduceOp rop, const Call& call) {
  Kind k{"reduce_scatter_tensor", OpType::_REDUCE_SCATTER_BASE, "ep:_reduce_scatter_base", true};
  return run(k, {output}, {input, output}, Route::kGroup, call, [&](Op& op) {
    at::Tensor in = input.contiguous(), out = contiguousOut(output);
    reduceScatterAny(op, in, out, rop);
    settle(output, out);
  });
}

Work CudaCollectives::reduceScatter(at::Tensor& output, Tensors& inputs, ReduceOp rop, const Call& call) {
  Kind k{"reduce_scatter", OpType::REDUCE_SCATTER, "ep:reduce_scatter", true};
  return run(k, {output}, joined({output}, inputs), Route::kGroup, call, [&](Op& op) {
    at::Tensor in = flatten(inputs), out = contiguousOut(output);
    reduceScatterAny(op, in, out, rop);
    settle(output, out);
  });
}

Work CudaCollectives::reduceScatterCoalesced(Tensors& outputs, Tensors& inputs, ReduceOp rop, const Call& call) {
  Kind k{"reduce_scatter_tensor_coalesced", OpType::COALESCED, "ep:reduce_scatter_tensor_coalesced", true};
  return run(k, outputs, joined(outputs, inputs), Route::kGroup, call, [&](Op& op) {
    at::Tensor in = blocksByRank(inputs, outputs, size_);
    at::Tensor out = at::empty({in.numel() / size_}, in.options());
    reduceScatterAny(op, in, out, rop);
    unflatten(out, outputs);
  });
}

Work CudaCollectives::alltoall(at::Tensor& output, at::Tensor& input, const PairLayout& l, const Call& call) {
  Kind k{"all_to_all_single", OpType::ALLTOALL_BASE, "ep:all_to_all", true};
  return run(k, {output}, {input, output}, Route::kGroup, call, [&](Op& op) {
    at::Tensor in = input.contiguous(), out = contiguousOut(output);
    // In place with pairs laid out differently in the output: rows that arrive would land on
    // input still to be sent, so it is sent from a copy.
    if (overlapping(in, out) && (l.send_off != l.recv_off || l.send_bytes != l.recv_bytes)) in = in.clone();
    flat(op, exchangeAlltoall(size_, rank_, l.send_off, l.send_bytes, l.recv_off, l.recv_bytes), in, out,
         [=](const algo::AlgoContext& c, char* i, char* o) {
           return algo::alltoallOp(c, i, l.send_off, l.send_bytes, o, l.recv_off, l.recv_bytes);
         },
         alltoallPieces(in, out, l), true);
    settle(output, out);
  });
}

Work CudaCollectives::alltoall(Tensors& outputs, Tensors& inputs, const PairLayout& l, const Call& call) {
  return run({"all_to_all", OpType::ALLTOALL, "ep:all_to_all", true}, outputs, joined(outputs, inputs),
             Route::kGroup, call, [&](Op& op) {
               at::Tensor in = flatten(inputs);
               const uint64_t total = l.recv_off.back() + l.recv_bytes.back();
               at::Tensor out = at::empty({static_cast<int64_t>(total / in.element_size())}, in.options());
               flat(op,
                    exchangeAlltoall(size_, rank_, l.send_off, l.send_bytes, l.recv_off, l.recv_bytes),
                    in, out, [=](const algo::AlgoContext& c, char* i, char* o) {
                      return algo::alltoallOp(c, i, l.send_off, l.send_bytes, o, l.recv_off, l.recv_bytes);
                    },
                    alltoallPieces(in, out, l), true);
               unflatten(out, outputs);
             });
}

// ---- point to point: host-staged in every group ----

Work CudaCollectives::send(at::Tensor& t, int dst, int tag, const Call& call) {
  return run({"send", OpType::SEND, "ep:send"}, {t}, {t}, Route::kHost, call, [&](Op& op) {
    at::Tensor pin = pinnedLike(t);
    pin.copy_(t, /*non_blocking=*/true);
    op.work->keep(pin);
    const uint32_t ticket = raiseReady(op);
    auto done = doneCallback(op, ticket);
    g_.worker->send(dst, ptr(pin), nbytes(pin), tag, [done](const std::string& err) { done(err, -1); },
                     call.timeout, readyGate(op, ticket));
  });
}

Work CudaCollectives::recv(at::Tensor& t, int src, int tag, const Call& call) {
  Kind k = src < 0 ? Kind{"recv", OpType::RECVANYSOURCE, "ep:recvAnySource"} : Kind{"recv", OpType::RECV, "ep:recv"};
  return run(k, {t}, {t}, Route::kHostRecv, call, [&](Op& op) {
    at::Tensor pin = pinnedLike(t);
    op.work->keep(pin);
    const uint32_t ticket = nextTicket();
    g_.worker->recv(src, ptr(pin), nbytes(pin), tag, doneCallback(op, ticket), call.timeout);
    StreamMemOps::wait(op.stream->stream(), done_->dev(op.slot), ticket);
    t.copy_(pin, /*non_blocking=*/true);
  });
}

namespace {

const bool registered = backend::registerCollectives(c10::DeviceType::CUDA, [](const GroupContext& g) {
  return std::make_unique<CudaCollectives>(g);
});

}  // namespace

}  // namespace moelink::cuda
