// The in-host GPU collectives' plans (cuda/exchange.h), run on the CPU: a model of the
// exchange kernel moves the bytes of every (source, destination) pair round by round and
// piece by piece, exactly as the kernel splits them, and each builder's result is checked
// against the collective it stands for, over the whole group and over a sub-group of it.
// (exchange_test.cpp: the piece split, the protocols' thresholds, the layout, the mismatch
// messages and the tuning.)
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "moelink/cuda/exchange.h"
#include "moelink/collective/reduce.h"
#include "moelink/common/error.h"

using namespace moelink::collective;
using namespace moelink::cuda;

namespace {

using Bytes = std::vector<char>;

// Runs one exchange per rank (xs[r] with in[r] / out[r]) the way the kernel does: for each
// round and block, the piece of every pair; then the consumer's copy or rank-ordered reduce.
// `launch_as`: the exchanges whose launches move these pairs, where xs are some of their pairs
// (their blocks).
void model(const std::vector<Exchange>& xs, std::vector<Bytes>& in, std::vector<Bytes>& out,
           const ExchangeTuning& t, std::vector<uint64_t> out_base = {},
           const std::vector<Exchange>* launch_as = nullptr) {
  const int n = static_cast<int>(xs.size());
  if (out_base.empty()) out_base.assign(n, 0);
  const std::vector<Exchange>& launches = launch_as ? *launch_as : xs;
  const uint64_t R = exchangeRoundBytes(launches[0], t);
  // The blocks each rank launches: every piece it sends, receives or reduces must be on one.
  std::vector<int> launched(n);
  for (int r = 0; r < n; ++r) launched[r] = exchangeBlocksWithWork(launches[r], t);
  int pieces_of_round = 0;  // of a full round: what a pair longer than two rounds waits on
  for (uint64_t lo = 0, hi = 0; pieces_of_round < t.blocks; ++pieces_of_round) {
    exchangePiece(R, pieces_of_round, t.blocks, &lo, &hi);
    if (lo >= hi) break;
  }
  for (int r = 0; r < n; ++r)
    if (xs[r].mode == ExchangeMode::kReduce)
      for (uint64_t k = 0; k * R < xs[r].reduce_bytes; ++k)
        for (int b = 0; b < t.blocks; ++b) {
          uint64_t lo, hi;
          exchangePiece(exchangeRoundLen(xs[r].reduce_bytes, k, R), b, t.blocks, &lo, &hi);
          if (lo < hi) {
            EXPECT_LT(b, launched[r]) << "rank " << r << " reduces piece " << b;
          }
        }
  // What each consumer received from each source, assembled from pieces.
  std::vector<std::vector<Bytes>> got(n, std::vector<Bytes>(n));
  for (int p = 0; p < n; ++p)
    for (int q = 0; q < n; ++q) {
      ASSERT_EQ(xs[q].send_bytes[p], p == q ? xs[q].send_bytes[p] : xs[p].recv_bytes[q]) << q << "->" << p;
      got[p][q].assign(xs[q].send_bytes[p], 0);
    }
  for (int q = 0; q < n; ++q)
    for (int p = 0; p < n; ++p) {
      const uint64_t bytes = xs[q].send_bytes[p];
      std::vector<int> covered(bytes, 0);
      for (uint64_t r = 0; r * R < bytes; ++r) {
        const uint64_t len = exchangeRoundLen(bytes, r, R);
        for (int b = 0; b < t.blocks; ++b) {
          uint64_t lo, hi;
          exchangePiece(len, b, t.blocks, &lo, &hi);
          if (lo < hi) {
            EXPECT_LT(b, launched[q]) << "sender " << q << " has no block for piece " << b;
            EXPECT_LT(b, launched[p]) << "receiver " << p << " has no block for piece " << b;
          }
          for (uint64_t i = lo; i < hi; ++i) {
            got[p][q][r * R + i] = in[q][xs[q].send_off[p] + r * R + i];
            covered[r * R + i]++;
          }
        }
      }
      for (uint64_t i = 0; i < bytes; ++i) ASSERT_EQ(covered[i], 1) << "byte " << i << " of " << q << "->" << p;
      if (p != q && bytes > 2 * R) {  // the sender waits for the consumer's acks of every piece of a round
        EXPECT_EQ(launched[q], pieces_of_round) << q << "->" << p;
        EXPECT_EQ(launched[p], pieces_of_round) << q << "->" << p;
      }
    }
  for (int p = 0; p < n; ++p) {
    const Exchange& x = xs[p];
    if (x.mode == ExchangeMode::kCopy) {
      for (int q = 0; q < n; ++q) {
        const uint64_t bytes = q == p ? x.send_bytes[p] : x.recv_bytes[q];
        if (bytes) std::memcpy(out[p].data() + out_base[p] + x.recv_off[q], got[p][q].data(), bytes);
      }
    } else if (x.reduce_bytes) {
      std::vector<const void*> srcs;
      for (int q = 0; q < n; ++q) srcs.push_back(q == p ? in[p].data() + x.send_off[p] : got[p][q].data());
      std::vector<char> scratch;
      const size_t count = x.reduce_bytes / elementSize(x.dtype);
      Bytes res(x.reduce_bytes);
      reduceOrdered(res.data(), srcs, count, x.dtype, x.redop, scratch);
      if (x.redop == ReduceOp::kAvg) divideInPlace(res.data(), count, x.dtype, n);
      std::memcpy(out[p].data() + out_base[p], res.data(), x.reduce_bytes);
    }
  }
}

// The two-shot Lamport all_reduce (ExchangeMode::kReduceGather), as lamport.cu moves it: each
// rank reduces its block from the peers' pairs and its own input into out + send_off[me], then
// sends that block to every peer, which places it at its own send_off of that rank.
void modelTwoShotLamport(const std::vector<Exchange>& xs, const std::vector<Bytes>& in, std::vector<Bytes>& out) {
  const int n = static_cast<int>(xs.size());
  std::vector<Bytes> reduced(n);
  for (int p = 0; p < n; ++p) {
    const Exchange& x = xs[p];
    ASSERT_EQ(x.mode, ExchangeMode::kReduceGather);
    ASSERT_LE(x.reduce_bytes, kLamportTwoShotBlockBytes);
    std::vector<const void*> srcs;
    for (int q = 0; q < n; ++q) {
      if (q != p) {
        ASSERT_EQ(xs[q].send_bytes[p], x.reduce_bytes) << q << "->" << p;
        ASSERT_EQ(x.recv_bytes[q], x.reduce_bytes) << q << "->" << p;
      }
      srcs.push_back(in[q].data() + xs[q].send_off[p]);
    }
    std::vector<char> scratch;
    const size_t count = x.reduce_bytes / elementSize(x.dtype);
    reduced[p].assign(x.reduce_bytes, 0);
    reduceOrdered(reduced[p].data(), srcs, count, x.dtype, x.redop, scratch);
    if (x.redop == ReduceOp::kAvg) divideInPlace(reduced[p].data(), count, x.dtype, n);
  }
  for (int p = 0; p < n; ++p)
    for (int q = 0; q < n; ++q) {
      // the block's place is the same on every rank; its length what its owner reduced
      ASSERT_EQ(xs[p].send_off[q], xs[q].send_off[q]);
      if (q != p) {
        ASSERT_EQ(xs[p].send_bytes[q], xs[q].reduce_bytes);
      }
      // the kernel's lines run over the longest block: block 0 (send_bytes[0], or this rank's own)
      ASSERT_LE(xs[q].reduce_bytes, std::max(xs[p].reduce_bytes, xs[p].send_bytes[0]));
      if (!reduced[q].empty()) std::memcpy(out[p].data() + xs[p].send_off[q], reduced[q].data(), reduced[q].size());
    }
}

// The forwarding broadcast (ExchangeMode::kForward), as exchange.cu moves it: the root's pairs
// land first (each rank's consuming block b places piece b of round r of the root's pair, and
// passes the same piece on in the same stores), then every rank passes on what landed, the same
// bytes as `io` holds where it landed. In place, as the kernel runs it.
void modelForward(const std::vector<Exchange>& xs, std::vector<Bytes>& io, const ExchangeTuning& t) {
  const int n = static_cast<int>(xs.size());
  ASSERT_GT(n, 2);
  const int root = xs[0].forward_from;
  std::vector<Exchange> from_root, passed_on;
  for (int p = 0; p < n; ++p) {
    const Exchange& x = xs[p];
    ASSERT_EQ(x.mode, ExchangeMode::kForward);
    ASSERT_EQ(x.forward_from, root);
    EXPECT_FALSE(exchangeSplits(x, t)) << "rank " << p;  // the root pushes, the others consume and pass on
    EXPECT_FALSE(exchangeLamport(x, t));
    EXPECT_EQ(exchangeLamportPairs(x, t), 0u);  // every piece passed on is a staged piece
    Exchange a = x, b = x;  // copies of the two kinds of pairs
    a.mode = b.mode = ExchangeMode::kCopy;
    for (int q = 0; q < n; ++q) {
      if (p == root) {
        ASSERT_EQ(x.recv_bytes[q], 0u) << "the root receives nothing";
        b.send_bytes[q] = 0;
        continue;
      }
      if (q != root && q != p) {
        // every pair passed on is the root's pair again: the same pieces, from where it lands
        ASSERT_EQ(x.send_bytes[q], x.recv_bytes[root]) << p << "->" << q;
        ASSERT_EQ(x.send_off[q], x.recv_off[root]) << p << "->" << q;
        // and what the others pass on lands elsewhere
        ASSERT_TRUE(x.recv_off[q] + x.recv_bytes[q] <= x.recv_off[root] ||
                    x.recv_off[root] + x.recv_bytes[root] <= x.recv_off[q])
            << p << " <- " << q;
      }
      ASSERT_EQ(x.send_bytes[root], 0u);
      if (q != root) a.recv_bytes[q] = 0;
      a.send_bytes[q] = 0;
      if (q == root) b.recv_bytes[q] = 0;
    }
    from_root.push_back(a);
    passed_on.push_back(b);
  }
  model(from_root, io, io, t, {}, &xs);
  model(passed_on, io, io, t, {}, &xs);
}

// Rank r's input of `count` floats: r * 1000 + i.
Bytes floats(int r, uint64_t count) {
  std::vector<float> v(count);
  for (uint64_t i = 0; i < count; ++i) v[i] = static_cast<float>(r * 1000 + i % 997);
  Bytes b(count * 4);
  if (count) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

float at(const Bytes& b, uint64_t i) {
  float f;
  std::memcpy(&f, b.data() + 4 * i, 4);
  return f;
}

ExchangeTuning small() {
  ExchangeTuning t;
  t.round_bytes = 64 << 10;  // several rounds at the sizes below
  t.blocks = 3;
  return t;
}

// Rank r's all-to-all plan when r sends bytes(r, q) to q, packed in rank order both ways.
template <typename PairBytes>
Exchange packedAlltoall(int n, int r, PairBytes bytes) {
  std::vector<uint64_t> so(n), sb(n), ro(n), rb(n);
  uint64_t s = 0, t = 0;
  for (int q = 0; q < n; ++q) {
    sb[q] = bytes(r, q);
    rb[q] = bytes(q, r);
    so[q] = s;
    ro[q] = t;
    s += sb[q];
    t += rb[q];
  }
  return exchangeAlltoall(n, r, so, sb, ro, rb);
}

// The two-shot staged all_reduce (ExchangeMode::kReduceGatherStaged), as exchange.cu moves it, in
// rounds of exchangeRoundBytes: the reduce-scatter half's pairs and reduction into place at
// send_off[me], then each rank's reduced block, piece by piece as it was reduced, to every peer,
// which places it at its own send_off of that rank.
void modelTwoShotStaged(const std::vector<Exchange>& xs, std::vector<Bytes>& in, std::vector<Bytes>& out,
                        const ExchangeTuning& t) {
  const int n = static_cast<int>(xs.size());
  std::vector<Exchange> scatter, gather;
  std::vector<uint64_t> base;
  for (int p = 0; p < n; ++p) {
    const Exchange& x = xs[p];
    ASSERT_EQ(x.mode, ExchangeMode::kReduceGatherStaged);
    Exchange s = x;
    s.mode = ExchangeMode::kReduce;
    scatter.push_back(s);
    base.push_back(x.send_off[p]);
    Exchange g = x;  // this rank's reduced block to every peer, each peer's into place
    g.mode = ExchangeMode::kCopy;
    for (int q = 0; q < n; ++q) {
      g.send_off[q] = x.send_off[p];
      g.send_bytes[q] = q == p ? 0 : x.reduce_bytes;
      g.recv_off[q] = x.send_off[q];
      g.recv_bytes[q] = q == p ? 0 : x.send_bytes[q];
    }
    gather.push_back(g);
  }
  model(scatter, in, out, t, base, &xs);
  std::vector<Bytes> mid = out;
  model(gather, mid, out, t, {}, &xs);
}

// Bytes of the packed input / output of an all-to-all plan.
uint64_t sentBytes(const Exchange& x) { return x.send_off.back() + x.send_bytes.back(); }
uint64_t receivedBytes(const Exchange& x) { return x.recv_off.back() + x.recv_bytes.back(); }

class ExchangePlan : public ::testing::TestWithParam<std::tuple<int, uint64_t>> {};

TEST_P(ExchangePlan, AllreduceOneShotAndTwoShot) {
  auto [n, count] = GetParam();
  for (int two : {0, 1, 2}) {  // one exchange, the two-shot staged exchange, the two-shot Lamport one
    std::vector<Exchange> a, b;
    std::vector<Bytes> in, out;
    std::vector<uint64_t> base;
    for (int r = 0; r < n; ++r) {
      in.push_back(floats(r, count));
      out.push_back(in.back());  // in place
    }
    if (two == 0) {
      for (int r = 0; r < n; ++r) a.push_back(exchangeAllreduceOneShot(n, r, count, DType::kFloat32, ReduceOp::kSum));
      model(a, in, out, small());
    } else if (two == 2) {
      for (int r = 0; r < n; ++r) a.push_back(exchangeAllreduceTwoShot(n, r, count, DType::kFloat32, ReduceOp::kSum));
      modelTwoShotLamport(a, in, out);
    } else {
      for (int r = 0; r < n; ++r)
        a.push_back(exchangeAllreduceTwoShotStaged(n, r, count, DType::kFloat32, ReduceOp::kSum));
      modelTwoShotStaged(a, in, out, small());
    }
    for (int r = 0; r < n; ++r)
      for (uint64_t i = 0; i < count; ++i) {
        float want = 0;
        for (int q = 0; q < n; ++q) want += at(in[q], i);
        ASSERT_EQ(at(out[r], i), want) << "rank " << r << " element " << i << " plan " << two;
      }
  }
}

TEST_P(ExchangePlan, AllgatherGatherScatterBroadcast) {
  auto [n, count] = GetParam();
  const uint64_t bytes = count * 4;
  std::vector<Bytes> in, out;
  std::vector<Exchange> ag, ga, sc, bc;
  const int root = n - 1;
  for (int r = 0; r < n; ++r) {
    in.push_back(floats(r, count));
    ag.push_back(exchangeAllgather(n, r, bytes));
    ga.push_back(exchangeGather(n, r, bytes, root));
    bc.push_back(exchangeBroadcast(n, r, bytes, root));
  }
  out.assign(n, Bytes(n * bytes));
  model(ag, in, out, small());
  for (int r = 0; r < n; ++r)
    for (int q = 0; q < n && bytes; ++q) ASSERT_EQ(0, std::memcmp(out[r].data() + q * bytes, in[q].data(), bytes));

  out.assign(n, Bytes(n * bytes, 0));
  model(ga, in, out, small());
  for (int q = 0; q < n && bytes; ++q) ASSERT_EQ(0, std::memcmp(out[root].data() + q * bytes, in[q].data(), bytes));

  std::vector<Bytes> io = in;
  model(bc, io, io, small());
  for (int r = 0; r < n; ++r) ASSERT_EQ(io[r], in[root]);

  // the forwarding broadcast (n > 2), from every root, in place, in one round and several
  for (const ExchangeTuning& t : {small(), ExchangeTuning{}}) {
    for (int rt = 0; rt < n && n > 2; ++rt) {
      std::vector<Bytes> io = in;
      std::vector<Exchange> xs;
      for (int r = 0; r < n; ++r) {
        xs.push_back(exchangeBroadcastForward(n, r, bytes, rt));
        EXPECT_EQ(xs.back().root, rt);
        EXPECT_EQ(xs.back().op_bytes, bytes);
        EXPECT_FALSE(exchangeOutputMeetsInput(xs.back(), r, io[r].data(), io[r].data()));
      }
      modelForward(xs, io, t);
      for (int r = 0; r < n; ++r) ASSERT_EQ(io[r], in[rt]) << "broadcast from " << rt << " on " << r;
    }
  }

  std::vector<Bytes> sin(n);
  sin[root] = Bytes(n * bytes);
  for (int q = 0; q < n && bytes; ++q) std::memcpy(sin[root].data() + q * bytes, in[q].data(), bytes);
  for (int r = 0; r < n; ++r) sc.push_back(exchangeScatter(n, r, bytes, root));
  out.assign(n, Bytes(bytes));
  model(sc, sin, out, small());
  for (int r = 0; r < n; ++r) ASSERT_EQ(out[r], in[r]);
}

TEST_P(ExchangePlan, ReduceScatterAndReduce) {
  auto [n, count] = GetParam();
  std::vector<Bytes> in, out;
  std::vector<Exchange> rs, rd;
  for (int r = 0; r < n; ++r) {
    in.push_back(floats(r, count * n));
    rs.push_back(exchangeReduceScatter(n, r, count, DType::kFloat32, ReduceOp::kMax));
    rd.push_back(exchangeReduce(n, r, count * n, DType::kFloat32, ReduceOp::kSum, 0));
  }
  out.assign(n, Bytes(count * 4));
  model(rs, in, out, small());
  for (int r = 0; r < n; ++r)
    for (uint64_t i = 0; i < count; ++i) {
      float want = at(in[0], r * count + i);
      for (int q = 1; q < n; ++q) want = std::max(want, at(in[q], r * count + i));
      ASSERT_EQ(at(out[r], i), want);
    }
  std::vector<Bytes> io = in;
  model(rd, io, io, small());
  for (uint64_t i = 0; i < count * n; ++i) {
    float want = 0;
    for (int q = 0; q < n; ++q) want += at(in[q], i);
    ASSERT_EQ(at(io[0], i), want);
  }
}

TEST_P(ExchangePlan, UnevenAlltoall) {
  auto [n, count] = GetParam();
  // rank r sends (r + 1) * (q + 1) * count / 4 bytes to q (odd sizes included)
  auto bytes = [&](int r, int q) { return static_cast<uint64_t>((r + 1) * (q + 1)) * (count / 4 + 1) + r; };
  std::vector<Bytes> in(n), out(n);
  std::vector<Exchange> xs;
  for (int r = 0; r < n; ++r) {
    xs.push_back(packedAlltoall(n, r, bytes));
    in[r].resize(sentBytes(xs.back()));
    for (uint64_t i = 0; i < in[r].size(); ++i) in[r][i] = static_cast<char>(r * 31 + i * 7);
    out[r].assign(receivedBytes(xs.back()), 0);
  }
  model(xs, in, out, small());
  for (int r = 0; r < n; ++r)
    for (int q = 0; q < n; ++q)
      ASSERT_EQ(0, std::memcmp(out[r].data() + xs[r].recv_off[q], in[q].data() + xs[q].send_off[r], bytes(q, r)));
}

// After a membership change: the full group's plans restricted to the active ranks, moved
// among those only, give the collective over them, with zeros where an inactive rank's data
// would land.
class ExchangeSubgroup : public ::testing::TestWithParam<std::vector<int>> {};

TEST_P(ExchangeSubgroup, CollectivesOverTheActiveRanks) {
  const int n = 5;
  const std::vector<int> members = GetParam();
  const int m = static_cast<int>(members.size());
  const uint64_t count = 20001, bytes = count * 4;
  const ExchangeTuning t = small();
  auto restricted = [&](auto build) {
    std::vector<Exchange> xs;
    for (int r : members) xs.push_back(restrictExchange(build(r), members));
    return xs;
  };
  auto zeroDropped = [&](auto build, std::vector<Bytes>& out) {
    for (int j = 0; j < m; ++j)
      for (auto [off, len] : droppedRanges(build(members[j]), members)) std::memset(out[j].data() + off, 0, len);
  };
  std::vector<Bytes> in;
  for (int r : members) in.push_back(floats(r, count * n));

  // all_gather: the members' blocks; zeros in the others'.
  auto ag = [&](int r) { return exchangeAllgather(n, r, bytes); };
  std::vector<Bytes> out(m, Bytes(n * bytes, 7));
  zeroDropped(ag, out);
  model(restricted(ag), in, out, t);
  for (int j = 0; j < m; ++j)
    for (int q = 0, k = 0; q < n; ++q) {
      const bool active = k < m && members[k] == q;
      for (uint64_t i = 0; i < bytes; ++i)
        ASSERT_EQ(out[j][q * bytes + i], active ? in[k][i] : 0) << "rank " << members[j] << " slot " << q;
      k += active;
    }

  // all_reduce (one-shot) SUM and AVG: over the members.
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
    auto ar = [&](int r) { return exchangeAllreduceOneShot(n, r, count, DType::kFloat32, op); };
    std::vector<Bytes> io(m);
    for (int j = 0; j < m; ++j) io[j] = Bytes(in[j].begin(), in[j].begin() + bytes);
    std::vector<Bytes> src = io;
    model(restricted(ar), src, io, t);
    for (int j = 0; j < m; ++j)
      for (uint64_t i = 0; i < count; i += 97) {
        float want = 0;
        for (int k = 0; k < m; ++k) want += at(src[k], i);
        if (op == ReduceOp::kAvg) want /= m;
        ASSERT_FLOAT_EQ(at(io[j], i), want);
      }
  }

  // reduce_scatter MAX: each member's own block over the members.
  auto rs = [&](int r) { return exchangeReduceScatter(n, r, count, DType::kFloat32, ReduceOp::kMax); };
  out.assign(m, Bytes(bytes));
  model(restricted(rs), in, out, t);
  for (int j = 0; j < m; ++j)
    for (uint64_t i = 0; i < count; i += 89) {
      float want = at(in[0], members[j] * count + i);
      for (int k = 1; k < m; ++k) want = std::max(want, at(in[k], members[j] * count + i));
      ASSERT_EQ(at(out[j], i), want);
    }

  // gather to the last member; uneven all_to_all among the members, zeros from the others.
  const int root = members.back();
  auto ga = [&](int r) { return exchangeGather(n, r, bytes, root); };
  out.assign(m, Bytes(n * bytes, 7));
  zeroDropped(ga, out);
  model(restricted(ga), in, out, t);
  for (int q = 0, k = 0; q < n; ++q) {
    const bool active = k < m && members[k] == q;
    const char* slot = out[m - 1].data() + q * bytes;
    if (active)
      ASSERT_EQ(0, std::memcmp(slot, in[k].data(), bytes)) << "gather slot " << q;
    else
      ASSERT_TRUE(std::all_of(slot, slot + bytes, [](char c) { return c == 0; })) << "gather slot " << q;
    k += active;
  }
  auto pair = [](int r, int q) { return static_cast<uint64_t>((r + 2) * (q + 1) * 1001 + r); };
  auto a2a = [&](int r) { return packedAlltoall(n, r, pair); };
  std::vector<Bytes> ain(m), aout(m);
  for (int j = 0; j < m; ++j) {
    const Exchange x = a2a(members[j]);
    ain[j].resize(sentBytes(x));
    for (size_t i = 0; i < ain[j].size(); ++i) ain[j][i] = static_cast<char>(members[j] * 31 + i * 7 + 1);
    aout[j].assign(receivedBytes(x), 7);
  }
  zeroDropped(a2a, aout);
  model(restricted(a2a), ain, aout, t);
  for (int j = 0; j < m; ++j) {
    const Exchange x = a2a(members[j]);
    for (int q = 0, k = 0; q < n; ++q) {
      const bool active = k < m && members[k] == q;
      for (uint64_t i = 0; i < pair(q, members[j]); i += 13) {
        const char want = active ? ain[k][a2a(q).send_off[members[j]] + i] : 0;
        ASSERT_EQ(aout[j][x.recv_off[q] + i], want) << members[j] << " from " << q;
      }
      k += active;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Members, ExchangeSubgroup,
                         ::testing::Values(std::vector<int>{0, 2, 3}, std::vector<int>{1, 3, 4},
                                           std::vector<int>{2}, std::vector<int>{0, 1, 2, 3}));

TEST(ExchangeSubgroup, RefusesUnorderedMembers) {
  const Exchange x = exchangeAllgather(4, 1, 64);
  EXPECT_THROW(restrictExchange(x, {2, 1}), moelink::Error);
  EXPECT_THROW(restrictExchange(x, {1, 4}), moelink::Error);
}

INSTANTIATE_TEST_SUITE_P(Sizes, ExchangePlan,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 8),
                                            ::testing::Values(uint64_t{0}, uint64_t{1}, uint64_t{1000},
                                                              uint64_t{70001})));

}  // namespace
