// The tcp transport (transport.h): the Impl's lifecycle and the calls its users make.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <linux/sockios.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/resource.h>
#include <unistd.h>

#include <glog/logging.h>

#include <algorithm>
#include <thread>

#include "impl.h"
#include "moelink/common/error.h"
#include "moelink/common/settings.h"
#include "moelink/transfer/shm/transport.h"
#include "moelink/transfer/tcp/socket.h"

namespace moelink::transfer::tcp {

using namespace std::chrono;

TcpTuning TcpTuning::fromEnv(int world_size) {
  TcpTuning t;
  const int ncpu = settings::usableCores();
  // Default from the sweep in docs/PERF.md (64 cores: 8 streams moved the most, 16 less than 8); a
  // small host keeps its cores for the ranks' own threads. A large group keeps the connections
  // (one out and one in per stream and peer) within half of the process's descriptor limit.
  int dflt = ncpu >= 32 ? 8 : ncpu >= 8 ? 4 : 1;
  rlimit lim{};
  if (world_size > 1 && getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY) {
    const uint64_t fit = lim.rlim_cur / 2 / (2 * static_cast<uint64_t>(world_size - 1));
    dflt = static_cast<int>(std::max<uint64_t>(1, std::min<uint64_t>(dflt, fit)));
  }
  t.streams = static_cast<int>(settings::numberIfSet("MOELINK_TCP_STREAMS").value_or(dflt));
  t.stripe_bytes = settings::number("MOELINK_TCP_STRIPE_BYTES");
  t.spin_us = settings::number("MOELINK_TCP_SPIN_US");
  return t;
}

void settle(Pending& p, const std::string& why) {
  if (!p.stripe) {
    if (why.empty())
      p.batch->complete(p.index);
    else
      p.batch->fail(p.index, why);
    return;
  }
  StripeSend& s = *p.stripe;
  if (!why.empty()) {
    std::lock_guard<std::mutex> g(s.mu);
    if (s.why.empty()) s.why = why;
  }
  if (s.left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  std::string failed;
  {
    std::lock_guard<std::mutex> g(s.mu);
    failed = s.why;
  }
  if (failed.empty())
    p.batch->complete(p.index);
  else
    p.batch->fail(p.index, failed);
}

TcpTransport::Impl::Impl(int rank, int world, uint64_t secret, LocalSegments& segs, milliseconds timeout,
                         std::function<void()> ring_local, const std::string& listen_ip, const TcpTuning& tuning)
    : rank_(rank), world_(world), secret_(secret), segs_(segs), timeout_(timeout), tuning_(tuning),
      ring_local_(std::move(ring_local)) {
  MOELINK_CHECK(tuning_.streams >= 1 && tuning_.streams <= kMaxStreams, "tcp streams must be 1..", kMaxStreams,
                ", got ", tuning_.streams);
  MOELINK_CHECK(tuning_.stripe_bytes >= 1, "tcp stripe size must be at least 1 byte");
  listen(listen_ip.empty() ? advertisedIp() : listen_ip);
  spare_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  setNonBlocking(listen_fd_);
  for (int i = 0; i < tuning_.streams; ++i) {
    auto l = std::make_unique<Loop>();
    l->index = i;
    l->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
    MOELINK_SYSCHECK(l->epoll_fd, "epoll_create1");
    l->event_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    MOELINK_SYSCHECK(l->event_fd, "eventfd");
    addToEpoll(*l, l->event_fd, EPOLLIN);
    loops_.push_back(std::move(l));
  }
  addToEpoll(*loops_[0], listen_fd_, EPOLLIN);
  for (auto& l : loops_) l->thread = std::thread([this, lp = l.get()] { loop(*lp); });
}

namespace {

// Before the connections close: what their sockets still hold for the peers gets there. A socket
// closed with unread data resets its connection, which drops what it had not sent yet (the last
// messages of ops that completed here once their bytes were handed to the socket); so what comes
// in is read and dropped until every socket's sent bytes are acknowledged, or `limit` passes.
void lingerForPeers(const std::vector<int>& fds, milliseconds limit) {
  const auto until = steady_clock::now() + limit;
  char sink[4096];
  for (;;) {
    bool unsent = false;
    for (int fd : fds) {
      // (a peer that keeps sending does not hold this past `limit`)
      while (::recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0 && steady_clock::now() < until) {
      }
      int queued = 0;
      if (::ioctl(fd, SIOCOUTQ, &queued) == 0 && queued > 0) unsent = true;
    }
    if (!unsent || steady_clock::now() >= until) return;
    std::this_thread::sleep_for(milliseconds(1));
  }
}

}  // namespace

void TcpTransport::Impl::shutdown() {
  if (stopped_.exchange(true)) return;
  for (auto& l : loops_) wake(*l);
  for (auto& l : loops_)
    if (l->thread.joinable()) l->thread.join();
  // A submitter may still be in its pass over a loop (driveOrWake); later ones see `stopped_`.
  std::vector<std::unique_lock<std::mutex>> driving;
  for (auto& l : loops_) driving.emplace_back(l->drive);
  std::vector<int> fds;
  for (auto& l : loops_)
    for (auto& [fd, c] : l->conns)
      if (c->fd >= 0) fds.push_back(c->fd);
  lingerForPeers(fds, milliseconds(1000));
  for (auto& l : loops_) {
    for (auto& [fd, c] : l->conns) closeConn(*c, "transport shut down", false);
    l->conns.clear();
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& l : loops_) {
      for (auto& s : l->submissions) settle(s.pending, "tcp transport shut down");
      l->submissions.clear();
      for (auto& c : l->adopted) ::close(c->fd);  // connected, never driven
      l->adopted.clear();
    }
  }
  ::close(listen_fd_);
  if (spare_fd_ >= 0) ::close(spare_fd_);
  spare_fd_ = -1;
  for (auto& l : loops_) {
    ::close(l->epoll_fd);
    ::close(l->event_fd);
  }
}

// Why the connection to `peer` broke ("" while it has not).
std::string TcpTransport::Impl::lostReason(int peer) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = dead_.find(peer);
  return it == dead_.end() ? std::string() : it->second;
}

