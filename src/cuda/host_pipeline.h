// The host route's pipeline: large CUDA collectives between hosts in pieces, so that the
// GPU's copies, the wire and the GPU's reductions overlap.
//
// A ring of `depth` slots of pinned, GPU-mapped host memory (allocated once) carries the
// pieces. The op's stream packs piece p into slot p % depth (copy engine), raises the slot's
// ready word, and later waits on its done word before it unpacks the piece (copy back, or a
// reduction on the GPU of the rows that arrived, src/cuda/kernels/rows_reduce.cu) and packs
// piece p + depth into the slot. The worker runs the whole op as one collective whose steps
// are the pieces' exchanges: a piece's steps wait for its ready word (Step::gate), and its
// last consumption raises the done word. Nothing but the words passes between the stream and
// the worker, so the op needs no host call of its own on the stream: in a CUDA graph a host
// node hands the op to the worker at each replay, and the graph's words and tickets are reset
// there.
//
// The ops, per piece, in the worker's order:
//   all_reduce      reduce-scatter (every active rank sends each its block of the piece),
//                   the GPU reduces this rank's block, all-gather of the reduced blocks; the
//                   worker runs piece p+1's reduce-scatter before piece p's all-gather, so the
//                   wire stays busy while the GPU reduces; between two ranks (a group of
//                   two, or a rail of two hosts) the whole piece to the other rank instead,
//                   and the GPU reduces both in place (allreduceInOneExchange);
//   reduce_scatter  the piece's rows (one per rank) to their ranks, the GPU reduces;
//   all_gather      this rank's piece to every rank, copied back per rank;
//   broadcast       the root's piece to every rank.
// The pieces are cut from the op's sizes only (every rank cuts alike), and blocks, rows and
// reductions go by the ranks active when the op starts (inactive ranks' all_gather blocks are
// zeros); the op is one collective for the worker, so a disagreement in sizes is found in the
// headers as for any op. A membership change after a piece has been consumed fails the op
// (OpSpec::inplace): its pieces cannot be taken back. The worker's side (the cuts and the
// collective of each op) is moelink/cuda/host_pieces.h, plain C++ that the CPU tests run with a
// thread in the stream's place (tests/cpp/cuda/host_pieces_test.cpp); this file adds the ring's
// memory, the words' tickets, the hand-over (now or at each graph replay) and the stream.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "moelink/collective/algorithms.h"
#include "moelink/collective/worker.h"
#include "moelink/cuda/host_pieces.h"
#include "moelink/cuda/rows_reduce.h"
#include "staging.h"

namespace moelink::cuda {

struct HostPipelineTuning {
  uint64_t slot_bytes = 16 << 20;  // MOELINK_HOST_PIECE_BYTES: a slot's bytes on this rank's side (the largest piece)
  int depth = 4;                   // MOELINK_HOST_PIECES: pieces in flight (slots)
  uint64_t min_piece = 1 << 20;    // MOELINK_HOST_MIN_PIECE_BYTES: no piece smaller (pieceBudget)
  uint64_t min_bytes = 1 << 20;    // MOELINK_HOST_PIPELINE_BYTES: smaller eager ops take the one-shot route
  static HostPipelineTuning fromEnv();
};

class HostPipeline {
 public:
  // Allocates the ring on the current device's behalf (pinned, mapped). `worker` outlives it.
  HostPipeline(collective::CollectiveWorker* worker, int rank, int size, const HostPipelineTuning& t);
  ~HostPipeline();
  HostPipeline(const HostPipeline&) = delete;
  HostPipeline& operator=(const HostPipeline&) = delete;

  const HostPipelineTuning& tuning() const { return tuning_; }

