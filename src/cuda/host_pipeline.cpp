// The host route's pipeline (host_pipeline.h).
#include "host_pipeline.h"

#include <algorithm>
#include <functional>
#include <optional>

#include <glog/logging.h>

#include "moelink/common/settings.h"

namespace moelink::cuda {

using collective::AlgoContext;
using collective::DType;
using collective::OpKind;
using collective::OpSpec;
using collective::ReduceOp;

namespace {

void copyAsync(void* dst, const void* src, uint64_t bytes, cudaMemcpyKind kind, cudaStream_t s) {
  if (bytes == 0 || dst == src) return;
  cudaCheck(cudaMemcpyAsync(dst, src, bytes, kind, s), "cudaMemcpyAsync (host route)");
}

// `rows` rows of `width` bytes; nothing when empty.
void copy2DAsync(void* dst, uint64_t dpitch, const void* src, uint64_t spitch, uint64_t width, uint64_t rows,
                 cudaMemcpyKind kind, cudaStream_t s) {
  if (width == 0 || rows == 0) return;
  cudaCheck(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, rows, kind, s), "cudaMemcpy2DAsync (host route)");
}

// The stream's side of an op of one exchange per piece: the first `depth` pieces are packed,
// then piece p is consumed (`consume` waits for its done word) and its slot packed with piece
// p + depth.
void streamPieces(const std::vector<HostPiece>& ps, int depth, const std::function<void(const HostPiece&)>& pack,
                  const std::function<void(const HostPiece&)>& consume) {
  for (size_t p = 0; p < ps.size() && p < static_cast<size_t>(depth); ++p) pack(ps[p]);
  for (size_t p = 0; p < ps.size(); ++p) {
    consume(ps[p]);
    if (p + depth < ps.size()) pack(ps[p + depth]);
  }
}

}  // namespace

HostPipelineTuning HostPipelineTuning::fromEnv() {
  HostPipelineTuning t;
  t.min_bytes = settings::number("MOELINK_HOST_PIPELINE_BYTES");
  t.slot_bytes = settings::number("MOELINK_HOST_PIECE_BYTES") / 16 * 16;
  t.depth = static_cast<int>(settings::number("MOELINK_HOST_PIECES"));
  t.min_piece = settings::number("MOELINK_HOST_MIN_PIECE_BYTES");
  return t;
}

// A captured op: what its host node hands the worker at each replay.
struct HostPipeline::Batch {
  HostPipeline* owner = nullptr;
  Builder build;
  collective::OpCallback finish;
  std::chrono::milliseconds timeout{0};
  std::vector<Mark> marks;
};

HostPipeline::HostPipeline(collective::CollectiveWorker* worker, int rank, int size, const HostPipelineTuning& t)
    : worker_(worker), rank_(rank), size_(size), tuning_(t) {
  out_bytes_ = PieceRing::outBytes(tuning_.slot_bytes, size_);
  slot_stride_ = (tuning_.slot_bytes + out_bytes_ + 4095) / 4096 * 4096;
  ring_ = std::make_unique<MappedArray<char>>(slot_stride_ * static_cast<uint64_t>(tuning_.depth));
  ready_ = std::make_unique<MappedArray<uint32_t>>(2 * static_cast<size_t>(words()));
  done_ = std::make_unique<MappedArray<uint32_t>>(2 * static_cast<size_t>(words()));
  last_.assign(static_cast<size_t>(words()), 0);
  plans_ = std::make_unique<MappedArray<RowsPlan>>(static_cast<size_t>(tuning_.depth));
}

HostPipeline::~HostPipeline() = default;

PieceRing HostPipeline::ring() const {
  PieceRing r;
  r.base = ring_->host(0);
  r.slot_stride = slot_stride_;
  r.slot_bytes = tuning_.slot_bytes;
  r.plans = plans_->host(0);
  r.ready = ready_->host(0);
  r.done = done_->host(0);
  return r;
}

char* HostPipeline::inDev(int slot) const { return ring_->dev(slot_stride_ * static_cast<uint64_t>(slot)); }
char* HostPipeline::outDev(int slot) const { return inDev(slot) + tuning_.slot_bytes; }

