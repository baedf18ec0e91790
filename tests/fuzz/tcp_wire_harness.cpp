#include "tcp_wire_harness.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "moelink/transfer/tcp/transport.h"
#include "moelink/transfer/transfer_engine.h"

namespace moelink::fuzz {

namespace {

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "tcp wire harness: %s\n", what.c_str());
  std::abort();
}

uint8_t patternAt(size_t i) { return static_cast<uint8_t>(i * 131 + 7); }

}  // namespace

// One transport with its segment and the address it listens on.
struct TcpWireHarness::Target {
  std::vector<uint8_t> segment = TcpWireHarness::pattern();  // heap: ASan guards both ends
  transfer::LocalSegments segs;
  std::unique_ptr<transfer::tcp::TcpTransport> transport;
  sockaddr_in addr{};

  Target() {
    segs.add(kSegment, segment.data(), kSegmentBytes);
    transport = std::make_unique<transfer::tcp::TcpTransport>(0, 2, kSecret, segs, std::chrono::milliseconds(1000),
                                                              [] {});
    const std::string a = transport->address();
    const auto colon = a.rfind(':');
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(std::atoi(a.substr(colon + 1).c_str())));
    if (::inet_pton(AF_INET, a.substr(0, colon).c_str(), &addr.sin_addr) != 1) fail("bad listener address " + a);
  }
  ~Target() { transport->shutdown(); }
};

TcpWireHarness::TcpWireHarness() : auth_(std::make_unique<Target>()), open_(std::make_unique<Target>()) {}

TcpWireHarness::~TcpWireHarness() = default;

std::vector<uint8_t> TcpWireHarness::pattern() {
  std::vector<uint8_t> p(kSegmentBytes);
  for (size_t i = 0; i < kSegmentBytes; ++i) p[i] = patternAt(i);
  return p;
}

std::vector<uint8_t> TcpWireHarness::feed(const uint8_t* data, size_t size) {
  const bool authenticated = size > 0 && (data[0] & 1);
  Target& target = authenticated ? *auth_ : *open_;
  std::string bytes;
  if (authenticated) {
    // A session of its own per input: requests number from 1 on each connection.
    transfer::tcp::wire::Hello h{transfer::tcp::wire::kHelloMagic, kSecret, 1, 0, ++sessions_};
    bytes.append(reinterpret_cast<const char*>(&h), sizeof h);
  }
  if (size > 1) bytes.append(reinterpret_cast<const char*>(data + 1), size - 1);
  // The rejected tail: a frame of no known type, or a handshake with no magic.
  if (authenticated) {
    transfer::tcp::wire::FrameHeader end{};
    end.type = 0xffffffffu;
    bytes.append(reinterpret_cast<const char*>(&end), sizeof end);
  } else {
    bytes.append(sizeof(transfer::tcp::wire::Hello), '\0');
  }

  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) fail(std::string("socket: ") + std::strerror(errno));
  // (libFuzzer's timers interrupt system calls: a connect cut short goes on by itself.)
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&target.addr), sizeof target.addr) != 0) {
    if (errno != EINTR) fail(std::string("connect: ") + std::strerror(errno));
    pollfd p{fd, POLLOUT, 0};
    while (::poll(&p, 1, 20000) < 0 && errno == EINTR) {
    }
    int err = 0;
    socklen_t len = sizeof err;
    if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0)
      fail(std::string("connect: ") + std::strerror(err ? err : errno));
  }
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // the transport closed the connection: a fine answer
    sent += static_cast<size_t>(n);
  }
  // Wait (draining its answers) for the transport to close the connection; reset it after a
  // short wait otherwise. Either way this side holds no port in TIME_WAIT afterwards (thousands
  // of inputs would crowd the ephemeral range other programs bind from).
  char sink[4096];
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(5);
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    const ssize_t n = ::recv(fd, sink, sizeof sink, 0);
    if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) break;
  }
  linger lg{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
  ::close(fd);
  if (!authenticated) {
    for (size_t i = 0; i < kSegmentBytes; ++i)
      if (open_->segment[i] != patternAt(i))
        fail("a connection without the group's secret changed byte " + std::to_string(i) + " of a segment");
    return open_->segment;
  }
  std::vector<uint8_t> after = auth_->segment;
  for (size_t i = 0; i < kSegmentBytes; ++i) auth_->segment[i] = patternAt(i);
  return after;
}

}  // namespace moelink::fuzz
