// The IBGDA send/completion queue protocol (include/moelink/ep/ibgda/queue.h) against an
// emulated NIC: a thread that reads the doorbell record, executes the posted WQEs and writes
// CQEs, decoding and encoding them with rdma-core's own mlx5dv.h structures (not ours), as an
// mlx5 device would. Host threads play the GPU threads (the code is __host__ __device__), and,
// where a GPU is present, GPU threads post and poll for real (ibgda_wqe_gpu.cu), with the
// queues in mapped host memory that the emulated NIC reads.
#include <infiniband/mlx5dv.h>

#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "moelink/ep/ibgda/queue.h"

using namespace moelink::ep::ibgda;

static_assert(kCqeReq == MLX5_CQE_REQ && kCqeReqErr == MLX5_CQE_REQ_ERR && kCqeInvalid == MLX5_CQE_INVALID,
              "CQE opcodes");
static_assert(offsetof(mlx5_cqe64, wqe_counter) == kCqeWqeCounterOffset &&
                  offsetof(mlx5_cqe64, op_own) == kCqeOpOwnOffset && sizeof(mlx5_cqe64) == kCqeBytes,
              "CQE layout");
static_assert(kSendDbr == MLX5_SND_DBR, "send doorbell record word");

namespace {

constexpr uint32_t kQpn = 0x1234;
constexpr uint32_t kLkey = 0x1111, kRkey = 0x2222;

// Where the NIC finds the queues: raw pointers, so that the same emulation serves the host
// threads' queues (std::vector) and the GPU's (mapped host memory).
struct NicView {
  unsigned char* wqes = nullptr;
  unsigned char* cqes = nullptr;
  uint32_t* sq_dbr = nullptr;
  uint32_t* cq_dbr = nullptr;
  uint32_t sq_depth = 0, cq_depth = 0;
};

struct Queues {
  std::vector<unsigned char> wqes, cqes;
  alignas(64) uint32_t sq_dbr[2] = {0, 0};
  alignas(64) uint32_t cq_dbr[2] = {0, 0};
  alignas(64) uint64_t doorbell = 0;
  alignas(64) uint64_t tickets = 0;
  alignas(64) uint64_t ready = 0;
  alignas(64) uint64_t completed = 0;
  SendQueue sq;
  CompletionQueue cq;

  Queues(uint32_t sq_depth, uint32_t cq_depth) : wqes(sq_depth * kBasicBlockBytes), cqes(cq_depth * kCqeBytes) {
    for (uint32_t i = 0; i < cq_depth; ++i)  // as the driver initializes a CQ: every entry invalid
      reinterpret_cast<mlx5_cqe64*>(cqes.data())[i].op_own = MLX5_CQE_INVALID << 4;
    sq = {wqes.data(), sq_depth, kQpn, sq_dbr, &doorbell, &tickets, &ready, &completed};
    cq.cqes = cqes.data();
    cq.depth = cq_depth;
    cq.dbr = cq_dbr;
  }
  NicView view() { return {wqes.data(), cqes.data(), sq_dbr, cq_dbr, sq.depth, cq.depth}; }
  // These queues as one queue pair shared by posters (every WQE with signal_mask's bits set
  // signaled).
  QueuePair shared(uint32_t signal_mask) {
    QueuePair qp;
    qp.sq = sq;
    qp.cq = cq;
    qp.signal_mask = signal_mask;
    return qp;
  }
};

// Executes WQEs up to the doorbell record's send counter, like the NIC's send engine.
class EmulatedNic {
 public:
  explicit EmulatedNic(const NicView& q) : q_(q), thread_([this] { run(); }) {}
  ~EmulatedNic() {
    stop_ = true;
    thread_.join();
  }
  uint64_t executed() const { return executed_.load(); }
  uint64_t inlineWrites() const { return inline_writes_.load(); }
  std::string error() const { return error_; }