HostPipeline::Mark HostPipeline::mark(const Call& c, int word) {
  const uint32_t ticket = ++ticket_ ? ticket_ : ++ticket_;  // never 0 (the words start at 0)
  if (c.captured) return {words() + word, ticket};  // reset at each replay (replay())
  // An eager op's word that has not been used for a long while would compare wrongly with
  // the new ticket (the comparisons are wrap-safe within 2^31): set it just below the ticket
  // (the op that used it last is long over).
  uint32_t& last = last_[word];
  if (ticket - last >= (1u << 30)) {
    __atomic_store_n(ready_->host(word), ticket - 1, __ATOMIC_RELEASE);
    __atomic_store_n(done_->host(word), ticket - 1, __ATOMIC_RELEASE);
  }
  last = ticket;
  return {word, ticket};
}

void HostPipeline::raiseReady(cudaStream_t s, Mark m) const { StreamMemOps::write(s, ready_->dev(m.word), m.ticket); }

void HostPipeline::waitDone(cudaStream_t s, Mark m) const { StreamMemOps::waitAtLeast(s, done_->dev(m.word), m.ticket); }

void HostPipeline::submit(const Call& c, OpKind kind, Builder build, std::vector<Mark> marks) {
  // Whatever way the op ends, the stream must get past its waits: on a failure every done
  // word goes to the op's last ticket for it (the waits are "at least").
  std::vector<Mark> last;
  for (const Mark& m : marks) {
    auto it = std::find_if(last.begin(), last.end(), [&](const Mark& l) { return l.word == m.word; });
    if (it == last.end())
      last.push_back(m);
    else
      it->ticket = m.ticket;  // marks come in ticket order
  }
  // The op starts (and its deadline runs) once its first piece is in place, as a one-shot
  // op's waits for its data (the stream may still be busy with earlier work).
  build = [build = std::move(build), first = readyGate(ring(), marks.front())](const AlgoContext& ctx) {
    OpSpec op = build(ctx);
    op.ready = first;
    return op;
  };
  MappedArray<uint32_t>* done_words = done_.get();
  collective::CollectiveWorker* worker = worker_;
  Done done = c.done;
  const char* name = collective::opKindName(kind);
  collective::OpCallback finish = [last, done_words, worker, done, name](const std::string& err) {
    if (!err.empty())
      for (const Mark& m : last) __atomic_store_n(done_words->host(m.word), m.ticket, __ATOMIC_RELEASE);
    if (done)
      done(err, worker->opLost());
    else if (!err.empty())
      LOG(WARNING) << "moelink: a CUDA graph's " << name << " over the host route failed; its outputs are not "
                   << "defined: " << err;
  };
  if (!c.captured) {
    worker_->submit(collective::OpBuilder(std::move(build)), std::move(finish), c.timeout);
    return;
  }
  auto b = std::make_unique<Batch>();
  b->owner = this;
  b->build = std::move(build);
  b->finish = std::move(finish);
  b->timeout = c.timeout;
  b->marks = std::move(marks);
  cudaCheck(cudaLaunchHostFunc(c.stream, &HostPipeline::replay, b.get()), "cudaLaunchHostFunc (host route)");
  batches_.push_back(std::move(b));
}

void CUDART_CB HostPipeline::replay(void* p) {
  auto* b = static_cast<Batch*>(p);
  HostPipeline* self = b->owner;
  // The stream is past the previous op's waits, and the worker past its steps: this replay's
  // tickets (fixed at capture, in increasing order) start from words just below the first, so
  // that the wrap-safe comparisons hold however far the counter has moved since.
  const uint32_t below = b->marks.front().ticket - 1;
  for (const Mark& m : b->marks) {
    __atomic_store_n(self->ready_->host(m.word), below, __ATOMIC_RELEASE);
    __atomic_store_n(self->done_->host(m.word), below, __ATOMIC_RELEASE);
  }
  try {
    self->worker_->submit(collective::OpBuilder(b->build), b->finish, b->timeout);
  } catch (const std::exception& e) {
    b->finish(std::string("the worker did not take the op: ") + e.what());
  }
}

