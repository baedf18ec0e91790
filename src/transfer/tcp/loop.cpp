// The tcp transport's progress thread: one epoll loop over the listener, the connections and
// the submitters' eventfd.
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

void TcpTransport::Impl::addToEpoll(int fd, uint32_t events) {
  epoll_event ev{};
  ev.events = events;
  ev.data.fd = fd;
  MOELINK_SYSCHECK(epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev), "epoll_ctl(ADD)");
}

void TcpTransport::Impl::wake() {
  uint64_t one = 1;
  ssize_t r = ::write(event_fd_, &one, sizeof one);
  (void)r;
}

void TcpTransport::Impl::loop() {
  std::vector<epoll_event> events(64);
  while (!stopped_.load()) {
    int n = epoll_wait(epoll_fd_, events.data(), static_cast<int>(events.size()), 100);
    if (n < 0 && errno != EINTR) {
      LOG(ERROR) << "moelink tcp: epoll_wait failed: " << std::strerror(errno);
      break;
    }
    for (int i = 0; i < n; ++i) {
      int fd = events[i].data.fd;
      if (fd == event_fd_) {
        uint64_t v;
        while (::read(event_fd_, &v, sizeof v) > 0) {
        }
        continue;
      }
      if (fd == listen_fd_) {
        acceptAll();
        continue;
      }
      auto it = conns_.find(fd);
      if (it == conns_.end()) continue;
      Conn& c = *it->second;
      if (events[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP)) {
        if (!readConn(c)) continue;  // closed
      }
      if (events[i].events & EPOLLOUT) flushConn(c);
    }
    takeSubmissions();
    for (auto& [fd, c] : conns_)
      if (!c->out.empty()) flushConn(*c);
    expireHandshakes();
    reapClosed();
    if (ring_) {  // something completed or a notify arrived during this pass
      ring_ = false;
      ring_local_();
    }
  }
}

void TcpTransport::Impl::takeSubmissions() {
  std::vector<std::unique_ptr<Conn>> fresh;
  std::vector<Submission> subs;
  std::vector<int> forgotten;
  {
    std::lock_guard<std::mutex> g(mu_);
    fresh.swap(new_conns_);
    subs.swap(submissions_);
    forgotten.swap(forgotten_);
  }
  for (int peer : forgotten) {  // before `fresh`: a new connection to it may be there
    auto it = outbound_.find(peer);
    if (it == outbound_.end()) continue;
    Conn& c = *it->second;
    epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c.fd, nullptr);
    ::close(c.fd);
    c.fd = -1;
    for (auto& [id, p] : c.pending) p.batch->fail(p.index, str("rank ", peer, " was replaced"));
    if (!c.pending.empty()) ring_ = true;
    c.pending.clear();
    c.out.clear();
    outbound_.erase(it);
    closed_any_ = true;
  }
  for (auto& c : fresh) {
    int fd = c->fd;
    outbound_[c->peer] = c.get();
    conns_[fd] = std::move(c);
    addToEpoll(fd, EPOLLIN);
  }
  for (auto& s : subs) {
    auto it = outbound_.find(s.peer);
    if (it == outbound_.end()) {
      s.pending.batch->fail(s.pending.index, str("no tcp connection to rank ", s.peer));
      continue;
    }
    Conn& c = *it->second;
    uint64_t id = next_id_++;
    reinterpret_cast<wire::FrameHeader*>(s.frame.head)->request_id = id;
    c.pending.emplace(id, s.pending);
    c.out.push_back(s.frame);
  }
}

void TcpTransport::Impl::reapClosed() {
  if (!closed_any_) return;
  for (auto it = conns_.begin(); it != conns_.end();)
    it = it->second->fd < 0 ? conns_.erase(it) : std::next(it);
  closed_any_ = false;
}

}  // namespace moelink::transfer::tcp