 private:
  void run() {
    while (!stop_.load(std::memory_order_relaxed)) {
      const uint32_t counter = be32toh(__atomic_load_n(&q_.sq_dbr[MLX5_SND_DBR], __ATOMIC_ACQUIRE)) & 0xffff;
      if ((sq_ci_ & 0xffff) == counter) {
        sched_yield();
        continue;
      }
      const auto* wqe = q_.wqes + (sq_ci_ % q_.sq_depth) * kBasicBlockBytes;
      const auto* ctrl = reinterpret_cast<const mlx5_wqe_ctrl_seg*>(wqe);
      const auto* raddr = reinterpret_cast<const mlx5_wqe_raddr_seg*>(wqe + 16);
      const uint32_t opmod_idx_opcode = be32toh(ctrl->opmod_idx_opcode), qpn_ds = be32toh(ctrl->qpn_ds);
      if ((opmod_idx_opcode & 0xff) == MLX5_OPCODE_NOP) {  // nothing to carry out; a completion if asked
        const bool ok = ((opmod_idx_opcode >> 8) & 0xffff) == (sq_ci_ & 0xffff) && (qpn_ds >> 8) == kQpn &&
                        (qpn_ds & 0x3f) == 1;
        if (!ok && error_.empty()) error_ = "malformed NOP at index " + std::to_string(sq_ci_);
        if (ctrl->fm_ce_se & MLX5_WQE_CTRL_CQ_UPDATE) complete(true);
        ++sq_ci_;
        executed_.store(sq_ci_);
        continue;
      }
      bool ok = (opmod_idx_opcode & 0xff) == MLX5_OPCODE_RDMA_WRITE &&
                ((opmod_idx_opcode >> 8) & 0xffff) == (sq_ci_ & 0xffff) && (qpn_ds >> 8) == kQpn &&
                (qpn_ds & 0x3f) == 3;
      // The third segment: a data segment (pointer, lkey) or inline data (MLX5_INLINE_SEG).
      const uint32_t first = be32toh(*reinterpret_cast<const uint32_t*>(wqe + 32));
      const bool is_inline = first & MLX5_INLINE_SEG;
      const void* src = nullptr;
      uint32_t len = 0;
      bool keys = be32toh(raddr->rkey) == kRkey;
      if (is_inline) {
        len = first & ~MLX5_INLINE_SEG;
        src = wqe + 32 + sizeof(mlx5_wqe_inl_data_seg);
        ok = ok && len + sizeof(mlx5_wqe_inl_data_seg) <= 16;  // fits the one segment ds = 3 leaves
        inline_writes_.fetch_add(1);
      } else {
        const auto* data = reinterpret_cast<const mlx5_wqe_data_seg*>(wqe + 32);
        len = be32toh(data->byte_count);
        src = reinterpret_cast<const void*>(be64toh(data->addr));
        keys = keys && be32toh(data->lkey) == kLkey;
      }
      if (!ok && error_.empty()) error_ = "malformed WQE at index " + std::to_string(sq_ci_);
      if (ok && keys) std::memcpy(reinterpret_cast<void*>(be64toh(raddr->raddr)), src, len);
      if ((ctrl->fm_ce_se & MLX5_WQE_CTRL_CQ_UPDATE) || !keys) complete(keys);
      ++sq_ci_;
      executed_.store(sq_ci_);
    }
  }

  // Writes the CQE of WQE sq_ci_ (an error completion unless `ok`).
  void complete(bool ok) {
    // Room in the CQ: the consumer index the poller published in its doorbell record.
    while (cq_pi_ - (be32toh(__atomic_load_n(&q_.cq_dbr[0], __ATOMIC_ACQUIRE)) & 0xffffff) >= q_.cq_depth &&
           !stop_.load(std::memory_order_relaxed)) {
      sched_yield();
    }
    auto* cqe = reinterpret_cast<mlx5_cqe64*>(q_.cqes) + (cq_pi_ % q_.cq_depth);
    cqe->wqe_counter = htobe16(static_cast<uint16_t>(sq_ci_));
    const uint8_t op = ok ? MLX5_CQE_REQ : MLX5_CQE_REQ_ERR;
    __atomic_store_n(&cqe->op_own, static_cast<uint8_t>(op << 4 | ((cq_pi_ / q_.cq_depth) & 1)), __ATOMIC_RELEASE);
    ++cq_pi_;
  }

  NicView q_;
  uint64_t sq_ci_ = 0, cq_pi_ = 0;
  std::atomic<uint64_t> executed_{0}, inline_writes_{0};
  std::atomic<bool> stop_{false};
  std::string error_;
  std::thread thread_;
};

}  // namespace

