// The host route's pipeline (host_pipeline.h).
#include "host_pipeline.h"

#include <algorithm>

#include <glog/logging.h>

#include "moelink/common/error.h"
#include "moelink/common/settings.h"

namespace moelink::cuda {

using collective::AlgoContext;
using collective::DType;
using collective::OpKind;
using collective::OpSpec;
using collective::ReduceOp;
using collective::Step;

namespace {

// Pipeline ops carry their size with this bit in the headers' op size, so that a rank on the
// one-shot route and one on the pipeline (a size near the threshold read differently, or an op
// captured on one rank only) fail the op on the header check rather than mix their messages.
constexpr uint64_t kPipelineMark = 1ull << 63;

uint64_t ceilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }
uint64_t roundUp(uint64_t v, uint64_t a) { return ceilDiv(v, a) * a; }
// Elements per 16-byte vector of the reduction (at least one).
uint64_t vecOf(size_t e) { return e >= 16 ? 1 : 16 / e; }

int indexIn(const AlgoContext& c, int rank) {
  auto it = std::find(c.ranks.begin(), c.ranks.end(), rank);
  MOELINK_CHECK(it != c.ranks.end(), "rank ", rank, " is not active in the group");
  return static_cast<int>(it - c.ranks.begin());
}

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

}  // namespace

HostPipelineTuning HostPipelineTuning::fromEnv() {
  HostPipelineTuning t;
  t.min_bytes = settings::number("MOELINK_HOST_PIPELINE_BYTES");
  t.slot_bytes = settings::number("MOELINK_HOST_PIECE_BYTES") / 16 * 16;
  t.depth = static_cast<int>(settings::number("MOELINK_HOST_PIECES"));
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
  out_bytes_ = roundUp(tuning_.slot_bytes + 16ull * static_cast<uint64_t>(size_), 16);
  slot_stride_ = roundUp(tuning_.slot_bytes + out_bytes_, 4096);
  ring_ = std::make_unique<MappedArray<char>>(slot_stride_ * static_cast<uint64_t>(tuning_.depth));
  ready_ = std::make_unique<MappedArray<uint32_t>>(2 * static_cast<size_t>(words()));
  done_ = std::make_unique<MappedArray<uint32_t>>(2 * static_cast<size_t>(words()));
  last_.assign(static_cast<size_t>(words()), 0);
  plans_ = std::make_unique<MappedArray<RowsPlan>>(static_cast<size_t>(tuning_.depth));
}

HostPipeline::~HostPipeline() = default;

char* HostPipeline::inHost(int slot) const { return ring_->host(slot_stride_ * static_cast<uint64_t>(slot)); }
char* HostPipeline::outHost(int slot) const { return inHost(slot) + tuning_.slot_bytes; }
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

std::function<bool()> HostPipeline::gate(Mark m) const {
  uint32_t* word = ready_->host(m.word);
  const uint32_t ticket = m.ticket;
  return [word, ticket] { return static_cast<int32_t>(__atomic_load_n(word, __ATOMIC_ACQUIRE) - ticket) >= 0; };
}

