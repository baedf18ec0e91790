// The tcp transport's listener and handshakes: accepting (with a cap and a deadline for
// connections that have not presented the secret), and connecting to a peer.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <glog/logging.h>

#include <random>

#include "impl.h"
#include "moelink/common/error.h"
#include "moelink/transfer/shm/transport.h"
#include "moelink/transfer/tcp/socket.h"

namespace moelink::transfer::tcp {

using namespace std::chrono;

// Binds the listening socket to `ip` (and no other interface): the address peers are told to
// use, MOELINK_HOST_IP or the first interface. One that is not this host's is an error.
void TcpTransport::Impl::listen(const std::string& ip) {
  listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  MOELINK_SYSCHECK(listen_fd_, "socket");
  int one = 1;
  setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = 0;
  if (inet_pton(AF_INET, ip.c_str(), &a.sin_addr) != 1) {
    ::close(listen_fd_);
    MOELINK_THROW("cannot listen on '", ip, "': not an IPv4 address (MOELINK_HOST_IP, if set, must be one of "
                  "this host's addresses)");
  }
  if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) < 0) {
    const int e = errno;
    ::close(listen_fd_);
    MOELINK_THROW("cannot listen on ", ip, ": ", std::strerror(e),
                  e == EADDRNOTAVAIL ? " (it is not an address of this host; MOELINK_HOST_IP, if set, must be one)"
                                     : "");
  }
  MOELINK_SYSCHECK(::listen(listen_fd_, 128), "listen");
  socklen_t len = sizeof a;
  MOELINK_SYSCHECK(getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len), "getsockname");
  address_ = str(ip, ":", ntohs(a.sin_port));
}

// One connection to `peer` with its handshake (caller's thread), ready to be handed to its loop.
std::unique_ptr<TcpTransport::Impl::Conn> TcpTransport::Impl::connectLane(const PeerInfo& peer, const sockaddr_in& a,
                                                                          int lane, uint64_t session,
                                                                          steady_clock::time_point deadline) {
  int fd = -1;
  while (true) {
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    MOELINK_SYSCHECK(fd, "socket");
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0) break;
    int e = errno;
    ::close(fd);
    if (steady_clock::now() > deadline)
      MOELINK_THROW_TIMEOUT("could not connect to rank ", peer.rank, " at ", peer.tcp_address,
                            ": ", std::strerror(e));
    std::this_thread::sleep_for(milliseconds(20));
  }
  setNoDelay(fd);
  wire::Hello hello{wire::kHelloMagic, secret_, rank_, lane, session};
  uint64_t reply = 0;
  try {
    sendAll(fd, &hello, sizeof hello, deadline);
    recvAll(fd, &reply, sizeof reply, deadline);
    MOELINK_CHECK(reply == wire::kHelloMagic, "rank ", peer.rank, " refused the handshake");
  } catch (...) {
    ::close(fd);
    throw;
  }
  setNonBlocking(fd);
  auto c = std::make_unique<Conn>();
  c->fd = fd;
  c->peer = peer.rank;
  c->lane = lane;
  c->outbound = true;
  c->session = session;
  c->rbuf.resize(kReadBuffer);
  return c;
}

// Connects to `peer` once (caller's thread): the primary and the lanes, each handed to its loop
// once all are up; later calls reuse them.
void TcpTransport::Impl::connectPeer(const PeerInfo& peer) {
  std::lock_guard<std::mutex> og(open_mu_);
  {
    std::lock_guard<std::mutex> g(mu_);
    if (connected_.count(peer.rank)) return;
  }
  sockaddr_in a = parseAddress(peer.tcp_address);
  auto deadline = steady_clock::now() + timeout_;
  std::random_device rd;
  const uint64_t session = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  std::vector<std::unique_ptr<Conn>> conns;
  for (int lane = 0; lane < static_cast<int>(loops_.size()); ++lane)
    conns.push_back(connectLane(peer, a, lane, session, deadline));  // (a throw closes those made)
  std::lock_guard<std::mutex> g(mu_);
  connected_.insert(peer.rank);
  out_session_[peer.rank] = session;
  next_number_[peer.rank] = 0;
  for (size_t i = 0; i < conns.size(); ++i) {
    loops_[i]->adopted.push_back(std::move(conns[i]));
    wake(*loops_[i]);
  }
}