TEST(IbgdaQueue, ConcurrentPostersThroughWrappingQueues) {
  constexpr int kThreads = 4, kPerThread = 1000, kBytes = 96;
  Queues q(/*sq_depth=*/64, /*cq_depth=*/16);  // both wrap many times
  std::vector<unsigned char> src(kThreads * kPerThread * kBytes), dst(src.size(), 0);
  std::vector<uint64_t> flags(kThreads * kPerThread / 8, 0);  // an inline WRITE after every 8th
  std::mt19937 rng(5);
  for (auto& b : src) b = static_cast<unsigned char>(rng());
  EmulatedNic nic(q.view());
  std::atomic<bool> stop{false};
  std::atomic<int> errors{0};
  std::thread poller([&] {
    while (!stop.load()) {
      const int r = poll(q.cq, q.sq);
      errors += r < 0;
      if (r == 0) sched_yield();
    }
  });
  std::vector<std::thread> posters;
  for (int t = 0; t < kThreads; ++t)
    posters.emplace_back([&, t] {
      std::mt19937 r(t);
      for (int i = 0; i < kPerThread; ++i) {
        const size_t off = (static_cast<size_t>(t) * kPerThread + i) * kBytes;
        post(q.sq, reinterpret_cast<uint64_t>(src.data() + off), kLkey, reinterpret_cast<uint64_t>(dst.data() + off),
             kRkey, kBytes, r() % 4 == 0);  // every fourth signaled: completions cover unsignaled ones
        if (i % 8 == 7) {
          const size_t f = (static_cast<size_t>(t) * kPerThread + i) / 8;
          postInline8(q.sq, reinterpret_cast<uint64_t>(&flags[f]), kRkey, 0x5eed000000000000ull + f, r() % 4 == 0,
                      true);
        }
      }
    });
  for (auto& p : posters) p.join();
  // A last signaled WQE (of zero bytes) completes everything before it.
  const uint64_t last = post(q.sq, reinterpret_cast<uint64_t>(src.data()), kLkey, reinterpret_cast<uint64_t>(dst.data()),
                             kRkey, 0, true);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (__atomic_load_n(&q.completed, __ATOMIC_ACQUIRE) < last + 1 && std::chrono::steady_clock::now() < deadline)
    sched_yield();
  stop = true;
  poller.join();
  ASSERT_EQ(__atomic_load_n(&q.completed, __ATOMIC_ACQUIRE), last + 1)
      << "completions stalled (NIC executed " << nic.executed() << ", error '" << nic.error() << "')";
  EXPECT_EQ(nic.error(), "");
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(nic.executed(), last + 1);
  EXPECT_EQ(q.completed, last + 1);
  EXPECT_EQ(0, std::memcmp(src.data(), dst.data(), src.size())) << "some write did not land";
  EXPECT_EQ(nic.inlineWrites(), flags.size());
  for (size_t f = 0; f < flags.size(); ++f) ASSERT_EQ(flags[f], 0x5eed000000000000ull + f) << "inline write " << f;
  // The doorbell register holds the last WQE's first 8 bytes, as the provider writes it.
  uint64_t want;
  std::memcpy(&want, q.wqes.data() + (last % q.sq.depth) * kBasicBlockBytes, 8);
  EXPECT_EQ(q.doorbell, want);
  EXPECT_EQ(be32toh(q.sq_dbr[MLX5_SND_DBR]), (last + 1) & 0xffff);
}

TEST(IbgdaQueue, ErrorCompletionIsReported) {
  Queues q(8, 4);
  EmulatedNic nic(q.view());
  std::vector<unsigned char> a(64, 7), b(64, 0);
  post(q.sq, reinterpret_cast<uint64_t>(a.data()), kLkey, reinterpret_cast<uint64_t>(b.data()), kRkey + 1, 64, true);
  int r = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while ((r = poll(q.cq, q.sq)) == 0 && std::chrono::steady_clock::now() < deadline) sched_yield();
  EXPECT_EQ(r, -1) << "a bad rkey must come back as an error completion";
  EXPECT_EQ(b[0], 0) << "and nothing must be written";
}

// The EP kernels' way: many threads share one QueuePair, nobody owns the completion queue
// (a poster that finds the send queue half full polls it under the lock), and only every
// eighth WQE asks for a completion. Host threads play the GPU threads.
TEST(IbgdaQueue, SharedQueuePairPollsItself) {
  constexpr int kThreads = 4, kPerThread = 1000, kBytes = 96;
  Queues q(/*sq_depth=*/64, /*cq_depth=*/16);  // >= 64 / 8 + 2, as queue.h asks
  QueuePair qp = q.shared(7);
  std::vector<unsigned char> src(kThreads * kPerThread * kBytes), dst(src.size(), 0);
  std::vector<uint64_t> flags(kThreads, 0);
  std::mt19937 rng(6);
  for (auto& b : src) b = static_cast<unsigned char>(rng());
  EmulatedNic nic(q.view());
  std::atomic<int> dropped{0};
  std::vector<std::thread> posters;
  for (int t = 0; t < kThreads; ++t)
    posters.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        const size_t off = (static_cast<size_t>(t) * kPerThread + i) * kBytes;
        dropped += !postQp(&qp, reinterpret_cast<uint64_t>(src.data() + off), kLkey,
                           reinterpret_cast<uint64_t>(dst.data() + off), kRkey, kBytes);
      }
      dropped += !postInlineQp(&qp, reinterpret_cast<uint64_t>(&flags[t]), kRkey, 0x5eed000000000000ull + t);
    });
  for (auto& p : posters) p.join();
  const uint64_t total = kThreads * (kPerThread + 1);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (nic.executed() < total && std::chrono::steady_clock::now() < deadline) sched_yield();
  EXPECT_EQ(nic.error(), "");
  EXPECT_EQ(dropped.load(), 0);
  EXPECT_EQ(qp.error, 0u);
  ASSERT_EQ(nic.executed(), total);
  // Completions arrived for signaled WQEs only: what the posters' polls saw is a multiple of 8.
  EXPECT_EQ(q.completed % 8, 0u);
  EXPECT_GE(q.completed + 64, total) << "the posters must have polled as the queue filled";
  EXPECT_EQ(0, std::memcmp(src.data(), dst.data(), src.size())) << "some write did not land";
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(flags[t], 0x5eed000000000000ull + t);
}