// Caller's thread: the progress threads close the old outbound connections (a cut link may
// not have broken them); the next open() connects again.
void TcpTransport::Impl::forget(int peer) {
  std::lock_guard<std::mutex> og(open_mu_);
  std::lock_guard<std::mutex> g(mu_);
  connected_.erase(peer);
  dead_.erase(peer);
  auto it = out_session_.find(peer);
  if (it != out_session_.end()) {
    for (auto& l : loops_) {
      l->drops.emplace_back(peer, it->second, "");
      wake(*l);
    }
    out_session_.erase(it);
  }
  next_number_.erase(peer);
  losses_.fetch_add(1, std::memory_order_release);  // pollers re-read lostReason()
}

void TcpTransport::Impl::post(const TransferRequest& req, const BatchPtr& batch, size_t index) {
  wire::FrameHeader h{};
  h.type = req.op == Opcode::kWrite ? wire::kWrite : wire::kRead;
  h.segment = req.segment;
  h.flags = (req.notify ? static_cast<uint32_t>(wire::kNotify) : 0u) |
            (req.no_ack && req.op == Opcode::kWrite ? static_cast<uint32_t>(wire::kNoAck) : 0u);
  h.offset = req.offset;
  h.length = req.length;
  const int lanes = static_cast<int>(loops_.size());
  const bool striped = req.op == Opcode::kWrite && lanes > 1 &&
                       ((req.length >= tuning_.stripe_bytes && req.length >= 2 * kMinPart) ||
                        (req.unordered && req.length >= kMinUnordered));
  std::lock_guard<std::mutex> g(mu_);
  if (auto it = dead_.find(req.peer); it != dead_.end()) {
    batch->fail(index, it->second);
    return;
  }
  if (stopped_) {
    batch->fail(index, "tcp transport shut down");
    return;
  }
  // Numbered in submission order: the receiver applies requests in this order.
  h.request_id = ++next_number_[req.peer];
  if (!striped) {
    Submission s{req.peer, Pending{batch, index, req.op, req.local, req.length, nullptr},
                 makeFrame(h, req.op == Opcode::kWrite ? req.local : nullptr,
                           req.op == Opcode::kWrite ? req.length : 0)};
    Loop& l = *loops_[0];
    l.submissions.push_back(std::move(s));
    wake_due_ |= 1u;
    return;
  }
  // Equal parts of whole 4 KiB pages (the last takes the rest), each on its own lane, starting
  // from a rotating lane so that writes of fewer parts than lanes spread (an unordered write
  // below two parts' size is one part).
  const int parts = static_cast<int>(std::max<uint64_t>(1, std::min<uint64_t>(lanes, req.length / kMinPart)));
  const uint64_t per = (req.length / parts + 4095) / 4096 * 4096;
  // (a write of one part settles as a whole write does)
  auto shared = parts > 1 ? std::make_shared<StripeSend>(parts) : nullptr;
  h.type = wire::kWritePart;
  // The parts of a write that needs no acknowledgement (a mailbox message's payload) complete
  // once sent, like the whole write would, so that the sender's completion does not wait a round
  // trip through the receiver's lanes; the receiver answers such a part only to reject it, which
  // breaks the pair (the requests after it assumed it landed).
  const int first = static_cast<int>(stripe_turn_++ % static_cast<uint64_t>(lanes));
  for (int k = 0; k < parts; ++k) {
    const uint64_t off = per * static_cast<uint64_t>(k);
    const uint64_t len = k + 1 == parts ? req.length - off : std::min(per, req.length - off);
    wire::FrameHeader ph = h;
    ph.length = len;
    Submission s{req.peer, Pending{batch, index, req.op, req.local, req.length, shared},
                 makeFrame(ph, static_cast<const char*>(req.local) + off, len)};
    wire::PartHeader ext{req.length, off};
    std::memcpy(s.frame.head + s.frame.head_len, &ext, sizeof ext);
    s.frame.head_len += sizeof ext;
    Loop& l = *loops_[(first + k) % lanes];
    l.submissions.push_back(std::move(s));
    wake_due_ |= 1u << l.index;
  }
}

