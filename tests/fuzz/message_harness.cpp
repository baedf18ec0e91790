#include "message_harness.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "moelink/collective/mailbox.h"
#include "moelink/collective/membership.h"
#include "moelink/collective/message_check.h"
#include "moelink/collective/p2p_receiver.h"
#include "moelink/transfer/tcp/transport.h"
#include "moelink/transfer/transfer_engine.h"

namespace moelink::fuzz {

namespace {

using collective::Mailbox;
using collective::MsgHeader;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "message harness: %s\n", what.c_str());
  std::abort();
}

// The input, read front to back; reads past its end give zeros.
class Reader {
 public:
  Reader(const uint8_t* d, size_t n) : d_(d), n_(n) {}
  bool done() const { return at_ >= n_; }
  uint8_t byte() { return at_ < n_ ? d_[at_++] : 0; }
  uint16_t u16() { return static_cast<uint16_t>(byte() | (byte() << 8)); }
  uint64_t u64() {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(byte()) << (8 * i);
    return v;
  }
  void bytes(void* out, size_t k) {
    auto* o = static_cast<uint8_t*>(out);
    for (size_t i = 0; i < k; ++i) o[i] = byte();
  }

 private:
  const uint8_t* d_;
  size_t n_, at_ = 0;
};

// Rank 0 of a group of 2 (rank 1 never exists), with one mailbox whose segment a "peer" writes.
struct Rank0 {
  std::shared_ptr<transfer::InProcessStore> store = std::make_shared<transfer::InProcessStore>();
  std::unique_ptr<transfer::TransferEngine> engine;
  std::unique_ptr<Mailbox> box;
  uint64_t sent = 0;  // messages written as rank 1's
  static constexpr transfer::SegmentId kSegment = 2;

  Rank0() {
    transfer::EngineOptions o;
    o.rank = 0;
    o.world_size = 2;
    o.transport = "tcp";  // segments on the heap, where ASan sees their ends
    o.timeout = std::chrono::milliseconds(1000);
    engine = std::make_unique<transfer::TransferEngine>(store, o);
    box = std::make_unique<Mailbox>(*engine, kSegment, MessageHarness::kChunk, MessageHarness::kDepth);
    box->open({1, 0});  // its own segment only: the writes below go through the engine's local path
  }

  void write(uint64_t offset, const void* data, uint64_t length) {
    auto b = engine->submit({transfer::TransferRequest{transfer::Opcode::kWrite, const_cast<void*>(data), 0, kSegment,
                                                       offset, length}});
    if (b->failed()) fail("a write into the mailbox failed: " + b->error());
  }

  // Writes the next message from the input as rank 1 does: payload, header, then its signal.
  void writeMessage(Reader& in) {
    MsgHeader h;
    in.bytes(&h, sizeof h);
    std::vector<uint8_t> payload(in.u16() % (MessageHarness::kChunk + 1));
    in.bytes(payload.data(), payload.size());
    const uint64_t seq = ++sent;
    const uint64_t at = box->headerOffsetOf(1, seq);
    if (!payload.empty()) write(at + sizeof h, payload.data(), payload.size());
    write(at, &h, sizeof h);
    write(box->signalOffsetOf(1, seq), &seq, 8);
  }
};

void pointToPoint(Reader& in) {
  Rank0 r;
  collective::P2PReceiver receiver(*r.box, 0, 2);
  const int n = in.byte() % 4;
  std::vector<std::unique_ptr<std::vector<char>>> buffers;
  std::vector<int> outcomes(n, 0);  // 0 pending, 1 done, 2 failed
  for (int i = 0; i < n; ++i) {
    auto recv = std::make_unique<collective::P2PReceiver::Recv>();
    recv->peer = in.byte() & 1 ? -1 : 1;
    recv->tag = in.byte() % 4;
    recv->bytes = in.u16() % 4097;
    buffers.push_back(std::make_unique<std::vector<char>>(recv->bytes));  // exact size: ASan's
    recv->data = buffers.back()->data();
    recv->deadline = std::chrono::steady_clock::now() + std::chrono::hours(1);
    recv->done = [&outcomes, i](const std::string& error, int) {
      if (outcomes[i] != 0) fail("a recv completed twice");
      outcomes[i] = error.empty() ? 1 : 2;
    };
    receiver.post(std::move(recv));
  }
  const std::vector<char> live{1, 1};
  while (!in.done()) {
    r.writeMessage(in);
    receiver.progress(live);
    receiver.progress(live);
  }
  receiver.failAll("end of input");
  for (int o : outcomes)
    if (o == 0) fail("a recv was neither completed nor failed");
}

