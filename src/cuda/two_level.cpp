// The CUDA unit's two-level route (unit.h, TwoLevel): in a group that spans hosts with several
// of its ranks on each, all_reduce first reduces among a host's ranks on the in-host kernels,
// puts only each rank's block of the host's sum on the wire (to the ranks at its position on
// the other hosts: its rail), and gathers the reduced blocks among the host's ranks again;
// reduce_scatter reduces among the host's ranks (each gets its rail's blocks), then over the
// rail; all_gather gathers each rail's blocks over the wire, then the host's ranks' among them;
// broadcast sends the root's tensor over the root's rail (once to each other host), then each
// host's rank on that rail passes it on to its host's ranks.
#include <algorithm>
#include <chrono>

#include "moelink/cuda/two_level.h"
#include "moelink/torch/c10d_store.h"
#include "moelink/transfer/metadata_store.h"

#include "unit.h"

namespace moelink::cuda {

void CudaCollectives::setUpTwoLevel(bool capturing) {
  collective::CollectiveWorker& w = *g_.worker;
  const uint64_t epoch = w.epoch();
  two_level_epoch_ = epoch;
  if (capable_) return;  // one host: the in-host kernels serve the whole group
  // Real hosts, cut into virtual ones of MOELINK_RANKS_PER_HOST ranks where it is set.
  const auto ranks = twoLevelRanks(size_, rank_, [&](int q) {
    return g_.host_of(q) + "#" + std::to_string(ranks_per_host_ > 0 ? q / ranks_per_host_ : 0);
  }, kExchangeMaxRanks);
  if (!ranks) return;  // the same answer on every rank: nothing to agree on
  // The areas of an earlier epoch (its ops were failed by the change, or ran before it): once
  // the group's ops issued so far have run, they go, or are kept for the graphs that name
  // them. (A capture may not wait for them: they stay, unused, until a later epoch's first op.)
  if (two_level_ && !capturing) {
    drainGroupOps();
    std::unique_ptr<TwoLevel> old;
    {
      std::lock_guard<std::mutex> g(mu_);  // path() reads it
      old = std::move(two_level_);
    }
    if (two_level_captured_) retire(std::move(old->staging), old->gather_rows);
    two_level_captured_ = false;
  }
  // Every rank of an epoch sees the same active ranks: while one is out, every rank runs flat
  // without asking the others.
  for (int q = 0; q < size_; ++q)
    if (!w.isActive(q)) return;
  const int n = static_cast<int>(ranks->local.size());
  bool ready = !capturing;
  try {
    ready = ready && settings::flag("MOELINK_HOST_TWO_LEVEL");
  } catch (const moelink::Error& e) {
    LOG(WARNING) << "moelink: no two-level route for CUDA collectives: " << e.what();
    ready = false;
  }
  auto t = std::make_unique<TwoLevel>();
  t->ranks = *ranks;
  if (ready) {
    try {
      t->tuning = ExchangeTuning::fromEnv(n);
    } catch (const moelink::Error& e) {
      LOG(WARNING) << "moelink: no two-level route for CUDA collectives: " << e.what();
      ready = false;
    }
  }
  // Every rank says whether it will open this host's areas, then whether it could: a rank that
  // takes the route while a peer on another host does not would fail every op it runs. The wait
  // for a rank that does not answer ends when the membership changes or the store's timeout
  // passes, with no.
  // The keys and areas are the epoch's own: a replacement process answers afresh.
  auto moved = [&w, epoch] { return w.epoch() != epoch; };
  const std::string tag = "two_level/e" + std::to_string(epoch);
  C10dStore store(g_.store);
  const auto timeout = std::chrono::duration_cast<std::chrono::milliseconds>(g_.store->getTimeout());
  auto everyRankSays = [&](const char* what, bool yes) {
    return transfer::storeAllAgree(store, "moelink_cuda/" + tag + "/" + what, size_, yes, timeout, moved);
  };
  if (!everyRankSays("ready", ready)) return;
  c10::cuda::CUDAGuard dg(static_cast<c10::DeviceIndex>(device_));
  std::string why;
  try {
    t->staging = ExchangeStaging::open(g_.store, rank_, size_, t->tuning, &why, tag, t->ranks.local, moved);
  } catch (const std::exception& e) {  // the other ranks hear "no" below, as for any failure here
    why = e.what();
    t->staging.reset();
  }
  if (!everyRankSays("open", t->staging != nullptr)) {
    LOG(WARNING) << "moelink: no two-level route for CUDA collectives (every rank on the wire): "
                 << (t->staging ? "a rank on another host could not map its host's areas" : why);
    return;
  }
  const int hosts = ranks->hosts;
  std::vector<int64_t> rows(static_cast<size_t>(n * hosts));
  for (int p = 0; p < n; ++p)
    for (int j = 0; j < hosts; ++j) rows[static_cast<size_t>(p * hosts + j)] = ranks->rails[p][j];
  t->gather_rows = at::tensor(rows, at::TensorOptions().dtype(at::kLong)).to(at::Device(at::kCUDA, device_));
  {
    std::lock_guard<std::mutex> g(mu_);  // path() reads it
    two_level_ = std::move(t);
  }
  // The route's kernels and cross-host steps give up on the abort word, raised by the change
  // that ended the last epoch: clear it, unless another change came meanwhile (the worker sets
  // the epoch before it calls the listeners, which raise both again from here on).
  __atomic_store_n(abort_->host(0), 0u, __ATOMIC_RELEASE);
  changed_.store(false, std::memory_order_release);
  if (w.epoch() != epoch) {
    changed_.store(true, std::memory_order_release);
    __atomic_store_n(abort_->host(0), 1u, __ATOMIC_RELEASE);
  }
  if (epoch == 0)
    VLOG(1) << "moelink: rank " << rank_ << " CUDA collectives in two levels: " << n << " ranks per host, "
            << ranks->hosts << " hosts";
  else
    LOG(INFO) << "moelink: rank " << rank_ << " CUDA collectives in two levels again from epoch " << epoch << ": "
              << n << " ranks per host, " << ranks->hosts << " hosts";
}

std::function<std::string()> CudaCollectives::railCheck(Op& op, const char* what, bool after_in_host) {
  if (op.captured) two_level_captured_ = true;  // (every two-level op asks this: a graph names the areas)
  // The in-host step's status word starts clear (a captured op's is the sink that every replay
  // shares), so that the cross-host step can ask whether it succeeded.
  ExchangeStatus* status = nullptr;
  if (after_in_host) {
    status = status_->host(op.slot);
    StreamMemOps::write(op.stream->stream(), reinterpret_cast<uint32_t*>(&status_->dev(op.slot)->code),
                        ExchangeStatus::kOk);
  }
  const uint32_t* abort = abort_->host(0);
  const uint64_t timeout_ms = static_cast<uint64_t>(op.timeout.count());
  const std::vector<int> peers = two_level_->ranks.local;
  const std::string op_name = what;
  return [abort, status, timeout_ms, peers, op_name]() -> std::string {
    if (__atomic_load_n(abort, __ATOMIC_ACQUIRE))
      return "the group's membership changed while this two-level " + op_name +
             " ran (its in-host kernels give up; the next ops run with every rank on the wire until the group is "
             "whole again)";
    if (!status || __atomic_load_n(&status->code, __ATOMIC_ACQUIRE) == ExchangeStatus::kOk) return "";
    ExchangeStatus s;
    std::memcpy(&s, status, sizeof s);
    if (s.peer >= 0 && s.peer < static_cast<int>(peers.size())) s.peer = peers[s.peer];
    return "the in-host reduce-scatter of this two-level " + op_name + " failed: " + describeStatus(s, timeout_ms);
  };
}

void CudaCollectives::allreduceTwoLevel(Op& op, const at::Tensor& buf, ReduceOp rop) {
  const TwoLevel& tl = *two_level_;
  const TwoLevelRanks& h = tl.ranks;
  const InHostSet local{tl.staging.get(), h.local, h.me, tl.tuning};
  const int n = static_cast<int>(h.local.size());
  const auto t = toDType(buf.scalar_type());
  const uint64_t count = static_cast<uint64_t>(buf.numel()), e = collective::elementSize(t);
  const auto blocks = allreduceBlocks(n, count, t);
  const uint64_t len = blocks[h.me].second - blocks[h.me].first;
  // This rank's block of the host's reduction (on the op's stream, which frees it in order).
  at::Tensor block = at::empty({static_cast<int64_t>(len)}, buf.options());
  RailStep step{h.rail, h.local, count * e, railCheck(op, "all_reduce", true)};
  launch(op, exchangeAllreduceScatter(n, h.me, count, t, rop), local, ptr(buf), ptr(block));
  pipe_->allreduce(pipeCall(op), ptr(block), len, t, rop, &step);
  std::vector<uint64_t> send_off(n, 0), send_bytes(n, len * e), recv_off(n), recv_bytes(n);
  for (int q = 0; q < n; ++q) {
    recv_off[q] = blocks[q].first * e;
    recv_bytes[q] = (blocks[q].second - blocks[q].first) * e;
  }
  launch(op, exchangeAlltoall(n, h.me, send_off, send_bytes, recv_off, recv_bytes), local, ptr(block), ptr(buf));
}

void CudaCollectives::allgatherTwoLevel(Op& op, const at::Tensor& in, const at::Tensor& out) {
  const TwoLevel& tl = *two_level_;
  const TwoLevelRanks& h = tl.ranks;
  const InHostSet local{tl.staging.get(), h.local, h.me, tl.tuning};
  const int n = static_cast<int>(h.local.size()), hosts = static_cast<int>(h.rail.size());
  const uint64_t bytes = nbytes(in);
  // The rail's blocks by position on the rail, then every host rank's rail's blocks by the
  // rank's position on the host (on the op's stream, which frees them in order).
  const auto rows = [&](int count) {
    return at::empty({static_cast<int64_t>(count * bytes)}, in.options().dtype(at::kByte));
  };
  at::Tensor rail_rows = rows(hosts), host_rows = rows(n * hosts);
  RailStep step{h.rail, h.local, bytes * static_cast<uint64_t>(size_), railCheck(op, "all_gather", false)};
  pipe_->allgather(pipeCall(op), ptr(in), ptr(rail_rows), bytes, &step);
  launch(op, exchangeAllgather(n, h.me, static_cast<uint64_t>(hosts) * bytes), local, ptr(rail_rows),
         ptr(host_rows));
  if (bytes == 0) return;
  // Row p * hosts + j is the block of rank rails[p][j].
  const auto b = static_cast<int64_t>(bytes);
  out.view({-1}).view(at::kByte).view({size_, b}).index_copy_(0, tl.gather_rows, host_rows.view({n * hosts, b}));
}

void CudaCollectives::broadcastTwoLevel(Op& op, const at::Tensor& buf, int root) {
  const TwoLevel& tl = *two_level_;
  const TwoLevelRanks& h = tl.ranks;
  const InHostSet local{tl.staging.get(), h.local, h.me, tl.tuning};
  const int n = static_cast<int>(h.local.size());
  const uint64_t bytes = nbytes(buf);
  // The root's position on its host: the rail that carries the tensor between the hosts, and
  // the rank that passes it on within each host.
  int at = 0;
  while (at < n && !std::binary_search(h.rails[at].begin(), h.rails[at].end(), root)) ++at;
  TORCH_CHECK_VALUE(at < n, "moelink broadcast: root rank ", root, " is not in the group");
  RailStep step{h.rail, h.local, bytes, railCheck(op, "broadcast", false)};
  pipe_->broadcast(pipeCall(op), ptr(buf), bytes, root, &step);
  launch(op, broadcastForwards(n, bytes, tl.tuning) ? exchangeBroadcastForward(n, h.me, bytes, at)
                                                    : exchangeBroadcast(n, h.me, bytes, at),
         local, ptr(buf), ptr(buf));
}

void CudaCollectives::reduceScatterTwoLevel(Op& op, const at::Tensor& in, const at::Tensor& out, ReduceOp rop) {
  const TwoLevel& tl = *two_level_;
  const TwoLevelRanks& h = tl.ranks;
  const InHostSet local{tl.staging.get(), h.local, h.me, tl.tuning};
  const int n = static_cast<int>(h.local.size()), hosts = static_cast<int>(h.rail.size());
  const auto t = toDType(out.scalar_type());
  const uint64_t count = static_cast<uint64_t>(out.numel()), e = collective::elementSize(t);
  // The input's blocks by (position on the host, position on its rail): position p's run is
  // what the host's rank p reduces, the blocks of its rail (on the op's stream, as below).
  const at::Tensor by_rail = in.view({size_, static_cast<int64_t>(count)}).index_select(0, tl.gather_rows);
  // This rank's rail's blocks, each the host's reduction, by position on the rail.
  at::Tensor host_sums = at::empty({static_cast<int64_t>(static_cast<uint64_t>(hosts) * count)}, out.options());
  RailStep step{h.rail, h.local, count * e * static_cast<uint64_t>(size_), railCheck(op, "reduce_scatter", true)};
  launch(op, exchangeReduceScatter(n, h.me, static_cast<uint64_t>(hosts) * count, t, rop), local, ptr(by_rail),
         ptr(host_sums));
  pipe_->reduceScatter(pipeCall(op), ptr(host_sums), ptr(out), count, t, rop, &step);
}

}  // namespace moelink::cuda