void TcpTransport::Impl::flush() {
  // Under the lock: shutdown() marks the transport stopped, then holds the lock (settling what
  // was submitted), then closes the loops' eventfds; a flush either wakes before that or finds
  // it stopped. One that finds the bits cleared by another thread's comes after that one took
  // them, and so after its wakes (or its own pass over the loop, which takes them all).
  Loop* own = nullptr;  // the loop whose queue this thread writes itself
  {
    std::lock_guard<std::mutex> g(mu_);
    uint32_t due = stopped_ ? 0 : wake_due_;
    wake_due_ = 0;
    // Loop 0 first (ordered requests: a message's header, a signal), else the first due lane, if
    // what waits there is small; the other loops wake first and carry their parts meanwhile.
    for (size_t i = 0; due; ++i, due >>= 1) {
      if (!(due & 1)) continue;
      if (!own && loops_[i]->queuedAtMost(kDirectSendBytes))
        own = loops_[i].get();
      else
        wake(*loops_[i]);
    }
  }
  if (own) driveOrWake(*own);
}

TcpTransport::TcpTransport(int rank, int world_size, uint64_t secret, LocalSegments& segments,
                           milliseconds connect_timeout, std::function<void()> ring_local, const std::string& ip,
                           const TcpTuning& tuning)
    : impl_(std::make_unique<Impl>(rank, world_size, secret, segments, connect_timeout, std::move(ring_local), ip,
                                   tuning)) {}

TcpTransport::~TcpTransport() = default;

bool TcpTransport::open(const PeerInfo& peer, RemoteSegment&) {
  impl_->connectPeer(peer);
  return true;
}

void TcpTransport::close(RemoteSegment&) {}

void TcpTransport::post(const TransferRequest& req, const RemoteSegment&, const BatchPtr& batch,
                        size_t index) {
  impl_->post(req, batch, index);
}

void TcpTransport::flush() { impl_->flush(); }

std::string TcpTransport::address() const { return impl_->address(); }

int TcpTransport::streams() const { return impl_->streams(); }

std::vector<uint64_t> TcpTransport::sentPerStream() const { return impl_->sentPerStream(); }

std::string TcpTransport::lostReason(int peer) const { return impl_->lostReason(peer); }

uint64_t TcpTransport::losses() const { return impl_->losses(); }

void TcpTransport::shutdown() { impl_->shutdown(); }

void TcpTransport::forget(int peer) { impl_->forget(peer); }

}  // namespace moelink::transfer::tcp