void HostPipeline::launchReduce(cudaStream_t s, char* out, int slot, const char* mine, uint32_t ticket,
                                uint64_t max_len, DType t, ReduceOp op) {
  RowsReduce r;
  r.out = out;
  r.rows = outDev(slot);
  r.mine = mine;
  r.plan = plans_->dev(slot);
  r.ticket = ticket;
  r.max_len = max_len;
  r.rows_bytes = out_bytes_;
  r.max_rows = size_;
  r.dtype = t;
  r.op = op;
  cudaCheck(launchRowsReduce(r, s), "launching the host route's reduction");
}

// ---- the ops ----

void HostPipeline::allreduce(const Call& c, char* buf, uint64_t count, DType t, ReduceOp rop,
                             const RailStep* rail) {
  const uint64_t e = collective::elementSize(t);
  const int depth = tuning_.depth;
  const bool one = allreduceInOneExchange(rail ? static_cast<int>(rail->rail.size()) : size_);
  const std::vector<HostPiece> ps = cutPieces(count, allreducePieceElems(e, budget(count * e)), depth, !one,
                                              [&](int word) { return mark(c, word); });
  std::vector<Mark> marks;
  for (const HostPiece& pc : ps) {
    marks.push_back(pc.first);
    if (!one) marks.push_back(pc.second);
  }
  submit(c, OpKind::kAllreduce,
         [r = ring(), ps, count, t, rop, world = size_, rank = rank_, one,
          step = rail ? std::make_optional(*rail) : std::nullopt](const AlgoContext& ctx) {
           return step ? railAllreducePieces(ctx, r, ps, count, t, rop, world, rank, *step, one)
                       : allreducePieces(ctx, r, ps, count, t, rop, world, rank, one);
         },
         std::move(marks));
  const cudaStream_t s = c.stream;
  auto pack = [&](const HostPiece& pc) {
    copyAsync(inHost(pc.slot), buf + pc.off * e, pc.len * e, cudaMemcpyDeviceToHost, s);
    raiseReady(s, pc.first);
  };
  if (one) {
    // The other rank's piece arrives whole: reduced with this rank's, in place on the GPU.
    streamPieces(ps, depth, pack, [&](const HostPiece& pc) {
      waitDone(s, pc.first);
      launchReduce(s, buf + pc.off * e, pc.slot, buf + pc.off * e, pc.first.ticket, pc.len * e, t, rop);
    });
    return;
  }
  // Piece p's block is reduced (and its all-gather let go) as soon as its reduce-scatter is
  // in, ahead of the wait for piece p-1's all-gather: the wire need not wait for the stream.
  auto reduce = [&](const HostPiece& pc) {
    waitDone(s, pc.first);
    launchReduce(s, inDev(pc.slot), pc.slot, buf + pc.off * e, pc.first.ticket, pc.len * e, t, rop);
    raiseReady(s, pc.second);
  };
  for (size_t p = 0; p < ps.size() && p < static_cast<size_t>(depth); ++p) pack(ps[p]);
  reduce(ps[0]);
  for (size_t p = 0; p < ps.size(); ++p) {
    const HostPiece& pc = ps[p];
    if (p + 1 < ps.size()) reduce(ps[p + 1]);
    waitDone(s, pc.second);
    copyAsync(buf + pc.off * e, inHost(pc.slot), pc.len * e, cudaMemcpyHostToDevice, s);
    if (p + depth < ps.size()) pack(ps[p + depth]);
  }
}