  // The op's outcome: "" or the error, and the ranks it lost (worker thread).
  using Done = std::function<void(const std::string& error, const std::vector<int>& lost)>;
  struct Call {
    cudaStream_t stream = nullptr;
    std::chrono::milliseconds timeout{0};
    bool captured = false;  // the stream is capturing: the worker gets the op at each replay
    Done done;              // eager ops only; a replay's failure is logged
  };
  // In place on `buf` (count elements). With `rail`, the cross-host step of a two-level
  // all_reduce (railAllreducePieces).
  void allreduce(const Call& c, char* buf, uint64_t count, collective::DType t, collective::ReduceOp op,
                 const RailStep* rail = nullptr);
  // `in`: one block of `count` elements per rank; `out`: this rank's reduced block. With `rail`,
  // the cross-host step of a two-level reduce_scatter (railReduceScatterPieces): one block per
  // rank of the rail, by position on it.
  void reduceScatter(const Call& c, const char* in, char* out, uint64_t count, collective::DType t,
                     collective::ReduceOp op, const RailStep* rail = nullptr);
  // `out`: one block of `bytes` per rank. With `rail`, the cross-host step of a two-level
  // all_gather (railAllgatherPieces): one block per rank of the rail, by position on it.
  void allgather(const Call& c, const char* in, char* out, uint64_t bytes, const RailStep* rail = nullptr);
  // With `rail`, the cross-host step of a two-level broadcast (railBroadcastPieces): only the
  // ranks of the root's rail move the pieces; the others hand the worker one empty piece.
  void broadcast(const Call& c, char* buf, uint64_t bytes, int root, const RailStep* rail = nullptr);
  // Pairs of any lengths (byte offsets and lengths per rank, in `in` and `out`).
  void alltoall(const Call& c, const char* in, char* out, const std::vector<uint64_t>& send_off,
                const std::vector<uint64_t>& send_bytes, const std::vector<uint64_t>& recv_off,
                const std::vector<uint64_t>& recv_bytes);

 private:
  struct Batch;
  using Builder = std::function<collective::OpSpec(const collective::AlgoContext&)>;
  using Mark = PieceMark;
  // The words of an op's piece: `word` (0 .. words()-1) of the eager set, or of the set that
  // captured ops use (their words are reset at each replay), with a fresh ticket.
  Mark mark(const Call& c, int word);
  int words() const { return 2 * tuning_.depth; }
  // The bytes of a slot's side that the pieces of an op of `total` bytes use (pieceBudget).
  uint64_t budget(uint64_t total) const {
    return pieceBudget(total, tuning_.depth, tuning_.min_piece, tuning_.slot_bytes);
  }
  // The ring as the worker sees it (host pointers).
  PieceRing ring() const;
  char* inHost(int slot) const { return ring().in(slot); }
  char* outHost(int slot) const { return ring().out(slot); }
  char* inDev(int slot) const;
  char* outDev(int slot) const;
  void raiseReady(cudaStream_t s, Mark m) const;
  void waitDone(cudaStream_t s, Mark m) const;
  // Hands the op to the worker: now, or (captured) at each replay through a host node.
  void submit(const Call& c, collective::OpKind kind, Builder build, std::vector<Mark> marks);
  static void CUDART_CB replay(void* batch);
  void launchReduce(cudaStream_t s, char* out, int slot, const char* mine, uint32_t ticket, uint64_t max_len,
                    collective::DType t, collective::ReduceOp op);

  collective::CollectiveWorker* worker_;
  const int rank_, size_;
  HostPipelineTuning tuning_;
  uint64_t out_bytes_ = 0, slot_stride_ = 0;  // a slot's out area; in + out, aligned
  std::unique_ptr<MappedArray<char>> ring_;
  // 2 per slot (the piece's first and second exchange), for eager ops, then as many for captured ones.
  std::unique_ptr<MappedArray<uint32_t>> ready_, done_;
  std::vector<uint32_t> last_;  // per eager word: the latest ticket it was given
  std::unique_ptr<MappedArray<RowsPlan>> plans_;         // one per slot
  uint32_t ticket_ = 0;
  std::vector<std::unique_ptr<Batch>> batches_;  // captured ops (their graphs may be replayed any time)
};

}  // namespace moelink::cuda
