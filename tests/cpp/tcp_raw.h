// A client that speaks the tcp transport's wire protocol by hand (tests reach the receiver's
// own checks with it): connecting, the handshake, reading with a deadline.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <string>

#include <gtest/gtest.h>

#include "moelink/transfer/tcp/socket.h"
#include "moelink/transfer/tcp/transport.h"
#include "moelink/transfer/transfer_engine.h"

namespace moelink::testing {

inline int rawConnect(const std::string& address) {
  sockaddr_in a = transfer::tcp::parseAddress(address);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_EQ(0, connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a));
  return fd;
}

inline bool readWithTimeout(int fd, void* p, size_t n, int ms) {
  char* c = static_cast<char*>(p);
  while (n) {
    pollfd pf{fd, POLLIN, 0};
    if (poll(&pf, 1, ms) <= 0) return false;
    ssize_t r = recv(fd, c, n, 0);
    if (r <= 0) return false;
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// A raw connection that has presented the engine's secret as rank `rank` (lane `lane` of
// session `session`), or -1 if the handshake failed.
inline int rawAuthenticated(transfer::TransferEngine& engine, int32_t rank = 0, int32_t lane = 0,
                            uint64_t session = 77) {
  namespace w = transfer::tcp::wire;
  int fd = rawConnect(engine.tcpAddress());
  w::Hello hello{w::kHelloMagic, engine.secret(), rank, lane, session};
  uint64_t reply = 0;
  if (send(fd, &hello, sizeof hello, 0) != static_cast<ssize_t>(sizeof hello) ||
      !readWithTimeout(fd, &reply, 8, 5000) || reply != w::kHelloMagic) {
    close(fd);
    return -1;
  }
  return fd;
}

}  // namespace moelink::testing