void HostPipeline::reduceScatter(const Call& c, const char* in, char* out, uint64_t count, DType t, ReduceOp rop,
                                 const RailStep* rail) {
  const uint64_t e = collective::elementSize(t);
  // The rows: one per rank of the group, or of the rail; this rank's among them.
  const int rows = rail ? static_cast<int>(rail->rail.size()) : size_;
  const int mine = rail ? static_cast<int>(std::find(rail->rail.begin(), rail->rail.end(), rank_) - rail->rail.begin())
                        : rank_;
  const uint64_t per = reduceScatterPieceElems(e, budget(count * e * static_cast<uint64_t>(rows)), rows);
  const uint64_t row = per * e;  // a rank's row in a slot
  const int depth = tuning_.depth;
  const std::vector<HostPiece> ps = cutPieces(count, per, depth, false, [&](int word) { return mark(c, word); });
  std::vector<Mark> marks;
  for (const HostPiece& pc : ps) marks.push_back(pc.first);
  submit(c, OpKind::kReduceScatter,
         [r = ring(), ps, count, per, t, rop, world = size_, rank = rank_,
          step = rail ? std::make_optional(*rail) : std::nullopt](const AlgoContext& ctx) {
           return step ? railReduceScatterPieces(ctx, r, ps, count, per, t, rop, world, rank, *step)
                       : reduceScatterPieces(ctx, r, ps, count, per, t, rop, world, rank);
         },
         std::move(marks));
  const cudaStream_t s = c.stream;
  const uint64_t block = count * e;  // a rank's block of the input
  // The peers' rows only: this rank's own row is reduced straight from `in`.
  auto pack = [&](const HostPiece& pc) {
    const uint64_t me = static_cast<uint64_t>(mine), after = static_cast<uint64_t>(rows) - me - 1;
    copy2DAsync(inHost(pc.slot), row, in + pc.off * e, block, pc.len * e, me, cudaMemcpyDeviceToHost, s);
    copy2DAsync(inHost(pc.slot) + (me + 1) * row, row, in + (me + 1) * block + pc.off * e, block, pc.len * e, after,
                cudaMemcpyDeviceToHost, s);
    raiseReady(s, pc.first);
  };
  streamPieces(ps, depth, pack, [&](const HostPiece& pc) {
    waitDone(s, pc.first);
    launchReduce(s, out + pc.off * e, pc.slot, in + static_cast<uint64_t>(mine) * block + pc.off * e,
                 pc.first.ticket, pc.len * e, t, rop);
  });
}

void HostPipeline::allgather(const Call& c, const char* in, char* out, uint64_t bytes, const RailStep* rail) {
  // The rows: one per rank of the group, or of the rail; this rank's among them.
  const int rows = rail ? static_cast<int>(rail->rail.size()) : size_;
  const int me = rail ? static_cast<int>(std::find(rail->rail.begin(), rail->rail.end(), rank_) - rail->rail.begin())
                      : rank_;
  const uint64_t per = allgatherPieceBytes(budget(bytes * static_cast<uint64_t>(rows)), rows);
  const int depth = tuning_.depth;
  const std::vector<HostPiece> ps = cutPieces(bytes, per, depth, false, [&](int word) { return mark(c, word); });
  std::vector<Mark> marks;
  for (const HostPiece& pc : ps) marks.push_back(pc.first);
  submit(c, OpKind::kAllgather,
         [r = ring(), ps, bytes, per, world = size_, rank = rank_,
          step = rail ? std::make_optional(*rail) : std::nullopt](const AlgoContext& ctx) {
           return step ? railAllgatherPieces(ctx, r, ps, bytes, per, world, rank, *step)
                       : allgatherPieces(ctx, r, ps, bytes, per, world, rank);
         },
         std::move(marks));
  const cudaStream_t s = c.stream;
  copyAsync(out + static_cast<uint64_t>(me) * bytes, in, bytes, cudaMemcpyDeviceToDevice, s);
  auto pack = [&](const HostPiece& pc) {
    copyAsync(inHost(pc.slot), in + pc.off, pc.len, cudaMemcpyDeviceToHost, s);
    raiseReady(s, pc.first);
  };
  streamPieces(ps, depth, pack, [&](const HostPiece& pc) {
    waitDone(s, pc.first);
    // The rows of the ranks before this one, then those after it.
    copy2DAsync(out + pc.off, bytes, outHost(pc.slot), per, pc.len, static_cast<uint64_t>(me),
                cudaMemcpyHostToDevice, s);
    copy2DAsync(out + static_cast<uint64_t>(me + 1) * bytes + pc.off, bytes,
                outHost(pc.slot) + static_cast<uint64_t>(me + 1) * per, per, pc.len,
                static_cast<uint64_t>(rows - me - 1), cudaMemcpyHostToDevice, s);
  });
}