void HostPipeline::append(OpSpec& op, OpSpec piece, Mark m, std::function<void()> before) const {
  uint32_t* done = done_->host(m.word);
  const uint32_t ticket = m.ticket;
  collective::appendGatedPiece(op, std::move(piece), gate(m), [before = std::move(before), done, ticket] {
    if (before) before();
    __atomic_store_n(done, ticket, __ATOMIC_RELEASE);
  });
}

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
  build = [build = std::move(build), first = gate(marks.front())](const AlgoContext& ctx) {
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

namespace {

// Writes a reduction's plan for the GPU, its ticket last.
void publish(RowsPlan* dst, const RowsPlan& p) {
  volatile RowsPlan* d = dst;
  d->off = p.off;
  d->len = p.len;
  d->stride = p.stride;
  d->rows = p.rows;
  d->me = p.me;
  __atomic_store_n(&dst->ticket, p.ticket, __ATOMIC_RELEASE);
}

}  // namespace

// ---- the ops ----

void HostPipeline::allreduce(const Call& c, char* buf, uint64_t count, DType t, ReduceOp rop) {
  const uint64_t e = collective::elementSize(t), vec = vecOf(e);
  const uint64_t per = std::max<uint64_t>(vec, tuning_.slot_bytes / e / vec * vec);
  const uint64_t pieces = std::max<uint64_t>(1, ceilDiv(count, per));
  const int depth = tuning_.depth;
  struct Piece {
    uint64_t off, cnt;  // elements
    int slot;
    Mark rs, ag;
  };
  std::vector<Piece> ps(pieces);
  std::vector<Mark> marks;
  for (uint64_t p = 0; p < pieces; ++p) {
    const int slot = static_cast<int>(p % depth);
    ps[p] = {p * per, std::min(per, count - std::min(count, p * per)), slot, mark(c, 2 * slot), mark(c, 2 * slot + 1)};
    marks.push_back(ps[p].rs);
    marks.push_back(ps[p].ag);
  }
  const int world = size_, me_rank = rank_;
  Builder build = [this, ps, e, vec, t, rop, count, world, me_rank](const AlgoContext& ctx) {
    OpSpec op;
    op.kind = OpKind::kAllreduce;
    op.dtype = t;
    op.redop = rop;
    op.op_bytes = (count * e) | kPipelineMark;
    op.inplace = true;
    const int m = static_cast<int>(ctx.ranks.size()), me = indexIn(ctx, me_rank);
    // The all-gather halves read and write the same slot, so the op is not pullable
    // (appendGatedPiece): no piece may be cut for pulled messages.
    AlgoContext c1 = ctx;
    c1.pull_chunk = 0;
    // Block i of a piece (of m, by active rank): byte offset and length; returns the stride.
    auto block = [&](const Piece& pc, int i, uint64_t* off, uint64_t* len) {
      const uint64_t blk = roundUp(ceilDiv(pc.cnt, static_cast<uint64_t>(m)), vec);
      const uint64_t b = std::min(pc.cnt, i * blk), end = std::min(pc.cnt, (i + 1) * blk);
      *off = b * e;
      *len = (end - b) * e;
      return blk * e;
    };
    std::vector<uint64_t> so(world), sb(world), ro(world), rb(world);
    auto scatterOf = [&](const Piece& pc) {
      uint64_t moff, mlen;
      const uint64_t stride = block(pc, me, &moff, &mlen);
      std::fill(sb.begin(), sb.end(), 0);
      std::fill(rb.begin(), rb.end(), 0);
      for (int i = 0; i < m; ++i) {
        const int r = ctx.ranks[i];
        if (r == me_rank) continue;
        block(pc, i, &so[r], &sb[r]);
        ro[r] = static_cast<uint64_t>(i) * stride;
        rb[r] = mlen;
      }
      RowsPlan plan{pc.rs.ticket, moff, mlen, stride, m, me};
      RowsPlan* dst = plans_->host(pc.slot);
      append(op, collective::alltoallOp(c1, inHost(pc.slot), so, sb, outHost(pc.slot), ro, rb), pc.rs,
             [dst, plan] { publish(dst, plan); });
    };
    auto gatherOf = [&](const Piece& pc) {
      uint64_t moff, mlen;
      block(pc, me, &moff, &mlen);
      std::fill(sb.begin(), sb.end(), 0);
      std::fill(rb.begin(), rb.end(), 0);
      for (int i = 0; i < m; ++i) {
        const int r = ctx.ranks[i];
        if (r == me_rank) continue;
        so[r] = moff;
        sb[r] = mlen;
        block(pc, i, &ro[r], &rb[r]);
      }
      append(op, collective::alltoallOp(c1, inHost(pc.slot), so, sb, inHost(pc.slot), ro, rb), pc.ag, nullptr);
    };
    // Piece p+1's reduce-scatter before piece p's all-gather: the wire is busy while the GPU
    // reduces piece p.
    scatterOf(ps[0]);
    for (size_t p = 0; p < ps.size(); ++p) {
      if (p + 1 < ps.size()) scatterOf(ps[p + 1]);
      gatherOf(ps[p]);
    }
    return op;
  };
  submit(c, OpKind::kAllreduce, std::move(build), std::move(marks));
  const cudaStream_t s = c.stream;
  auto pack = [&](const Piece& pc) {
    copyAsync(inHost(pc.slot), buf + pc.off * e, pc.cnt * e, cudaMemcpyDeviceToHost, s);
    raiseReady(s, pc.rs);
  };
  // Piece p's block is reduced (and its all-gather let go) as soon as its reduce-scatter is
  // in, ahead of the wait for piece p-1's all-gather: the wire need not wait for the stream.
  auto reduce = [&](const Piece& pc) {
    waitDone(s, pc.rs);
    launchReduce(s, inDev(pc.slot), pc.slot, buf + pc.off * e, pc.rs.ticket, pc.cnt * e, t, rop);
    raiseReady(s, pc.ag);
  };
  for (size_t p = 0; p < ps.size() && p < static_cast<size_t>(depth); ++p) pack(ps[p]);
  reduce(ps[0]);
  for (size_t p = 0; p < ps.size(); ++p) {
    const Piece& pc = ps[p];
    if (p + 1 < ps.size()) reduce(ps[p + 1]);
    waitDone(s, pc.ag);
    copyAsync(buf + pc.off * e, inHost(pc.slot), pc.cnt * e, cudaMemcpyHostToDevice, s);
    if (p + depth < ps.size()) pack(ps[p + depth]);
  }
}

void HostPipeline::reduceScatter(const Call& c, const char* in, char* out, uint64_t count, DType t, ReduceOp rop) {
  const uint64_t e = collective::elementSize(t), vec = vecOf(e);
  const uint64_t per = std::max<uint64_t>(vec, tuning_.slot_bytes / (e * static_cast<uint64_t>(size_)) / vec * vec);
  const uint64_t row = per * e;  // a rank's row in a slot
  const uint64_t pieces = std::max<uint64_t>(1, ceilDiv(count, per));
  const int depth = tuning_.depth;
  struct Piece {
    uint64_t off, cnt;
    int slot;
    Mark rs;
  };
  std::vector<Piece> ps(pieces);
  std::vector<Mark> marks;
  for (uint64_t p = 0; p < pieces; ++p) {
    const int slot = static_cast<int>(p % depth);
    ps[p] = {p * per, std::min(per, count - std::min(count, p * per)), slot, mark(c, 2 * slot)};
    marks.push_back(ps[p].rs);
  }
  const int world = size_, me_rank = rank_;
  Builder build = [this, ps, e, t, rop, count, row, world, me_rank](const AlgoContext& ctx) {
    OpSpec op;
    op.kind = OpKind::kReduceScatter;
    op.dtype = t;
    op.redop = rop;
    op.op_bytes = (count * e * static_cast<uint64_t>(world)) | kPipelineMark;
    op.inplace = true;
    const int m = static_cast<int>(ctx.ranks.size()), me = indexIn(ctx, me_rank);
    std::vector<uint64_t> so(world), sb(world), ro(world), rb(world);
    for (const Piece& pc : ps) {
      std::fill(sb.begin(), sb.end(), 0);
      std::fill(rb.begin(), rb.end(), 0);
      for (int i = 0; i < m; ++i) {
        const int r = ctx.ranks[i];
        if (r == me_rank) continue;
        so[r] = static_cast<uint64_t>(r) * row;  // packed by rank
        sb[r] = pc.cnt * e;
        ro[r] = static_cast<uint64_t>(i) * row;  // received by active index
        rb[r] = pc.cnt * e;
      }
      RowsPlan plan{pc.rs.ticket, 0, pc.cnt * e, row, m, me};
      RowsPlan* dst = plans_->host(pc.slot);
      append(op, collective::alltoallOp(ctx, inHost(pc.slot), so, sb, outHost(pc.slot), ro, rb), pc.rs,
             [dst, plan] { publish(dst, plan); });
    }
    return op;
  };
  submit(c, OpKind::kReduceScatter, std::move(build), std::move(marks));
  const cudaStream_t s = c.stream;
  const uint64_t block = count * e;  // a rank's block of the input
  auto pack = [&](const Piece& pc) {
    copy2DAsync(inHost(pc.slot), row, in + pc.off * e, block, pc.cnt * e, static_cast<uint64_t>(size_),
                cudaMemcpyDeviceToHost, s);
    raiseReady(s, pc.rs);
  };
  for (size_t p = 0; p < ps.size() && p < static_cast<size_t>(depth); ++p) pack(ps[p]);
  for (size_t p = 0; p < ps.size(); ++p) {
    const Piece& pc = ps[p];
    waitDone(s, pc.rs);
    launchReduce(s, out + pc.off * e, pc.slot, in + static_cast<uint64_t>(rank_) * block + pc.off * e, pc.rs.ticket,
                 pc.cnt * e, t, rop);
    if (p + depth < ps.size()) pack(ps[p + depth]);
  }
}

void HostPipeline::allgather(const Call& c, const char* in, char* out, uint64_t bytes) {
  const uint64_t per = std::max<uint64_t>(16, tuning_.slot_bytes / static_cast<uint64_t>(size_) / 16 * 16);
  const uint64_t pieces = std::max<uint64_t>(1, ceilDiv(bytes, per));
  const int depth = tuning_.depth;
  struct Piece {
    uint64_t off, len;
    int slot;
    Mark ag;
  };
  std::vector<Piece> ps(pieces);
  std::vector<Mark> marks;
  for (uint64_t p = 0; p < pieces; ++p) {
    const int slot = static_cast<int>(p % depth);
    ps[p] = {p * per, std::min(per, bytes - std::min(bytes, p * per)), slot, mark(c, 2 * slot)};
    marks.push_back(ps[p].ag);
  }
  const int world = size_, me_rank = rank_;
  Builder build = [this, ps, bytes, per, world, me_rank](const AlgoContext& ctx) {
    OpSpec op;
    op.kind = OpKind::kAllgather;
    op.op_bytes = bytes | kPipelineMark;
    op.inplace = true;
    std::vector<uint64_t> so(world, 0), sb(world), ro(world), rb(world);
    for (const Piece& pc : ps) {
      for (int r = 0; r < world; ++r) {
        // Every rank's row at its rank; an inactive rank's is zeroed (alltoallOp's finish).
        sb[r] = r == me_rank || !std::binary_search(ctx.ranks.begin(), ctx.ranks.end(), r) ? 0 : pc.len;
        ro[r] = static_cast<uint64_t>(r) * per;
        rb[r] = r == me_rank ? 0 : pc.len;
      }
      append(op, collective::alltoallOp(ctx, inHost(pc.slot), so, sb, outHost(pc.slot), ro, rb), pc.ag, nullptr);
    }
    return op;
  };
  submit(c, OpKind::kAllgather, std::move(build), std::move(marks));
  const cudaStream_t s = c.stream;
  copyAsync(out + static_cast<uint64_t>(rank_) * bytes, in, bytes, cudaMemcpyDeviceToDevice, s);
  auto pack = [&](const Piece& pc) {
    copyAsync(inHost(pc.slot), in + pc.off, pc.len, cudaMemcpyDeviceToHost, s);
    raiseReady(s, pc.ag);
  };
  for (size_t p = 0; p < ps.size() && p < static_cast<size_t>(depth); ++p) pack(ps[p]);
  for (size_t p = 0; p < ps.size(); ++p) {
    const Piece& pc = ps[p];
    waitDone(s, pc.ag);
    // The rows of the ranks before this one, then those after it.
    copy2DAsync(out + pc.off, bytes, outHost(pc.slot), per, pc.len, static_cast<uint64_t>(rank_),
                cudaMemcpyHostToDevice, s);
    copy2DAsync(out + static_cast<uint64_t>(rank_ + 1) * bytes + pc.off, bytes,
                outHost(pc.slot) + static_cast<uint64_t>(rank_ + 1) * per, per, pc.len,
                static_cast<uint64_t>(size_ - rank_ - 1), cudaMemcpyHostToDevice, s);
    if (p + depth < ps.size()) pack(ps[p + depth]);
  }
}

void HostPipeline::broadcast(const Call& c, char* buf, uint64_t bytes, int root) {
  const uint64_t per = tuning_.slot_bytes;
  const uint64_t pieces = std::max<uint64_t>(1, ceilDiv(bytes, per));
  const int depth = tuning_.depth;
  struct Piece {
    uint64_t off, len;
    int slot;
    Mark bc;
  };
  std::vector<Piece> ps(pieces);
  std::vector<Mark> marks;
  for (uint64_t p = 0; p < pieces; ++p) {
    const int slot = static_cast<int>(p % depth);
    ps[p] = {p * per, std::min(per, bytes - std::min(bytes, p * per)), slot, mark(c, 2 * slot)};
    marks.push_back(ps[p].bc);
  }
  Builder build = [this, ps, bytes, root](const AlgoContext& ctx) {
    OpSpec op;
    op.kind = OpKind::kBroadcast;
    op.root = root;
    op.op_bytes = bytes | kPipelineMark;
    op.inplace = true;
    for (const Piece& pc : ps) append(op, collective::broadcastOp(ctx, inHost(pc.slot), pc.len, root), pc.bc, nullptr);
    return op;
  };
  submit(c, OpKind::kBroadcast, std::move(build), std::move(marks));
  const cudaStream_t s = c.stream;
  const bool is_root = rank_ == root;
  // The root packs a piece before the worker may send it; the others free a slot before the
  // worker may receive into it.
  auto open = [&](const Piece& pc) {
    if (is_root) copyAsync(inHost(pc.slot), buf + pc.off, pc.len, cudaMemcpyDeviceToHost, s);
    raiseReady(s, pc.bc);
  };
  for (size_t p = 0; p < ps.size() && p < static_cast<size_t>(depth); ++p) open(ps[p]);
  for (size_t p = 0; p < ps.size(); ++p) {
    const Piece& pc = ps[p];
    waitDone(s, pc.bc);
    if (!is_root) copyAsync(buf + pc.off, inHost(pc.slot), pc.len, cudaMemcpyHostToDevice, s);
    if (p + depth < ps.size()) open(ps[p + depth]);
  }
}

}  // namespace moelink::cuda