void TcpTransport::Impl::acceptAll() {
  while (true) {
    sockaddr_in from{};
    socklen_t len = sizeof from;
    int fd = accept4(listen_fd_, reinterpret_cast<sockaddr*>(&from), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if ((errno == EMFILE || errno == ENFILE) && spare_fd_ >= 0) {
        // Out of descriptors: take the connection with the one kept in reserve and drop it,
        // so the listener does not stay readable (and this loop spinning) until one frees.
        ::close(spare_fd_);
        int dropped = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (dropped >= 0) ::close(dropped);
        spare_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
        logRejection("out-of-fds", "out of file descriptors: refusing tcp connections");
        continue;
      }
      return;
    }
    char ip[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &from.sin_addr, ip, sizeof ip);
    if (unauthenticated_ >= kMaxUnauthenticated) evictOldestUnauthenticated(ip);
    setNoDelay(fd);
    auto c = std::make_unique<Conn>();
    c->fd = fd;
    c->in = Conn::In::kHello;
    c->rbuf.resize(sizeof(wire::Hello));  // the full buffer once authenticated
    c->accepted = std::chrono::steady_clock::now();
    c->from = ip;
    c->loop = loops_[0].get();
    c->events = EPOLLIN;
    ++unauthenticated_;
    handshaking_.push_back(fd);
    loops_[0]->conns[fd] = std::move(c);
    addToEpoll(*loops_[0], fd, EPOLLIN);
  }
}

// The inbound connection at the front of handshaking_ that is still in its handshake, or
// nullptr (entries of connections that authenticated or closed are dropped on the way).
TcpTransport::Impl::Conn* TcpTransport::Impl::oldestUnauthenticated() {
  while (!handshaking_.empty()) {
    auto it = loops_[0]->conns.find(handshaking_.front());
    if (it != loops_[0]->conns.end() && it->second->fd >= 0 && it->second->in == Conn::In::kHello) return it->second.get();
    handshaking_.pop_front();
  }
  return nullptr;
}

// At the cap, the oldest connection still without a handshake makes room: a flood of idle
// connections then cannot keep a real peer out, which authenticates at once.
void TcpTransport::Impl::evictOldestUnauthenticated(const std::string& newcomer) {
  if (Conn* c = oldestUnauthenticated()) {
    logRejection("cap", str("more than ", kMaxUnauthenticated, " connections without a handshake (the newest from ",
                            newcomer, "): closing the oldest ones"));
    closeConn(*c, "too many connections without a handshake", false);
  }
}

// Closes connections that have not presented the secret within the deadline.
void TcpTransport::Impl::expireHandshakes() {
  const auto now = std::chrono::steady_clock::now();
  while (Conn* c = oldestUnauthenticated()) {
    if (now - c->accepted <= kHandshakeDeadline) break;
    logRejection(c->from, str("closed a connection from ", c->from, " that sent no handshake within ",
                              kHandshakeDeadline.count(), " s"));
    closeConn(*c, "no handshake", false);
  }
}

// Logs a rejection once per key (a remote address), not once per connection.
void TcpTransport::Impl::logRejection(const std::string& key, const std::string& what) {
  if (logged_rejections_.insert(key).second) LOG(WARNING) << "moelink tcp: " << what;
}

std::string wire::checkHello(const Hello& h, uint64_t secret, int world_size) {
  if (h.magic != kHelloMagic || h.secret != secret) return str("it claimed rank ", h.rank, " (bad magic or group secret)");
  if (h.rank < 0 || h.rank >= world_size) return str("it claimed rank ", h.rank, ", outside the group of ", world_size);
  if (h.lane < 0 || h.lane >= kMaxStreams)
    return str("it claimed rank ", h.rank, " with lane ", h.lane, ", outside 0..", kMaxStreams - 1);
  return "";
}

// An authenticated inbound connection joins its session; a lane moves to the loop that drives
// that lane (false: it left this loop, or was closed).
bool TcpTransport::Impl::authenticated(Conn& c, const wire::Hello& h) {
  c.peer = h.rank;
  c.lane = h.lane;
  c.in = Conn::In::kHeader;
  --unauthenticated_;
  compactPartial(c);
  c.rbuf.resize(kReadBuffer);
  c.in_session = sessionFor(h.rank, h.session);
  {
    std::lock_guard<std::mutex> g(c.in_session->mu);
    if (h.lane == 0 && c.in_session->primary) {  // one primary per session
      c.in_session.reset();  // (not one of the session's connections)
    } else if (h.lane == 0) {
      c.in_session->primary = c.loop;
    } else {
      ++c.in_session->lanes_open;
    }
  }
  if (!c.in_session) {
    closeConn(c, "a second primary connection for a session", true);
    return false;
  }
  OutFrame f;
  uint64_t magic = wire::kHelloMagic;
  std::memcpy(f.head, &magic, sizeof magic);
  f.head_len = sizeof magic;
  c.out.push_back(f);
  Loop& to = *loops_[static_cast<size_t>(h.lane) % loops_.size()];
  if (&to == c.loop) return true;
  Loop& from = *c.loop;
  epoll_ctl(from.epoll_fd, EPOLL_CTL_DEL, c.fd, nullptr);
  auto it = from.conns.find(c.fd);
  std::unique_ptr<Conn> owned = std::move(it->second);
  from.conns.erase(it);
  std::lock_guard<std::mutex> g(mu_);
  to.adopted.push_back(std::move(owned));
  wake(to);
  return false;
}

}  // namespace moelink::transfer::tcp
