// The tcp transport (transport.h): the Impl's lifecycle and the calls its users make.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <glog/logging.h>

#include "impl.h"
#include "moelink/common/error.h"
#include "moelink/transfer/shm/transport.h"
#include "moelink/transfer/tcp/socket.h"

namespace moelink::transfer::tcp {

using namespace std::chrono;

TcpTransport::Impl::Impl(int rank, int world, uint64_t secret, LocalSegments& segs, milliseconds timeout,
                         std::function<void()> ring_local, const std::string& listen_ip)
    : rank_(rank), world_(world), secret_(secret), segs_(segs), timeout_(timeout), ring_local_(std::move(ring_local)) {
  listen(listen_ip.empty() ? advertisedIp() : listen_ip);
  spare_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  setNonBlocking(listen_fd_);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  MOELINK_SYSCHECK(epoll_fd_, "epoll_create1");
  event_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  MOELINK_SYSCHECK(event_fd_, "eventfd");
  addToEpoll(listen_fd_, EPOLLIN);
  addToEpoll(event_fd_, EPOLLIN);
  thread_ = std::thread([this] { loop(); });
}

void TcpTransport::Impl::shutdown() {
  if (stopped_.exchange(true)) return;
  wake();
  if (thread_.joinable()) thread_.join();
  for (auto& [fd, c] : conns_) closeConn(*c, "transport shut down", false);
  conns_.clear();
  std::lock_guard<std::mutex> g(mu_);
  for (auto& s : submissions_) s.pending.batch->fail(s.pending.index, "tcp transport shut down");
  submissions_.clear();
  ::close(listen_fd_);
  if (spare_fd_ >= 0) ::close(spare_fd_);
  spare_fd_ = -1;
  ::close(epoll_fd_);
  ::close(event_fd_);
}

// Why the connection to `peer` broke ("" while it has not).
std::string TcpTransport::Impl::lostReason(int peer) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = dead_.find(peer);
  return it == dead_.end() ? std::string() : it->second;
}

// Caller's thread: the progress thread closes the old outbound connection (a cut link may
// not have broken it); the next open() connects again.
void TcpTransport::Impl::forget(int peer) {
  std::lock_guard<std::mutex> og(open_mu_);
  std::lock_guard<std::mutex> g(mu_);
  connected_.erase(peer);
  dead_.erase(peer);
  forgotten_.push_back(peer);
  losses_.fetch_add(1, std::memory_order_release);  // pollers re-read lostReason()
  wake();
}

void TcpTransport::Impl::post(const TransferRequest& req, const BatchPtr& batch, size_t index) {
  Submission s;
  s.peer = req.peer;
  s.pending = Pending{batch, index, req.op, req.local, req.length};
  wire::FrameHeader h{};
  h.type = req.op == Opcode::kWrite ? wire::kWrite : wire::kRead;
  h.segment = req.segment;
  h.flags = (req.notify ? static_cast<uint32_t>(wire::kNotify) : 0u) |
            (req.no_ack && req.op == Opcode::kWrite ? static_cast<uint32_t>(wire::kNoAck) : 0u);
  h.offset = req.offset;
  h.length = req.length;
  s.frame = makeFrame(h, req.op == Opcode::kWrite ? req.local : nullptr,
                      req.op == Opcode::kWrite ? req.length : 0);
  std::lock_guard<std::mutex> g(mu_);
  if (auto it = dead_.find(req.peer); it != dead_.end()) {
    batch->fail(index, it->second);
    return;
  }
  if (stopped_) {
    batch->fail(index, "tcp transport shut down");
    return;
  }
  submissions_.push_back(std::move(s));
  if (submissions_.size() == 1) wake();
}

TcpTransport::TcpTransport(int rank, int world_size, uint64_t secret, LocalSegments& segments,
                           milliseconds connect_timeout, std::function<void()> ring_local, const std::string& ip)
    : impl_(std::make_unique<Impl>(rank, world_size, secret, segments, connect_timeout, std::move(ring_local), ip)) {}

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

std::string TcpTransport::address() const { return impl_->address(); }

std::string TcpTransport::lostReason(int peer) const { return impl_->lostReason(peer); }

uint64_t TcpTransport::losses() const { return impl_->losses(); }

void TcpTransport::shutdown() { impl_->shutdown(); }

void TcpTransport::forget(int peer) { impl_->forget(peer); }

}  // namespace moelink::transfer::tcp