// A queue pair whose completion queue reports an error drops later posts instead of waiting
// forever for room (the receivers' timeouts then mask the peer).
TEST(IbgdaQueue, FailedQueuePairDropsPostsInsteadOfWaiting) {
  Queues q(16, 8);
  QueuePair qp = q.shared(3);
  EmulatedNic nic(q.view());
  std::vector<unsigned char> a(64, 7), b(64, 0);
  int dropped = 0;
  // A bad rkey: the NIC answers with an error completion (and keeps that WQE uncompleted).
  dropped += !postQp(&qp, reinterpret_cast<uint64_t>(a.data()), kLkey, reinterpret_cast<uint64_t>(b.data()), kRkey + 1, 64);
  for (int i = 0; i < 200; ++i)
    dropped += !postQp(&qp, reinterpret_cast<uint64_t>(a.data()), kLkey, reinterpret_cast<uint64_t>(b.data()), kRkey, 64);
  EXPECT_EQ(qp.error, 1u);
  EXPECT_GT(dropped, 0);
  EXPECT_EQ(q.ready, q.tickets) << "every ticket passed its turn on";
}

// Teardown: with selective signaling the last WQEs ask for no completion; drainQp() posts a
// signaled NOP behind them and returns once it completes, i.e. once every WQE has.
TEST(IbgdaQueue, DrainWaitsForEveryPostedWqe) {
  Queues q(64, 8);
  QueuePair qp = q.shared(63);
  std::vector<unsigned char> src(100 * 64), dst(src.size(), 0);
  std::mt19937 rng(11);
  for (auto& b : src) b = static_cast<unsigned char>(rng());
  EmulatedNic nic(q.view());
  for (int i = 0; i < 100; ++i)  // one signaled (index 63), the last 36 not
    ASSERT_TRUE(postQp(&qp, reinterpret_cast<uint64_t>(src.data() + i * 64), kLkey,
                       reinterpret_cast<uint64_t>(dst.data() + i * 64), kRkey, 64));
  ASSERT_TRUE(drainQp(&qp, std::chrono::steady_clock::now() + std::chrono::seconds(60)));
  EXPECT_EQ(q.completed, 101u) << "the NOP (index 100) completed, and so everything before it";
  EXPECT_GE(nic.executed(), 101u);
  EXPECT_EQ(nic.error(), "");
  EXPECT_EQ(0, std::memcmp(src.data(), dst.data(), src.size()));
  ASSERT_TRUE(drainQp(&qp, std::chrono::steady_clock::now() + std::chrono::seconds(60))) << "again: nothing new";
  EXPECT_EQ(q.completed, 102u);
}

// A NIC that stops answering, or a queue pair that failed, ends the drain (false) instead of
// holding the teardown.
TEST(IbgdaQueue, DrainGivesUp) {
  Queues q(16, 4);
  QueuePair qp = q.shared(63);
  std::vector<unsigned char> a(64, 7), b(64, 0);
  ASSERT_TRUE(postQp(&qp, reinterpret_cast<uint64_t>(a.data()), kLkey, reinterpret_cast<uint64_t>(b.data()), kRkey, 64));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(drainQp(&qp, t0 + std::chrono::milliseconds(200))) << "no NIC runs: the NOP never completes";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
  qp.error = 1;
  EXPECT_FALSE(drainQp(&qp, std::chrono::steady_clock::now() + std::chrono::seconds(60)));
}

#if defined(MOELINK_TEST_GPU_WQE)
#include "ibgda_wqe_gpu.h"

