#include "tcp_wire_harness.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

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

TcpWireHarness::TcpWireHarness()
    : segment_(std::make_unique<std::vector<uint8_t>>(kSegmentBytes)),
      segs_(std::make_unique<transfer::LocalSegments>()) {
  restorePattern();
  segs_->add(kSegment, segment_->data(), kSegmentBytes);
  transport_ = std::make_unique<transfer::tcp::TcpTransport>(0, kSecret, *segs_, std::chrono::milliseconds(1000),
                                                             [] {});
  const std::string addr = transport_->address();
  port_ = std::atoi(addr.substr(addr.rfind(':') + 1).c_str());
  if (port_ <= 0) fail("no port in " + addr);
  host_ = addr.substr(0, addr.rfind(':'));
}

TcpWireHarness::~TcpWireHarness() {
  transport_->shutdown();
  transport_.reset();
}

void TcpWireHarness::restorePattern() {
  for (size_t i = 0; i < kSegmentBytes; ++i) (*segment_)[i] = patternAt(i);
}

std::vector<uint8_t> TcpWireHarness::pattern() {
  std::vector<uint8_t> p(kSegmentBytes);
  for (size_t i = 0; i < kSegmentBytes; ++i) p[i] = patternAt(i);
  return p;
}

std::vector<uint8_t> TcpWireHarness::feed(const uint8_t* data, size_t size) {
  const bool authenticated = size > 0 && (data[0] & 1);
  std::string bytes;
  if (authenticated) {
    transfer::tcp::wire::Hello h{transfer::tcp::wire::kHelloMagic, kSecret, 1, 0};
    bytes.append(reinterpret_cast<const char*>(&h), sizeof h);
  }
  if (size > 1) bytes.append(reinterpret_cast<const char*>(data + 1), size - 1);

  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) fail(std::string("socket: ") + std::strerror(errno));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port_));
  if (::inet_pton(AF_INET, host_.c_str(), &sa.sin_addr) != 1) fail("bad listener address " + host_);
  // (libFuzzer's timers interrupt system calls: a connect cut short goes on by itself.)
  if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
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
  ::shutdown(fd, SHUT_WR);
  // Drain the answers until the transport closes the connection: it does at the end of the
  // input, once every frame before it is applied (or earlier, on a protocol error), so after
  // this no byte of this input is still on its way into the segment.
  char sink[4096];
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) fail("the transport did not close a connection whose input had ended within 20 s");
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) < 0 && errno != EINTR) fail("poll failed");
    if (!(p.revents & (POLLIN | POLLHUP | POLLERR))) continue;
    const ssize_t n = ::recv(fd, sink, sizeof sink, 0);
    if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) break;
  }
  ::close(fd);
  std::vector<uint8_t> after = *segment_;
  if (!authenticated) {
    for (size_t i = 0; i < kSegmentBytes; ++i)
      if (after[i] != patternAt(i))
        fail("a connection without the group's secret changed byte " + std::to_string(i) + " of the segment");
  } else {
    restorePattern();
  }
  return after;
}

}  // namespace moelink::fuzz
