// The tcp transport's progress threads: each an epoll loop over its connections and its eventfd
// (loop 0 also over the listener).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <glog/logging.h>

#include <algorithm>

#include "impl.h"
#include "moelink/common/error.h"
#include "moelink/common/spin.h"
#include "moelink/transfer/shm/transport.h"
#include "moelink/transfer/tcp/socket.h"

namespace moelink::transfer::tcp {

using namespace std::chrono;

void TcpTransport::Impl::addToEpoll(Loop& l, int fd, uint32_t events) {
  epoll_event ev{};
  ev.events = events;
  ev.data.fd = fd;
  MOELINK_SYSCHECK(epoll_ctl(l.epoll_fd, EPOLL_CTL_ADD, fd, &ev), "epoll_ctl(ADD)");
}

// Watches a connection for reading unless it waits for its turn (then only for its queued frames
// and errors), and for writing while frames are queued.
void TcpTransport::Impl::setEvents(Conn& c) {
  if (c.fd < 0) return;
  const uint32_t want = (c.in == Conn::In::kOrder ? 0u : static_cast<uint32_t>(EPOLLIN)) |
                        (c.out.empty() ? 0u : static_cast<uint32_t>(EPOLLOUT));
  if (want == c.events) return;
  epoll_event ev{};
  ev.events = want;
  ev.data.fd = c.fd;
  epoll_ctl(c.loop->epoll_fd, EPOLL_CTL_MOD, c.fd, &ev);
  c.events = want;
}

void TcpTransport::Impl::wake(Loop& l) {
  uint64_t one = 1;
  ssize_t r = ::write(l.event_fd, &one, sizeof one);
  (void)r;
}

void TcpTransport::Impl::loop(Loop& l) {
  std::vector<epoll_event> events(64);
  const auto spin_for = microseconds(tuning_.spin_us);
  auto last_work = steady_clock::now() - spin_for;
  unsigned polls = 0;
  while (!stopped_.load()) {
    // Within spin_for of its last work the thread polls (a pause between polls, a yield every
    // 64th, for the ranks' own threads on a busy host); then it sleeps until something comes.
    const bool poll = spin_for.count() > 0 && steady_clock::now() - last_work < spin_for;
    int n = epoll_wait(l.epoll_fd, events.data(), static_cast<int>(events.size()), poll ? 0 : 100);
    if (n < 0 && errno != EINTR) {
      LOG(ERROR) << "moelink tcp: epoll_wait failed: " << std::strerror(errno);
      break;
    }
    if (n > 0) {
      last_work = steady_clock::now();
    } else if (poll) {
      spinTurn(polls);
      continue;
    }
    std::lock_guard<std::mutex> d(l.drive);
    for (int i = 0; i < n; ++i) {
      int fd = events[i].data.fd;
      if (fd == l.event_fd) {
        uint64_t v;
        while (::read(l.event_fd, &v, sizeof v) > 0) {
        }
        continue;
      }
      if (fd == listen_fd_ && l.index == 0) {
        acceptAll();
        continue;
      }
      auto it = l.conns.find(fd);
      if (it == l.conns.end()) continue;
      Conn& c = *it->second;
      if (events[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP)) {
        if (!readConn(c)) continue;  // closed
      }
      if (events[i].events & EPOLLOUT) flushConn(c);
    }
    if (l.index == 0) expireHandshakes();
    pass(l);
  }
}

void TcpTransport::Impl::pass(Loop& l) {
  takeSubmissions(l);
  resumeWaiting(l);
  for (auto& [fd, c] : l.conns)
    if (!c->out.empty()) flushConn(*c);
  reapClosed(l);
  if (l.ring) {  // something completed or a notify arrived during this pass
    l.ring = false;
    ring_local_();
  }
}

bool TcpTransport::Impl::driveOrWake(Loop& l) {
  {
    std::unique_lock<std::mutex> d(l.drive, std::try_to_lock);
    // (stopped: shutdown() settles what is queued; its progress thread has gone)
    if (stopped_.load()) return false;
    if (d.owns_lock()) {
      pass(l);
      return true;
    }
  }
  // Its progress thread is in a pass (it takes what is queued in its next one, which this
  // wake-up makes sure of), or another thread drives it.
  std::lock_guard<std::mutex> g(mu_);
  if (stopped_.load()) return false;
  wake(l);
  return true;
}

void TcpTransport::Impl::takeSubmissions(Loop& l) {
  std::vector<std::unique_ptr<Conn>> fresh;
  std::vector<Submission> subs;
  std::vector<std::tuple<int, uint64_t, std::string>> drops;
  {
    std::lock_guard<std::mutex> g(mu_);
    fresh.swap(l.adopted);
    subs.swap(l.submissions);
    drops.swap(l.drops);
  }
  // Before `fresh`: a new connection to the peer may be there.
  for (auto& [peer, session, why] : drops) {
    auto it = l.outbound.find(peer);
    if (it == l.outbound.end() || it->second->session != session) continue;
    // Forgotten (why ""), or lost through another of its connections (the loss is recorded):
    // the connection goes quietly, its requests with the reason.
    Conn& c = *it->second;
    epoll_ctl(l.epoll_fd, EPOLL_CTL_DEL, c.fd, nullptr);
    ::close(c.fd);
    c.fd = -1;
    for (auto& [id, p] : c.pending) settle(p, why.empty() ? str("rank ", peer, " was replaced") : why);
    if (!c.pending.empty()) l.ring = true;
    c.pending.clear();
    c.out.clear();
    l.outbound.erase(it);
    l.closed_any = true;
  }
  for (auto& c : fresh) {
    int fd = c->fd;
    c->loop = &l;
    if (c->outbound) {
      if (auto old = l.outbound.find(c->peer); old != l.outbound.end() && old->second->fd >= 0)
        closeConn(*old->second, "replaced by a new connection", false);
      l.outbound[c->peer] = c.get();
    }
    c->events = EPOLLIN;
    l.conns[fd] = std::move(c);
    addToEpoll(l, fd, EPOLLIN);
    // An inbound connection handed over with frames already buffered parses them now.
    Conn& moved = *l.conns[fd];
    if (!moved.outbound && moved.rpos < moved.rlen && consumeBuffered(moved)) publishLanded(moved);
  }
  for (auto& s : subs) {
    auto it = l.outbound.find(s.peer);
    if (it == l.outbound.end()) {
      settle(s.pending, str("no tcp connection to rank ", s.peer));
      l.ring = true;
      continue;
    }
    Conn& c = *it->second;
    c.pending.emplace(s.frame.header().request_id, s.pending);
    c.out.push_back(s.frame);
  }
}

void TcpTransport::Impl::reapClosed(Loop& l) {
  if (!l.closed_any) return;
  l.waiting.erase(std::remove_if(l.waiting.begin(), l.waiting.end(), [](Conn* c) { return c->fd < 0; }),
                  l.waiting.end());
  for (auto it = l.conns.begin(); it != l.conns.end();)
    it = it->second->fd < 0 ? l.conns.erase(it) : std::next(it);
  l.closed_any = false;
}

}  // namespace moelink::transfer::tcp
