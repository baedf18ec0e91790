// Socket helpers of the tcp transport, also used by the engine's liveness probe.
#pragma once

#include <netinet/in.h>

#include <chrono>
#include <cstddef>
#include <string>

namespace moelink::transfer::tcp {

// MOELINK_HOST_IP: the address peers use to reach this rank (default: 127.0.0.1 under
// MOELINK_TRANSPORT=shm, else the first non-loopback IPv4 interface, else 127.0.0.1).
std::string advertisedIp();
// "ip:port" as a socket address; throws naming the address when it is malformed.
sockaddr_in parseAddress(const std::string& address);
void setNonBlocking(int fd);
void setNoDelay(int fd);
// Blocking exchanges with a deadline, used only while connecting.
void sendAll(int fd, const void* p, size_t n, std::chrono::steady_clock::time_point deadline);
void recvAll(int fd, void* p, size_t n, std::chrono::steady_clock::time_point deadline);
// Whether a listener at `address` accepts a connection within `timeout`: "" if so, else why
// not. `refused` (when given) is set when the host answered that nothing listens there,
// which a partition cannot produce.
std::string probeListener(const std::string& address, std::chrono::milliseconds timeout, bool* refused = nullptr);

}  // namespace moelink::transfer::tcp