void collectiveStep(Reader& in) {
  Rank0 r;
  collective::ExpectedPiece want;
  want.op = {static_cast<uint8_t>(collective::OpKind::kAllreduce), 1, -1,
             static_cast<uint8_t>(collective::DType::kFloat32), static_cast<uint8_t>(collective::ReduceOp::kSum), 0};
  const int k = 1 + in.byte() % 6;
  std::vector<uint64_t> sizes(k);
  std::vector<std::unique_ptr<std::vector<char>>> landings(k), outs(k);
  for (int i = 0; i < k; ++i) {
    sizes[i] = in.u16() % 3073;  // up to twice a slot: such a piece must be pulled
    if (in.byte() & 1) landings[i] = std::make_unique<std::vector<char>>(sizes[i]);
    outs[i] = std::make_unique<std::vector<char>>(sizes[i]);
    want.pair_bytes += sizes[i];
  }
  int next = 0;
  bool failed = false;
  while (!in.done() && !failed && next < k) {
    r.writeMessage(in);
    while (next < k && !failed) {
      const MsgHeader* h = r.box->peek(1);
      if (!h) break;
      if (h->op_seq < want.op.seq) {  // a leftover of an earlier op (CollectiveWorker::nextFresh)
        r.box->release(1);
        continue;
      }
      want.bytes = sizes[next];
      std::string bad = collective::checkCollectivePiece(*h, 1, want);
      char* landing = landings[next] ? landings[next]->data() : nullptr;
      const char* data = bad.empty() ? r.box->payload(1, &bad, landing, sizes[next]) : nullptr;
      if (!data) {
        if (bad.empty()) fail("a payload was refused without a reason");
        failed = true;
        break;
      }
      if (landing && data != landing && (h->flags & collective::kPull))
        fail("a pulled piece did not land where it was asked to");
      if (sizes[next]) std::memcpy(outs[next]->data(), data, sizes[next]);  // what consume() does
      r.box->release(1);
      ++next;
    }
  }
}

void boardMessage(Reader& in) {
  const int world = 1 + in.byte() % 64;
  const int src = in.byte() % world;
  const uint64_t epoch = in.u64() % 1000;
  std::vector<char> slot(collective::boardSlotBytes(world));  // exact size: ASan's
  in.bytes(slot.data(), slot.size());
  collective::BoardMessage m;
  std::vector<char> bits;
  if (collective::decodeBoardMessage(slot.data(), src, world, epoch, &m, &bits).empty()) {
    if (bits.size() != static_cast<size_t>(world)) fail("a decoded mask is not one entry per rank");
    if (m.from != src) fail("a decoded message names another sender");
  }
}

void hello(Reader& in) {
  constexpr uint64_t kSecret = 0x5eC12e7A11ce0001ULL;
  const int world = 1 + in.byte() % 64;
  transfer::tcp::wire::Hello h;
  in.bytes(&h, sizeof h);
  if (in.byte() & 1) h.secret = kSecret;  // past the secret, to the rank checks
  if (transfer::tcp::wire::checkHello(h, kSecret, world).empty() &&
      (h.rank < 0 || h.rank >= world || h.secret != kSecret || h.lane < 0 ||
       h.lane >= transfer::tcp::kMaxStreams))
    fail("a handshake outside the group was accepted");
}

}  // namespace

void MessageHarness::feed(const uint8_t* data, size_t size) {
  Reader in(data, size);
  switch (in.byte() % 4) {
    case 0: return pointToPoint(in);
    case 1: return collectiveStep(in);
    case 2: return boardMessage(in);
    default: return hello(in);
  }
}

}  // namespace moelink::fuzz