namespace {

// The GPU tests' queues: a 256-entry send queue, a 64-entry CQ with every entry invalid (as the
// driver initializes one), and 16384 x 64 bytes of random source data. "" or why not.
std::string prepareGpuRun(GpuQueueRun& run, unsigned seed) {
  const std::string why = gpuQueueAlloc(run, /*sq_depth=*/256, /*cq_depth=*/64, /*bytes=*/16384 * 64);
  if (!why.empty()) return why;
  std::mt19937 rng(seed);
  for (size_t i = 0; i < run.bytes; ++i) run.src[i] = static_cast<unsigned char>(rng());
  for (uint32_t i = 0; i < run.cq_depth; ++i)
    reinterpret_cast<mlx5_cqe64*>(run.cqes)[i].op_own = MLX5_CQE_INVALID << 4;
  return "";
}

}  // namespace

// The EP kernels' way on the GPU: 2048 threads share one QueuePair through a 256-entry send
// queue, every 16th WQE signaled, the posters polling the 64-entry completion queue themselves.
TEST(IbgdaQueue, GpuThreadsShareAQueuePair) {
  GpuQueueRun run;
  const std::string why = prepareGpuRun(run, 10);
  if (!why.empty()) GTEST_SKIP() << why;
  std::string err;
  {
    EmulatedNic nic(NicView{run.wqes, run.cqes, run.sq_dbr, run.cq_dbr, run.sq_depth, run.cq_depth});
    err = gpuQueuePairRun(run, /*blocks=*/16, /*threads=*/128, /*per_thread=*/8, /*wqe_bytes=*/64, kQpn, kLkey, kRkey,
                          /*signal_mask=*/15);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (err.empty() && nic.executed() < run.total && std::chrono::steady_clock::now() < deadline) sched_yield();
    EXPECT_EQ(nic.error(), "");
    EXPECT_EQ(nic.executed(), run.total);
  }
  ASSERT_EQ(err, "");
  EXPECT_EQ(run.errors, 0) << "dropped posts or an error completion";
  EXPECT_EQ(run.completed % 16, 0u);
  EXPECT_GE(run.completed + 256, run.total);
  EXPECT_EQ(0, std::memcmp(run.src, run.dst, run.total / 9 * 8 * 64)) << "some write did not land";
  for (uint64_t t = 0; t < run.total / 9; ++t)
    ASSERT_EQ(run.flags[t], 0x5eed000000000000ull + t) << "inline write of thread " << t;
  gpuQueueFree(run);
}

// 2048 GPU threads post 16384 signaled RDMA WRITEs, each thread's eight followed by a fenced
// inline WRITE of a flag, through a 256-entry send queue while one GPU thread polls a 64-entry
// completion queue: both wrap many times, posters wait for room, and the NIC waits for the
// poller's consumer index.
TEST(IbgdaQueue, GpuThreadsPostAndPollThroughWrappingQueues) {
  GpuQueueRun run;
  const std::string why = prepareGpuRun(run, 9);
  if (!why.empty()) GTEST_SKIP() << why;
  std::string err;
  {
    EmulatedNic nic(NicView{run.wqes, run.cqes, run.sq_dbr, run.cq_dbr, run.sq_depth, run.cq_depth});
    err = gpuQueueRun(run, /*blocks=*/16, /*threads=*/128, /*per_thread=*/8, /*wqe_bytes=*/64, kQpn, kLkey, kRkey);
    EXPECT_EQ(nic.error(), "");
    EXPECT_EQ(nic.executed(), run.total);
    EXPECT_EQ(nic.inlineWrites(), run.total / 9);  // each thread: 8 WRITEs, then an inline one
  }
  ASSERT_EQ(err, "");
  EXPECT_EQ(run.errors, 0) << "error completions, or the poller timed out";
  EXPECT_EQ(run.completed, run.total);
  EXPECT_EQ(0, std::memcmp(run.src, run.dst, run.total / 9 * 8 * 64)) << "some write did not land";
  for (uint64_t t = 0; t < run.total / 9; ++t)
    ASSERT_EQ(run.flags[t], 0x5eed000000000000ull + t) << "inline write of thread " << t;
  uint64_t want;  // the doorbell register holds the last WQE's first 8 bytes
  std::memcpy(&want, run.wqes + ((run.total - 1) % run.sq_depth) * kBasicBlockBytes, 8);
  EXPECT_EQ(*run.doorbell, want);
  EXPECT_EQ(be32toh(run.sq_dbr[MLX5_SND_DBR]), run.total & 0xffff);
  gpuQueueFree(run);
}
#endif
