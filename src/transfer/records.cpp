#include "moelink/transfer/records.h"

#include <arpa/inet.h>

#include <sstream>
#include <vector>

#include "moelink/common/error.h"

namespace moelink::transfer {

uint64_t parseCount(const std::string& text, const std::string& what) {
  MOELINK_CHECK(!text.empty() && text.size() <= 20, "malformed ", what, " '", text, "' (not a number)");
  uint64_t v = 0;
  for (char c : text) {
    MOELINK_CHECK(c >= '0' && c <= '9', "malformed ", what, " '", text, "' (not a number)");
    const uint64_t d = static_cast<uint64_t>(c - '0');
    MOELINK_CHECK(v <= (UINT64_MAX - d) / 10, "malformed ", what, " '", text, "' (out of range)");
    v = v * 10 + d;
  }
  return v;
}

std::string endpointRecord(const PeerInfo& me) {
  return str(me.host_id, "\n", me.tcp_address, "\n", me.pid, "\n", me.start_time, "\n", me.pid_ns, "\n",
             me.read_probe);
}

PeerInfo parseEndpointRecord(const std::string& rec, int rank) {
  std::vector<std::string> f;
  std::istringstream in(rec);
  for (std::string line; std::getline(in, line);) f.push_back(line);
  const std::string what = str("endpoint record of rank ", rank);
  MOELINK_CHECK(f.size() == 6, "malformed ", what, " (", f.size(), " fields, expected 6)");
  PeerInfo info;
  info.rank = rank;
  info.host_id = f[0];
  info.tcp_address = f[1];
  MOELINK_CHECK(!info.host_id.empty(), "malformed ", what, " (no host id)");
  const auto colon = info.tcp_address.rfind(':');
  MOELINK_CHECK(colon != std::string::npos, "malformed ", what, " (tcp address '", info.tcp_address, "')");
  in_addr ip{};
  MOELINK_CHECK(inet_pton(AF_INET, info.tcp_address.substr(0, colon).c_str(), &ip) == 1, "malformed ", what,
                " (tcp address '", info.tcp_address, "')");
  const uint64_t port = parseCount(info.tcp_address.substr(colon + 1), what + " tcp port");
  MOELINK_CHECK(port >= 1 && port <= 65535, "malformed ", what, " (tcp port ", port, ")");
  const uint64_t pid = parseCount(f[2], what + " pid");
  MOELINK_CHECK(pid >= 1 && pid <= INT32_MAX, "malformed ", what, " (pid ", pid, ")");
  info.pid = static_cast<int64_t>(pid);
  info.start_time = parseCount(f[3], what + " start time");
  info.pid_ns = f[4];
  info.read_probe = parseCount(f[5], what + " probe address");
  return info;
}

SegmentDesc parseSegmentRecord(const std::string& rec, int rank, SegmentId id) {
  SegmentDesc d = SegmentDesc::parse(rec);
  MOELINK_CHECK(d.rank == rank && d.id == id, "the descriptor of segment ", id, " of rank ", rank,
                " names segment ", d.id, " of rank ", d.rank);
  if (!d.shm_name.empty())
    MOELINK_CHECK(d.shm_name.rfind("/moelink.", 0) == 0 && d.shm_name.find('/', 1) == std::string::npos,
                  "the descriptor of segment ", id, " of rank ", rank, " names shared memory '", d.shm_name,
                  "', which is not moelink's");
  return d;
}

}  // namespace moelink::transfer
