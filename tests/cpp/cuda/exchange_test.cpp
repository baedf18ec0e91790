// The in-host GPU collectives' plans (cuda/exchange.h), run on the CPU: a model of the
// exchange kernel moves the bytes of every (source, destination) pair round by round and
// piece by piece, exactly as the kernel splits them, and each builder's result is checked
// against the collective it stands for. Plus the piece split, the layout and the mismatch
// messages.
#include <algorithm>
#include <cstring>
#include <numeric>
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
  const uint64_t R = t.round_bytes;
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
// land first (each rank's consuming block b places piece b of round r of the root's pair before
// its pushing block b passes that piece on), then every rank passes on what landed, read from
// `io` where it landed. In place, as the kernel runs it.
void modelForward(const std::vector<Exchange>& xs, std::vector<Bytes>& io, const ExchangeTuning& t) {
  const int n = static_cast<int>(xs.size());
  ASSERT_GT(n, 2);
  const int root = xs[0].forward_from;
  std::vector<Exchange> from_root, passed_on;
  for (int p = 0; p < n; ++p) {
    const Exchange& x = xs[p];
    ASSERT_EQ(x.mode, ExchangeMode::kForward);
    ASSERT_EQ(x.forward_from, root);
    EXPECT_TRUE(exchangeSplits(x, t)) << "rank " << p;  // pushing blocks pass on what consuming ones place
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

// Bytes of the packed input / output of an all-to-all plan.
uint64_t sentBytes(const Exchange& x) { return x.send_off.back() + x.send_bytes.back(); }
uint64_t receivedBytes(const Exchange& x) { return x.recv_off.back() + x.recv_bytes.back(); }

class ExchangePlan : public ::testing::TestWithParam<std::tuple<int, uint64_t>> {};

TEST_P(ExchangePlan, AllreduceOneShotAndTwoShot) {
  auto [n, count] = GetParam();
  for (int two : {0, 1, 2}) {  // one exchange, the staged halves, the two-shot Lamport exchange
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
      auto blocks = allreduceBlocks(n, count, DType::kFloat32);
      for (int r = 0; r < n; ++r) {
        a.push_back(exchangeAllreduceScatter(n, r, count, DType::kFloat32, ReduceOp::kSum));
        b.push_back(exchangeAllreduceGather(n, r, count, DType::kFloat32));
        base.push_back(blocks[r].first * 4);
      }
      model(a, in, out, small(), base);
      std::vector<Bytes> mid = out;
      model(b, mid, out, small());
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

TEST(ExchangePiece, PartitionsEveryRound) {
  for (uint64_t len : {0ull, 1ull, 15ull, 16ull, 16385ull, 1000000ull, 8388608ull})
    for (int blocks : {1, 3, 24, 64}) {
      uint64_t next = 0;
      for (int b = 0; b < blocks; ++b) {
        uint64_t lo, hi;
        exchangePiece(len, b, blocks, &lo, &hi);
        ASSERT_EQ(lo, next < len ? next : len);
        ASSERT_LE(lo, hi);
        if (lo < len) {
          ASSERT_EQ(lo % 16, 0u);
        }
        if (hi < len) {
          ASSERT_GE(hi - lo, kExchangeMinPiece);
        }
        next = hi > next ? hi : next;
      }
      ASSERT_EQ(next, len) << "len " << len << " blocks " << blocks;
    }
}

TEST(ExchangePiece, LaunchedBlocksAndRolesFollowTheLongestPair) {
  ExchangeTuning t;  // 64 blocks, 8 MiB rounds, pieces of at least 16 KiB
  auto oneShot = [&](uint64_t bytes) {
    return exchangeBlocksWithWork(exchangeAllreduceOneShot(2, 0, bytes / 4, DType::kFloat32, ReduceOp::kSum), t);
  };
  EXPECT_EQ(oneShot(0), 1);
  EXPECT_EQ(oneShot(8 << 10), 1);
  EXPECT_EQ(oneShot(16 << 10), 1);
  EXPECT_EQ(oneShot((16 << 10) + 16), 2);
  EXPECT_EQ(oneShot(256 << 10), 16);
  EXPECT_EQ(oneShot(1 << 20), 64);
  EXPECT_EQ(oneShot(64 << 20), 64);
  // The largest pair counts, whichever way it goes.
  EXPECT_EQ(exchangeBlocksWithWork(exchangeAlltoall(2, 0, {0, 0}, {0, 4096}, {0, 0}, {0, 100 << 10}), t), 7);
  EXPECT_EQ(exchangeBlocksWithWork(exchangeAllgather(4, 1, 40 << 10), t), 3);
  // Separate pushing and consuming blocks from the second round on, and only when split.
  auto splits = [&](uint64_t bytes) {
    return exchangeSplits(exchangeAllreduceOneShot(2, 0, bytes / 4, DType::kFloat32, ReduceOp::kSum), t);
  };
  EXPECT_FALSE(splits(8 << 10));
  EXPECT_FALSE(splits(8 << 20));
  EXPECT_TRUE(splits((8 << 20) + 16));
  EXPECT_TRUE(exchangeSplits(exchangeAllgather(2, 0, 16 << 20), t));
  t.split = false;
  EXPECT_FALSE(splits(64 << 20));
}

TEST(ExchangePlanBroadcast, ForwardsAboveTheOneShotSizeInGroupsOfMoreThanTwo) {
  ExchangeTuning t;
  t.one_shot_bytes = 1 << 20;
  EXPECT_FALSE(broadcastForwards(2, uint64_t{1} << 30, t));  // no rank to forward through
  EXPECT_FALSE(broadcastForwards(4, 1 << 20, t));
  EXPECT_TRUE(broadcastForwards(4, (1 << 20) + 1, t));
  EXPECT_TRUE(broadcastForwards(8, (1 << 20) + 1, t));
  t.one_shot_bytes = 0;  // every size, blocks of a few bytes or none
  EXPECT_TRUE(broadcastForwards(3, 1, t));
  // blocks in rank order over the ranks but the root, the last one what is left (none here)
  const auto x = exchangeBroadcastForward(8, 3, 16, 5);
  EXPECT_EQ(x.recv_bytes[5], 0u);
  EXPECT_EQ(exchangeBroadcastForward(8, 0, 16, 5).recv_bytes[5], 16u);
  EXPECT_EQ(exchangeBroadcastForward(8, 0, 16, 5).send_bytes[1], 16u);
  EXPECT_THROW(exchangeBroadcastForward(2, 0, 1 << 20, 0), moelink::Error);  // 2 ranks: one exchange
  EXPECT_THROW(exchangeBroadcastForward(4, 0, 1 << 20, 4), moelink::Error);
  EXPECT_THROW(restrictExchange(exchangeBroadcastForward(4, 0, 1 << 20, 1), {0, 1, 2}), moelink::Error);
  // always on separate pushing and consuming blocks, MOELINK_CUDA_SPLIT=0 or not, one round or not
  t.split = false;
  EXPECT_TRUE(exchangeSplits(exchangeBroadcastForward(4, 0, 1 << 20, 1), t));
  EXPECT_EQ(exchangeSms(exchangeBroadcastForward(4, 0, 1 << 20, 1), t),
            2 * exchangeBlocksWithWork(exchangeBroadcastForward(4, 0, 1 << 20, 1), t));
}

TEST(ExchangePiece, RolesWaitForEachOtherOnlyWhereTheOutputMeetsPushedInput) {
  std::vector<char> buf(1 << 20), other(1 << 20);
  const uint64_t count = buf.size() / 4;
  // In place, but the ranges the consumers write are never pushed: the two-shot halves (a
  // rank reduces its own block, then sends it); or pushed only once they have landed: the
  // forwarding broadcast.
  for (int me = 0; me < 4; ++me) {
    const auto blocks = allreduceBlocks(4, count, DType::kFloat32);
    EXPECT_FALSE(exchangeOutputMeetsInput(exchangeAllreduceScatter(4, me, count, DType::kFloat32, ReduceOp::kSum), me,
                                          buf.data(), buf.data() + blocks[me].first * 4));
    EXPECT_FALSE(exchangeOutputMeetsInput(exchangeAllreduceGather(4, me, count, DType::kFloat32), me, buf.data(),
                                          buf.data()));
    EXPECT_FALSE(exchangeOutputMeetsInput(exchangeBroadcastForward(4, me, buf.size(), 1), me, buf.data(),
                                          buf.data()));
  }
  // A one-shot all_reduce in place writes all of what it pushes.
  EXPECT_TRUE(exchangeOutputMeetsInput(exchangeAllreduceOneShot(4, 2, count, DType::kFloat32, ReduceOp::kSum), 2,
                                       buf.data(), buf.data()));
  // Out of place: never.
  EXPECT_FALSE(exchangeOutputMeetsInput(exchangeAllreduceOneShot(4, 2, count, DType::kFloat32, ReduceOp::kSum), 2,
                                        buf.data(), other.data()));
  EXPECT_FALSE(exchangeOutputMeetsInput(exchangeAllgather(4, 1, 1000), 1, buf.data(), other.data()));
  // An all-to-all whose output overlaps the input: only where a received range meets a sent
  // one; the own pair copied onto itself writes nothing.
  const uint64_t q = 1000;
  Exchange a2a = exchangeAlltoall(2, 0, {0, q}, {q, q}, {0, q}, {q, q});
  EXPECT_TRUE(exchangeOutputMeetsInput(a2a, 0, buf.data(), buf.data()));
  EXPECT_FALSE(exchangeOutputMeetsInput(a2a, 0, buf.data(), buf.data() + 2 * q));
  EXPECT_TRUE(exchangeOutputMeetsInput(a2a, 0, buf.data(), buf.data() + 2 * q - 1));
  Exchange self_only = exchangeAlltoall(2, 0, {0, q}, {q, q}, {0, 2 * q}, {q, 0});
  EXPECT_FALSE(exchangeOutputMeetsInput(self_only, 0, buf.data(), buf.data()));
}

ExchangeTuning off_tuning(ExchangeTuning t) {
  t.lamport_bytes = 0;
  return t;
}

TEST(ExchangePiece, SmsACollectiveHolds) {
  const ExchangeTuning t = ExchangeTuning::fromEnv(4);  // 64 blocks, 8 MiB rounds, Lamport to 256 KiB
  // Lamport: one block per 4 KiB of the longest pair up to 64 KiB, per 8 KiB above (two lines
  // per thread), plus the header block.
  EXPECT_EQ(collectiveSms(OpKind::kAllreduce, 4, 8 << 10, t), 3);
  EXPECT_EQ(collectiveSms(OpKind::kAllreduce, 4, 256 << 10, t), 33);
  EXPECT_EQ(collectiveSms(OpKind::kAllgather, 4, 256 << 10, t), 17);  // pairs of 64 KiB
  // The two-shot Lamport all_reduce: blocks for the lines of its longest block (2 MiB: blocks of
  // 512 KiB, 65536 lines, 1024 per 512-thread block) and the header block.
  EXPECT_EQ(collectiveSms(OpKind::kAllreduce, 4, 2 << 20, t), 65);
  EXPECT_EQ(collectiveSms(OpKind::kAllreduce, 4, (256 << 10) + 4, t), 9 + 1);
  // Staged, one round: a block per 16 KiB piece of the longest pair (4 MiB all_reduce: two
  // exchanges of 1 MiB pairs).
  EXPECT_EQ(collectiveSms(OpKind::kAllreduce, 4, 4 << 20, t), 64);
  EXPECT_EQ(collectiveSms(OpKind::kAllreduce, 4, 2 << 20, off_tuning(t)), 32);
  EXPECT_EQ(collectiveSms(OpKind::kAlltoall, 4, 4 << 20, t), 64);
  // More than one round: pushing and consuming blocks.
  EXPECT_EQ(collectiveSms(OpKind::kAllreduce, 4, 1ull << 30, t), 128);
  EXPECT_EQ(collectiveSms(OpKind::kBroadcast, 4, 1ull << 30, t), 128);
  // A forwarded broadcast splits at every size: 2 MiB in blocks of 699056 bytes, 43 pieces of 16 KiB.
  EXPECT_EQ(collectiveSms(OpKind::kBroadcast, 4, 2 << 20, t), 2 * 43);
  EXPECT_EQ(collectiveSms(OpKind::kBroadcast, 4, 1 << 20, t), 64);  // one exchange: 1 MiB pairs
  // 2 ranks: one exchange at every size.
  const ExchangeTuning t2 = ExchangeTuning::fromEnv(2);
  EXPECT_EQ(collectiveSms(OpKind::kAllreduce, 2, 2 << 20, t2), 64);
  // What one launch holds, as the launch describes it.
  const Exchange x = exchangeAllgather(4, 1, 40 << 20);
  EXPECT_EQ(exchangeSms(x, t), exchangeBlocksWithWork(x, t) * 2);
  EXPECT_THROW(collectiveSms(OpKind::kSend, 4, 1 << 20, t), moelink::Error);
}

TEST(ExchangeLayout, FitsTheRoundsAndAligns) {
  auto l = ExchangeLayout::make(4, 8 << 20);
  EXPECT_EQ(l.data % 4096, 0u);
  EXPECT_EQ(l.lamport, l.data + 2ull * 4 * (8 << 20));
  EXPECT_EQ(l.lamport % 16, 0u);  // lines are 16-byte stores
  EXPECT_EQ(l.total, l.lamport + 2ull * 4 * kLamportSourceBytes);
  EXPECT_GE(l.flags, l.counter + 32);  // seq, done, failed, single_ok, any_ok (exchange_common.cuh)
  EXPECT_THROW(ExchangeLayout::make(kExchangeMaxRanks + 1, 1 << 20), moelink::Error);
}

TEST(ExchangeLamport, TakesSmallExchangesAndTheShortPairsOfStagedCopies) {
  ExchangeTuning t;
  t.lamport_bytes = 64 << 10;
  for (int n : {2, 4, 8}) {
    const uint64_t at = (64 << 10) / 4;  // float32 elements of a full pair
    EXPECT_TRUE(exchangeLamport(exchangeAllreduceOneShot(n, 1, at, DType::kFloat32, ReduceOp::kSum), t));
    EXPECT_FALSE(exchangeLamport(exchangeAllreduceOneShot(n, 1, at + 1, DType::kFloat32, ReduceOp::kSum), t));
    EXPECT_TRUE(exchangeLamport(exchangeAllgather(n, 0, 64 << 10), t));
    EXPECT_FALSE(exchangeLamport(exchangeAllgather(n, 0, (64 << 10) + 1), t));
    EXPECT_TRUE(exchangeLamport(exchangeBroadcast(n, n - 1, 64 << 10, 0), t));
    EXPECT_FALSE(exchangeLamport(exchangeBroadcast(n, 0, (64 << 10) + 1, 0), t));
    EXPECT_TRUE(exchangeLamport(exchangeReduceScatter(n, 0, at, DType::kFloat32, ReduceOp::kMax), t));
    EXPECT_FALSE(exchangeLamport(exchangeReduceScatter(n, 0, at + 1, DType::kFloat32, ReduceOp::kMax), t));
    EXPECT_TRUE(exchangeLamport(exchangeGather(n, 1, 100, 0), t));
    EXPECT_TRUE(exchangeLamport(exchangeScatter(n, 0, 100, 0), t));
    EXPECT_TRUE(exchangeLamport(exchangeReduce(n, 0, 100, DType::kInt8, ReduceOp::kBxor, 1), t));
    // an all-to-all whose pairs are all small: Lamport; one with a long pair: staged, its small
    // pairs as lines (so that a peer whose pairs are all small, on the Lamport kernel, meets it)
    std::vector<uint64_t> off(n, 0), bytes(n, 64);
    for (int q = 0; q < n; ++q) off[q] = 64ull * q;
    EXPECT_TRUE(exchangeLamport(exchangeAlltoall(n, 0, off, bytes, off, bytes), t));
    std::vector<uint64_t> big = bytes, big_off = off;
    big[1] = (64 << 10) + 1;
    for (int q = 2; q < n; ++q) big_off[q] = big_off[q - 1] + big[q - 1];
    auto mixed = exchangeAlltoall(n, 0, big_off, big, off, bytes);
    EXPECT_FALSE(exchangeLamport(mixed, t));
    EXPECT_EQ(exchangeLamportPairs(mixed, t), 64u << 10);
    EXPECT_EQ(exchangeLamportPairs(mixed, off_tuning(t)), 0u);
    // every staged copy exchange; no reduction (each rank meets its longest pair, so all take one
    // protocol) and no forwarding broadcast (every rank of it is on the staged kernel)
    EXPECT_EQ(exchangeLamportPairs(exchangeBroadcast(n, 0, (1 << 20) + 16, 0), t), 64u << 10);
    EXPECT_EQ(exchangeLamportPairs(exchangeBroadcastForward(std::max(n, 3), 0, (1 << 20) + 16, 0), t), 0u);
    EXPECT_FALSE(exchangeLamport(exchangeBroadcastForward(std::max(n, 3), 0, 64, 0), t));
    EXPECT_EQ(exchangeLamportPairs(exchangeAllreduceScatter(n, 0, 1 << 20, DType::kFloat32, ReduceOp::kSum), t), 0u);
    // a line carries 8 bytes: complex128 moves but does not reduce by lines
    EXPECT_TRUE(exchangeLamport(exchangeAllgather(n, 0, 1600), t));
    EXPECT_FALSE(exchangeLamport(exchangeAllreduceOneShot(n, 0, 100, DType::kComplex128, ReduceOp::kSum), t));
    EXPECT_TRUE(exchangeLamport(exchangeAllreduceOneShot(n, 0, 100, DType::kComplex64, ReduceOp::kSum), t));
    // empty ops too (their header lines still meet every peer)
    EXPECT_TRUE(exchangeLamport(exchangeAllreduceOneShot(n, 0, 0, DType::kFloat32, ReduceOp::kSum), t));
  }
  ExchangeTuning off = t;
  off.lamport_bytes = 0;
  EXPECT_FALSE(exchangeLamport(exchangeAllreduceOneShot(2, 0, 1, DType::kFloat32, ReduceOp::kSum), off));
  // the area holds kLamportMaxBytes per pair whatever the setting says
  ExchangeTuning big = t;
  big.lamport_bytes = UINT64_MAX;
  EXPECT_TRUE(exchangeLamport(exchangeAllgather(2, 0, kLamportMaxBytes), big));
  EXPECT_FALSE(exchangeLamport(exchangeAllgather(2, 0, kLamportMaxBytes + 1), big));
  // two lines per thread: 256-thread blocks up to the row's lamport_narrow_bytes (64 KiB),
  // 512-thread blocks above (256 in groups above 4 ranks)
  const ExchangeTuning t4 = ExchangeTuning::fromEnv(4), t8 = ExchangeTuning::fromEnv(8);
  const uint64_t narrow = t4.lamport_narrow_bytes;
  EXPECT_EQ(narrow, 64u << 10);
  EXPECT_EQ(lamportThreadsFor(exchangeAllgather(4, 0, 0), t4), 256);
  EXPECT_EQ(lamportBlocks(exchangeAllgather(4, 0, 0), t4), 1);
  EXPECT_EQ(lamportBlocks(exchangeAllgather(4, 0, 4096), t4), 1);
  EXPECT_EQ(lamportBlocks(exchangeAllgather(4, 0, 4097), t4), 2);
  EXPECT_EQ(lamportThreadsFor(exchangeAllgather(4, 0, narrow), t4), 256);
  EXPECT_EQ(lamportBlocks(exchangeAllgather(4, 0, narrow), t4), 16);
  EXPECT_EQ(lamportThreadsFor(exchangeAllgather(4, 0, narrow + 1), t4), 512);
  EXPECT_EQ(lamportBlocks(exchangeAllgather(4, 0, narrow + 1), t4), 9);
  EXPECT_EQ(lamportBlocks(exchangeAllgather(4, 0, kLamportMaxBytes), t4), 32);
  EXPECT_EQ(lamportThreadsFor(exchangeAllgather(8, 0, kLamportMaxBytes), t8), 256);
  EXPECT_EQ(lamportBlocks(exchangeAllgather(8, 0, kLamportMaxBytes), t8), 64);
  // never more than the kernel's bound, whatever the tuning says
  ExchangeTuning wide = t8;
  wide.lamport_threads = 512;
  EXPECT_EQ(lamportThreadsFor(exchangeAllgather(8, 0, kLamportMaxBytes), wide), 256);
  EXPECT_EQ(kLamportSourceBytes, (kLamportHeaderLines + 2 * kLamportGatherLine) * kLamportLineBytes);
  EXPECT_GE(kLamportGatherLine * 8, kLamportMaxBytes);
  EXPECT_GE(kLamportHeaderLines * 8, sizeof(ExchangeHeader));
}

TEST(ExchangeLamport, TwoShotAllreduceBetweenTheOneShotAndTheStagedHalves) {
  const ExchangeTuning t4 = ExchangeTuning::fromEnv(4), t2 = ExchangeTuning::fromEnv(2), t8 = ExchangeTuning::fromEnv(8);
  const uint64_t one = t4.lamport_bytes / 4, two = t4.lamport_two_shot_bytes / 4;  // float32 elements
  EXPECT_FALSE(allreduceTwoShotLamport(4, one, DType::kFloat32, t4));  // one Lamport exchange
  EXPECT_TRUE(allreduceTwoShotLamport(4, one + 1, DType::kFloat32, t4));
  EXPECT_TRUE(allreduceTwoShotLamport(4, two, DType::kFloat32, t4));
  EXPECT_FALSE(allreduceTwoShotLamport(4, two + 1, DType::kFloat32, t4));  // the staged halves
  EXPECT_FALSE(allreduceTwoShotLamport(4, two, DType::kComplex64, t4));  // 4 MiB
  EXPECT_TRUE(allreduceTwoShotLamport(4, two / 2, DType::kComplex64, t4));
  EXPECT_FALSE(allreduceTwoShotLamport(4, two / 4, DType::kComplex128, t4));  // a line carries 8 bytes
  EXPECT_TRUE(allreduceTwoShotLamport(4, 2 * two, DType::kBFloat16, t4));
  EXPECT_FALSE(allreduceTwoShotLamport(2, one + 1, DType::kFloat32, t2));  // 2 ranks: one exchange moves as much
  EXPECT_FALSE(allreduceTwoShotLamport(4, one + 1, DType::kFloat32, off_tuning(t4)));  // no Lamport at all
  EXPECT_TRUE(allreduceTwoShotLamport(8, t8.lamport_bytes / 4 + 1, DType::kFloat32, t8));
  // blocks within what a slot holds, whatever the setting says: 3 ranks, 2 MiB has blocks of 683 KiB
  EXPECT_FALSE(allreduceTwoShotLamport(3, two, DType::kFloat32, t4));
  ExchangeTuning wide = t4;
  wide.lamport_two_shot_bytes = UINT64_MAX;
  EXPECT_TRUE(allreduceTwoShotLamport(4, 4 * kLamportTwoShotBlockBytes / 4, DType::kFloat32, wide));
  EXPECT_FALSE(allreduceTwoShotLamport(4, 4 * kLamportTwoShotBlockBytes / 4 + 4, DType::kFloat32, wide));
  // always the Lamport kernel, its blocks over the longest block, whatever the pairs' setting
  const Exchange x = exchangeAllreduceTwoShot(4, 3, two, DType::kFloat32, ReduceOp::kSum);
  EXPECT_EQ(x.mode, ExchangeMode::kReduceGather);
  EXPECT_TRUE(exchangeLamport(x, off_tuning(t4)));
  EXPECT_EQ(lamportBlocks(x, t4), 64);
  EXPECT_EQ(exchangeLamportPairs(x, t4), 0u);
  // a plan the predicate refuses never reaches the kernel: the slots hold blocks of 512 KiB of 8-byte lines
  EXPECT_THROW(exchangeLamport(exchangeAllreduceTwoShot(4, 0, 2 * two, DType::kFloat32, ReduceOp::kSum), t4),
               moelink::Error);
  EXPECT_THROW(exchangeLamport(exchangeAllreduceTwoShot(4, 0, 64, DType::kComplex128, ReduceOp::kSum), t4),
               moelink::Error);
  // a rank on the staged halves against one on the two-shot kernel: the modes differ
  auto mine = exchangeHeader(x, 0, t4);
  auto theirs = exchangeHeader(exchangeAllreduceScatter(4, 0, two, DType::kFloat32, ReduceOp::kSum), 3, t4);
  mine.seq = theirs.seq = 5;
  EXPECT_EQ(describeMismatch(mine, theirs, 0),
            "allreduce #5: rank 0 ran the reduce step where this rank ran the two-shot Lamport step (different "
            "MOELINK_CUDA_ONESHOT_BYTES or MOELINK_CUDA_LAMPORT_TWO_SHOT_BYTES?)");
}

TEST(ExchangeHeader, MismatchesReadLikeTheCpuPath) {
  ExchangeTuning t;
  auto mine = exchangeHeader(exchangeAllreduceOneShot(2, 0, 2048, DType::kFloat32, ReduceOp::kSum), 1, t);
  auto theirs = exchangeHeader(exchangeAllreduceOneShot(2, 1, 1024, DType::kFloat32, ReduceOp::kSum), 0, t);
  mine.seq = theirs.seq = 17;
  EXPECT_EQ(describeMismatch(mine, theirs, 1), "allreduce #17: rank 1 sent 4096 bytes, this rank expects 8192");
  auto same = exchangeHeader(exchangeAllreduceOneShot(2, 1, 2048, DType::kFloat32, ReduceOp::kSum), 0, t);
  same.seq = 17;
  EXPECT_EQ(describeMismatch(mine, same, 1), "");
  auto maxop = exchangeHeader(exchangeAllreduceOneShot(2, 1, 2048, DType::kFloat32, ReduceOp::kMax), 0, t);
  maxop.seq = 17;
  EXPECT_NE(describeMismatch(mine, maxop, 1).find("reduces with MAX, this rank with SUM"), std::string::npos);
  auto bc = exchangeHeader(exchangeBroadcast(2, 1, 8192, 1), 0, t);
  bc.seq = 17;
  EXPECT_NE(describeMismatch(mine, bc, 1).find("called broadcast"), std::string::npos);
  ExchangeTuning unsplit;
  unsplit.split = false;
  auto other = exchangeHeader(exchangeAllreduceOneShot(2, 1, 2048, DType::kFloat32, ReduceOp::kSum), 0, unsplit);
  other.seq = 17;
  EXPECT_NE(describeMismatch(mine, other, 1).find("MOELINK_CUDA_SPLIT=0, this rank 8388608, 64 and 1"),
            std::string::npos);
  ExchangeTuning lamport;
  lamport.lamport_bytes = 4096;
  auto other_lamport = exchangeHeader(exchangeAllreduceOneShot(2, 1, 2048, DType::kFloat32, ReduceOp::kSum), 0, lamport);
  other_lamport.seq = 17;
  EXPECT_NE(describeMismatch(mine, other_lamport, 1).find("MOELINK_CUDA_LAMPORT_BYTES=4096, this rank 0"),
            std::string::npos);
  ExchangeStatus s{};
  s.code = ExchangeStatus::kTimeout;
  s.peer = 1;
  s.seq = 17;
  s.mine = mine;
  EXPECT_NE(describeStatus(s, 5000).find("Timed out after 5000 ms waiting for rank 1"), std::string::npos);
}

TEST(ExchangeTuning, ReadsAndChecksTheEnvironment) {
  setenv("MOELINK_CUDA_BLOCKS", "65", 1);
  EXPECT_THROW(ExchangeTuning::fromEnv(), moelink::Error);
  setenv("MOELINK_CUDA_BLOCKS", "8", 1);
  setenv("MOELINK_CUDA_ROUND_BYTES", "1000", 1);
  EXPECT_THROW(ExchangeTuning::fromEnv(), moelink::Error);
  setenv("MOELINK_CUDA_ROUND_BYTES", "1048576", 1);
  setenv("MOELINK_CUDA_SPLIT", "2", 1);
  EXPECT_THROW(ExchangeTuning::fromEnv(), moelink::Error);
  setenv("MOELINK_CUDA_SPLIT", "0", 1);
  EXPECT_FALSE(ExchangeTuning::fromEnv().split);
  unsetenv("MOELINK_CUDA_SPLIT");
  auto t = ExchangeTuning::fromEnv(4);
  EXPECT_TRUE(t.split);
  EXPECT_EQ(t.blocks, 8);
  EXPECT_EQ(t.round_bytes, 1048576u);
  EXPECT_TRUE(t.oneShot(2, 1ull << 30));
  EXPECT_FALSE(t.oneShot(4, 2ull << 20));
  setenv("MOELINK_CUDA_ONESHOT_BYTES", "4194304", 1);
  EXPECT_TRUE(ExchangeTuning::fromEnv(4).oneShot(4, 4ull << 20));
  unsetenv("MOELINK_CUDA_ONESHOT_BYTES");
  unsetenv("MOELINK_CUDA_BLOCKS");
  unsetenv("MOELINK_CUDA_ROUND_BYTES");
  // the Lamport thresholds: per group size unless set, 0 turns them off, at most what the area holds
  const auto limited = [](const char* name, uint64_t ExchangeDefaults::*row, uint64_t ExchangeTuning::*field,
                          const char* over) {
    for (int n : {2, 4, 8}) EXPECT_EQ(ExchangeTuning::fromEnv(n).*field, exchangeDefaults(n).*row) << name << " " << n;
    setenv(name, "0", 1);
    EXPECT_EQ(ExchangeTuning::fromEnv(4).*field, 0u) << name;
    setenv(name, over, 1);
    EXPECT_THROW(ExchangeTuning::fromEnv(4), moelink::Error) << name;
    unsetenv(name);
  };
  limited("MOELINK_CUDA_LAMPORT_BYTES", &ExchangeDefaults::lamport_bytes, &ExchangeTuning::lamport_bytes, "262145");
  limited("MOELINK_CUDA_LAMPORT_TWO_SHOT_BYTES", &ExchangeDefaults::lamport_two_shot_bytes,
          &ExchangeTuning::lamport_two_shot_bytes, "4194305");
}

TEST(ExchangeTuning, EveryGroupSizeHasARowOfDefaultsThatTheSettingsAllow) {
  for (int n = 1; n <= kExchangeMaxRanks; ++n) {
    const ExchangeDefaults& d = exchangeDefaults(n);
    EXPECT_GE(d.up_to, n);
    EXPECT_LE(d.lamport_bytes, kLamportMaxBytes);
    EXPECT_GE(d.blocks, 1);
    EXPECT_LE(d.blocks, kExchangeMaxBlocks);
    EXPECT_EQ(d.round_bytes % 16, 0u);
    EXPECT_GE(d.round_bytes, 64u << 10);
    // Unset, the tuning is the row.
    const ExchangeTuning t = ExchangeTuning::fromEnv(n);
    EXPECT_EQ(t.lamport_bytes, d.lamport_bytes);
    EXPECT_EQ(t.lamport_two_shot_bytes, d.lamport_two_shot_bytes);
    // where the row takes the two-shot Lamport all_reduce, the first size above the one-shot
    // Lamport exchange takes it at every group size of the row but 2 ranks
    if (d.lamport_two_shot_bytes && n > 2) {
      EXPECT_TRUE(allreduceTwoShotLamport(n, d.lamport_bytes / 4 + 1, DType::kFloat32, t)) << n;
    }
    EXPECT_EQ(t.blocks, d.blocks);
    EXPECT_EQ(t.round_bytes, d.round_bytes);
    EXPECT_EQ(t.one_shot_bytes, d.one_shot_bytes);
    EXPECT_EQ(t.lamport_narrow_bytes, d.lamport_narrow_bytes);
    EXPECT_EQ(t.lamport_threads, d.lamport_threads);
    // whole warps, enough threads for every peer's header lines, within the kernel's bound
    EXPECT_EQ(d.lamport_threads % 32, 0);
    EXPECT_GE(d.lamport_threads, static_cast<int>(d.up_to * kLamportHeaderLines));
    EXPECT_LE(d.lamport_threads, lamportThreads(d.up_to));
    EXPECT_LE(kLamportNarrowThreads, lamportThreads(d.up_to));
    EXPECT_GE(kLamportNarrowThreads, static_cast<int>(d.up_to * kLamportHeaderLines));
  }
  // The rows measured so far, and the larger groups' row, which no machine has measured.
  EXPECT_EQ(exchangeDefaults(2).lamport_bytes, 256u << 10);
  EXPECT_EQ(exchangeDefaults(4).lamport_bytes, 256u << 10);
  EXPECT_EQ(exchangeDefaults(4).one_shot_bytes, 1u << 20);
  EXPECT_EQ(exchangeDefaults(2).lamport_two_shot_bytes, 0u);
  EXPECT_EQ(exchangeDefaults(4).lamport_two_shot_bytes, 2u << 20);
  EXPECT_NE(std::string(exchangeDefaults(4).measured), "");
  EXPECT_EQ(exchangeDefaults(5).lamport_bytes, 64u << 10);
  EXPECT_EQ(std::string(exchangeDefaults(8).measured), "");
  EXPECT_THROW(exchangeDefaults(0), moelink::Error);
  EXPECT_THROW(exchangeDefaults(kExchangeMaxRanks + 1), moelink::Error);
}

}  // namespace
