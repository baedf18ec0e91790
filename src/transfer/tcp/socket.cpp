#include "moelink/transfer/tcp/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "moelink/common/error.h"
#include "moelink/common/settings.h"
#include "moelink/transfer/records.h"

namespace moelink::transfer::tcp {

using namespace std::chrono;

std::string advertisedIp() {
  if (std::string ip = settings::text("MOELINK_HOST_IP"); !ip.empty()) return ip;
  // A group held to shared memory has every rank on this host: nothing on the network needs to
  // reach this rank's listener (probes and stray connections included).
  if (settings::text("MOELINK_TRANSPORT") == "shm") return "127.0.0.1";
  std::string found = "127.0.0.1";
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) == 0) {
    for (ifaddrs* i = ifs; i; i = i->ifa_next) {
      if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
      if ((i->ifa_flags & IFF_LOOPBACK) || !(i->ifa_flags & IFF_UP)) continue;
      char buf[INET_ADDRSTRLEN];
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof buf);
      found = buf;
      break;
    }
    freeifaddrs(ifs);
  }
  return found;
}

void setNonBlocking(int fd) {
  int flags = fcntl(fd, F_GETFL, 0);
  MOELINK_SYSCHECK(fcntl(fd, F_SETFL, flags | O_NONBLOCK), "fcntl(O_NONBLOCK)");
}

void setNoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

void sendAll(int fd, const void* p, size_t n, steady_clock::time_point deadline) {
  const char* c = static_cast<const char*>(p);
  while (n) {
    ssize_t r = ::send(fd, c, n, MSG_NOSIGNAL);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd pf{fd, POLLOUT, 0};
      int left = static_cast<int>(duration_cast<milliseconds>(deadline - steady_clock::now()).count());
      MOELINK_CHECK(left > 0 && poll(&pf, 1, left) > 0, "timed out sending handshake");
      continue;
    }
    MOELINK_SYSCHECK(r, "send(handshake)");
    c += r;
    n -= static_cast<size_t>(r);
  }
}

void recvAll(int fd, void* p, size_t n, steady_clock::time_point deadline) {
  char* c = static_cast<char*>(p);
  while (n) {
    pollfd pf{fd, POLLIN, 0};
    int left = static_cast<int>(duration_cast<milliseconds>(deadline - steady_clock::now()).count());
    if (left <= 0 || poll(&pf, 1, left) <= 0) MOELINK_THROW_TIMEOUT("timed out in tcp handshake");
    ssize_t r = ::recv(fd, c, n, 0);
    if (r < 0 && errno == EINTR) continue;
    MOELINK_CHECK(r > 0, "connection closed during handshake (wrong group secret?)");
    c += r;
    n -= static_cast<size_t>(r);
  }
}

sockaddr_in parseAddress(const std::string& address) {
  auto colon = address.rfind(':');
  MOELINK_CHECK(colon != std::string::npos, "bad tcp address '", address, "'");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  const uint64_t port = parseCount(address.substr(colon + 1), str("port of tcp address '", address, "'"));
  MOELINK_CHECK(port >= 1 && port <= 65535, "bad tcp address '", address, "'");
  a.sin_port = htons(static_cast<uint16_t>(port));
  MOELINK_CHECK(inet_pton(AF_INET, address.substr(0, colon).c_str(), &a.sin_addr) == 1, "bad tcp address '",
                address, "'");
  return a;
}

std::string probeListener(const std::string& address, milliseconds timeout, bool* refused) {
  if (refused) *refused = false;
  sockaddr_in a;
  try {
    a = parseAddress(address);
  } catch (const std::exception& e) {
    return e.what();
  }
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return str("socket: ", std::strerror(errno));
  int err = 0;
  std::string why;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    err = errno;
    if (err == EINPROGRESS) {
      pollfd pf{fd, POLLOUT, 0};
      err = 0;
      socklen_t len = sizeof err;
      if (poll(&pf, 1, static_cast<int>(timeout.count())) <= 0)
        why = str("no answer within ", timeout.count(), " ms");
      else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0)
        err = errno;
    }
    if (why.empty() && err != 0) why = std::strerror(err);
  }
  ::close(fd);
  if (refused) *refused = err == ECONNREFUSED;
  return why.empty() ? "" : str("its listener at ", address, " is unreachable (", why, ")");
}

}  // namespace moelink::transfer::tcp