void HostPipeline::broadcast(const Call& c, char* buf, uint64_t bytes, int root, const RailStep* rail) {
  const int depth = tuning_.depth;
  const bool carries = !rail || std::binary_search(rail->rail.begin(), rail->rail.end(), root);
  const std::vector<HostPiece> ps =
      cutPieces(carries ? bytes : 0, budget(bytes), depth, false, [&](int word) { return mark(c, word); });
  std::vector<Mark> marks;
  for (const HostPiece& pc : ps) marks.push_back(pc.first);
  submit(c, OpKind::kBroadcast,
         [r = ring(), ps, bytes, root, step = rail ? std::make_optional(*rail) : std::nullopt](const AlgoContext& ctx) {
           return step ? railBroadcastPieces(ctx, r, ps, bytes, root, *step) : broadcastPieces(ctx, r, ps, bytes, root);
         },
         std::move(marks));
  const cudaStream_t s = c.stream;
  const bool is_root = rank_ == root;
  // The root packs a piece before the worker may send it; the others free a slot before the
  // worker may receive into it.
  auto open = [&](const HostPiece& pc) {
    if (is_root) copyAsync(inHost(pc.slot), buf + pc.off, pc.len, cudaMemcpyDeviceToHost, s);
    raiseReady(s, pc.first);
  };
  streamPieces(ps, depth, open, [&](const HostPiece& pc) {
    waitDone(s, pc.first);
    if (!is_root) copyAsync(buf + pc.off, inHost(pc.slot), pc.len, cudaMemcpyHostToDevice, s);
  });
}

void HostPipeline::alltoall(const Call& c, const char* in, char* out, const std::vector<uint64_t>& send_off,
                            const std::vector<uint64_t>& send_bytes, const std::vector<uint64_t>& recv_off,
                            const std::vector<uint64_t>& recv_bytes) {
  const uint64_t per = alltoallPieceBytes(tuning_.slot_bytes, size_);
  const int depth = tuning_.depth;
  uint64_t longest = 0;  // of the pairs with peers
  for (int r = 0; r < size_; ++r)
    if (r != rank_) longest = std::max({longest, send_bytes[r], recv_bytes[r]});
  const std::vector<HostPiece> ps = cutPieces(longest, per, depth, false, [&](int word) { return mark(c, word); });
  std::vector<Mark> marks;
  for (const HostPiece& pc : ps) marks.push_back(pc.first);
  submit(c, OpKind::kAlltoall,
         [r = ring(), ps, per, send_bytes, recv_bytes, world = size_, rank = rank_](const AlgoContext& ctx) {
           return alltoallPieces(ctx, r, ps, per, send_bytes, recv_bytes, world, rank);
         },
         std::move(marks));
  const cudaStream_t s = c.stream;
  const auto me = static_cast<size_t>(rank_);
  copyAsync(out + recv_off[me], in + send_off[me], std::min(send_bytes[me], recv_bytes[me]), cudaMemcpyDeviceToDevice,
            s);
  auto left = [per](uint64_t n, const HostPiece& pc) { return n > pc.off ? std::min(per, n - pc.off) : 0; };
  auto pack = [&](const HostPiece& pc) {
    for (int r = 0; r < size_; ++r)
      if (r != rank_)
        copyAsync(inHost(pc.slot) + static_cast<uint64_t>(r) * per, in + send_off[r] + pc.off, left(send_bytes[r], pc),
                  cudaMemcpyDeviceToHost, s);
    raiseReady(s, pc.first);
  };
  streamPieces(ps, depth, pack, [&](const HostPiece& pc) {
    waitDone(s, pc.first);
    for (int r = 0; r < size_; ++r)
      if (r != rank_)
        copyAsync(out + recv_off[r] + pc.off, outHost(pc.slot) + static_cast<uint64_t>(r) * per,
                  left(recv_bytes[r], pc), cudaMemcpyHostToDevice, s);
  });
}

}  // namespace moelink::cuda
