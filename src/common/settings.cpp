#include "moelink/common/settings.h"

#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include <glog/logging.h>

#include "moelink/common/error.h"

extern char** environ;

namespace moelink::settings {

namespace {

constexpr uint64_t kKiB = 1024, kMiB = 1024 * 1024;

Setting number(const char* name, const char* area, uint64_t dflt, uint64_t min, uint64_t max, const char* doc,
               const char* default_text = "") {
  return Setting{name, Kind::kNumber, area, dflt, min, max, "", default_text, doc};
}
Setting flag(const char* name, const char* area, bool dflt, const char* doc) {
  return Setting{name, Kind::kFlag, area, dflt ? 1u : 0u, 0, 1, "", "", doc};
}
Setting choice(const char* name, const char* area, const char* choices, const char* doc) {
  return Setting{name, Kind::kChoice, area, 0, 0, 0, choices, "", doc};
}
Setting text(const char* name, const char* area, const char* default_text, const char* doc) {
  return Setting{name, Kind::kText, area, 0, 0, 0, "", default_text, doc};
}

const std::vector<Setting> kSettings = {
    choice("MOELINK_TRANSPORT", "collectives", "auto|tcp|shm",
           "`auto`: shared memory to ranks on this host, tcp to others; `tcp` or `shm` force one"),
    text("MOELINK_HOST_IP", "collectives",
         "first non-loopback IPv4; 127.0.0.1 under `MOELINK_TRANSPORT=shm`, and under the automatic transport when "
         "the group's store is reached at a loopback address (a local launch: no rank can be elsewhere)",
         "address that peers use to reach this rank over tcp, and the only one its listener binds; it must be an "
         "address of this host (set it where ranks on several hosts reach the store through a loopback address, "
         "e.g. a tunnel, and on multi-tenant hosts: Trust model)"),
    text("MOELINK_HOST_ID", "collectives", "hostname + boot id",
         "the same-host test (ranks with equal ids use shared memory)"),
    number("MOELINK_TCP_STREAMS", "collectives", 0, 1, 16,
           "tcp connections per peer, each driven by its own progress thread; writes of at least "
           "`MOELINK_TCP_STRIPE_BYTES` are striped over them",
           "`8` on a host with at least 32 cores, `4` with 8 to 31, else `1`; in a large group at most what keeps "
           "the connections within half of the process's file-descriptor limit"),
    number("MOELINK_TCP_STRIPE_BYTES", "collectives", 256 * kKiB, 1, UINT64_MAX,
           "tcp writes of at least this size are cut into parts (of at least 64 KiB), one per connection"),
    number("MOELINK_TCP_SPIN_US", "collectives", 0, 0, 1000000,
           "microseconds a tcp progress thread keeps polling its connections after its last work before it "
           "sleeps (a polling thread takes the next frame without being woken, and keeps a core busy meanwhile)"),
    number("MOELINK_CHUNK_BYTES", "collectives", 512 * kKiB, 64, 1ull << 30,
           "mailbox slot size: large ops move in pieces of this size; the same on every rank (a group whose ranks "
           "differ fails to form, and a process that joins a group takes the group's)",
           "`524288` in groups on one host, `2097152` in groups that use tcp (forced, or spanning hosts)"),
    number("MOELINK_MAILBOX_DEPTH", "collectives", 4, 1, 64, "slots per peer pair (how far a sender may run ahead)"),
    flag("MOELINK_SHM_PULL", "collectives", true,
         "`0`: same-host ranks never read each other's memory directly (every payload goes through the "
         "shared-memory slots)"),
    number("MOELINK_PULL_MIN_BYTES", "collectives", 64 * kKiB, 0, UINT64_MAX,
           "pieces of broadcast, gather, scatter, all-gather and all-to-all of at least this size are read by their "
           "receiver straight from the sender's memory, where it can"),
    number("MOELINK_PULL_CHUNK_BYTES", "collectives", 4 * kMiB, 64, UINT64_MAX,
           "all-to-all's piece size between ranks that read each other directly"),
    number("MOELINK_ALLREDUCE_SMALL_BYTES", "collectives", 64 * kKiB, 0, UINT64_MAX,
           "up to this size allreduce sends everything to everyone in one round; above, reduce-scatter + allgather"),
    number("MOELINK_CHAIN_BROADCAST_BYTES", "collectives", 0, 0, UINT64_MAX,
           "above this, broadcast is a pipelined chain from the root instead of direct writes",
           "`1048576` in groups that span hosts, else off"),
    number("MOELINK_RING_ALLREDUCE_BYTES", "collectives", 0, 0, UINT64_MAX,
           "from this size (groups of 3 or more), allreduce is a pipelined ring instead of direct exchanges with "
           "every peer",
           "`4194304` in groups that use tcp (forced, or spanning hosts), else off"),
    number("MOELINK_REDUCE_PIECE_BYTES", "collectives", 0, 0, UINT64_MAX,
           "allreduce and reduce-scatter cut each rank's block into as many pieces as the mailbox is deep, of at "
           "least this many bytes and at most a slot, so that receiving, reducing and sending the pieces overlap "
           "(`0`: pieces are slots); the same on every rank",
           "`262144` in groups that use tcp (forced, or spanning hosts), else 0"),
    number("MOELINK_CUDA_BLOCKS", "collectives", 0, 1, 64,
           "blocks of the in-host exchange kernel per role, 1..64, the same on every rank: the kernel runs up to this "
           "many pushing and this many consuming blocks (128 SMs at the default, in ops of more than one round; fewer "
           "for smaller ops); fewer leave more SMs to overlapping compute at some bandwidth (docs/PERF.md)",
           "per group size (`moelink.cuda_tuning(n)`): 64 at every size"),
    flag("MOELINK_CUDA_SPLIT", "collectives", true,
         "`0`: each block of the exchange kernel pushes and then consumes in turn in ops of several rounds too "
         "(`MOELINK_CUDA_BLOCKS` SMs in all, lower bandwidth); the same on every rank"),
    number("MOELINK_CUDA_ROUND_BYTES", "collectives", 0, 64 * kKiB, 1ull << 32,
           "staging bytes per (source, destination) pair and round (a multiple of 16); the staging area is 2 x "
           "ranks x this",
           "per group size (`moelink.cuda_tuning(n)`): 16777216 for 2 ranks, 8388608 above"),
    number("MOELINK_CUDA_ONESHOT_BYTES", "collectives", 0, 0, UINT64_MAX,
           "up to this size allreduce and broadcast are one exchange, above it allreduce is a reduce-scatter + "
           "all-gather in one launch (each rank's reduced pieces go on to the peers as they are reduced) and, in "
           "groups of more than 2, broadcast is forwarded (the root sends each rank its block, which that rank "
           "passes on to the others as it lands)",
           "per group size (`moelink.cuda_tuning(n)`): 1048576 (groups of 2: 4194304)"),
    flag("MOELINK_CUDA_PDL", "collectives", true,
         "`0`: the Lamport kernel is launched plainly instead of as a programmatic dependent (which lets the next "
         "op's blocks onto the GPU, waiting, before the op ahead of it has ended)"),
    number("MOELINK_CUDA_LAMPORT_BYTES", "collectives", 0, 0, 256 * kKiB,
           "in-host CUDA ops whose every (source, destination) pair moves at most this many bytes (all-to-all "
           "excepted) send their data as 16-byte lines that carry the op's number (the Lamport protocol: one NVLink "
           "crossing, no flags or acknowledgements, twice the bytes); `0`: never (nor the two-shot all_reduce of "
           "`MOELINK_CUDA_LAMPORT_TWO_SHOT_BYTES`); at most 262144; the same on every rank",
           "per group size (`moelink.cuda_tuning(n)`): 262144 up to 4 ranks, 65536 above"),
    number("MOELINK_CUDA_LAMPORT_TWO_SHOT_BYTES", "collectives", 0, 0, 4 * kMiB,
           "groups of more than 2: in-host CUDA all_reduce larger than `MOELINK_CUDA_LAMPORT_BYTES` and at most "
           "this many bytes runs as a reduce-scatter then an all-gather of Lamport lines in one kernel (each rank "
           "reduces its block of the buffer as the peers' lines arrive and sends the result to all; blocks of at "
           "most 524288 bytes); `0`: never; the same on every rank",
           "per group size (`moelink.cuda_tuning(n)`): 0 for 2 ranks, 2097152 above"),
    number("MOELINK_HOST_PIPELINE_BYTES", "collectives", 1 * kMiB, 0, UINT64_MAX,
           "CUDA collectives between hosts: all_reduce, reduce_scatter, all_gather and broadcast of at least this "
           "many bytes run in pieces through a pinned ring (GPU copies, the wire and GPU reductions overlap); "
           "smaller ones stage the whole tensor at once (in a CUDA graph every such op takes the pieces; all_to_all "
           "takes them at every size); the same on every rank"),
    number("MOELINK_HOST_PIECE_BYTES", "collectives", 16 * kMiB, 64 * kKiB, 1ull << 30,
           "CUDA collectives between hosts: a slot's bytes on this rank's side, the largest piece (the ring holds "
           "`MOELINK_HOST_PIECES` slots twice); the same on every rank"),
    number("MOELINK_HOST_MIN_PIECE_BYTES", "collectives", 1 * kMiB, 16 * kKiB, 1ull << 30,
           "CUDA collectives between hosts: an op is cut into `MOELINK_HOST_PIECES` pieces or more (so that its "
           "copies, the wire and the reductions overlap), none smaller than this (nor larger than "
           "`MOELINK_HOST_PIECE_BYTES`); the same on every rank"),
    number("MOELINK_HOST_PIECES", "collectives", 4, 2, 64,
           "CUDA collectives between hosts: pieces in flight (slots of the pinned ring)"),
    flag("MOELINK_HOST_TWO_LEVEL", "collectives", true,
         "CUDA collectives of a group that spans hosts with the same number of its ranks (2 to 8) on each: "
         "all_reduce reduces among a host's ranks on the in-host kernels first and puts only each rank's block of "
         "the host's sum on the wire, to the ranks at its position on the other hosts; reduce_scatter likewise "
         "(each rank's rail's blocks reduced over the host, then over the rail); all_gather sends each rank's "
         "block to those ranks only and gathers among a host's ranks on the in-host kernels; broadcast sends the "
         "root's tensor to the ranks at its position on the other hosts, each of which passes it on to its host's "
         "ranks on the in-host kernels (route `host+nvlink`); `0`: every rank on the wire. Taken only where every rank sets it and maps its host's "
         "peers"),
    number("MOELINK_RANKS_PER_HOST", "collectives", 0, 1, 1u << 20,
           "CUDA collectives: group ranks into virtual hosts of this size (any split makes the group host-staged); "
           "the EP buffer has its own, `MOELINK_EP_RANKS_PER_HOST`, so that either unit's cross-host path can be "
           "exercised while the other keeps its in-host one",
           "unset"),
    number("MOELINK_FAILURE_PROBE_MS", "collectives", 2000, 0, UINT64_MAX,
           "an op that waited this long on a peer on another host checks that peer's listener (same-host peers: "
           "`/proc`, after 100 ms)"),
    number("MOELINK_FAILURE_PROBE_TIMEOUT_MS", "collectives", 1000, 1, UINT64_MAX,
           "how long that check waits for the connection before the peer counts as unreachable"),
    number("MOELINK_WORKER_SPIN", "collectives", 0, 0, 1u << 30, "busy-wait iterations before the worker sleeps on its doorbell",
           "`256`, or `0` when the host has fewer cores than ranks of the group on it (whatever transport they use)"),
    number("MOELINK_WORKER_GATE_SPIN_US", "collectives", 0, 0, 1000000,
           "microseconds the worker busy-waits for data that rings no doorbell (the CUDA host route's pieces coming "
           "off the GPU, tcp sends completing) before it polls every 20 us; each such poll sleeps on a timer, "
           "which on some hosts takes several times as long",
           "`200` when the host has two cores for each rank of the group on it, else `0`"),
    number("MOELINK_EP_TIMEOUT_US", "ep", 30000000, 0, UINT64_MAX,
           "how long a receiver waits for a source (when the call passes `timeout_us=-1`) before masking it out; `0` "
           "waits forever"),
    number("MOELINK_EP_RANKS_PER_HOST", "ep", 0, 1, 1u << 20,
           "group ranks into virtual hosts of this size; peers in other groups take the cross-host paths (proxy, "
           "IBGDA, normal mode's two-hop route); the group's CUDA collectives keep their own "
           "(`MOELINK_RANKS_PER_HOST`)",
           "unset"),
    number("MOELINK_EP_PROXY_THREADS", "ep", 4, 1, 64,
           "threads of each rank's CPU proxy that carry a batch's data to proxy peers over shared memory (the proxy "
           "thread included; each spins while traffic is recent)",
           "one per 16 cores the process may run on, 1 to 4"),
    number("MOELINK_EP_PROXY_TCP_SPIN_US", "ep", 0, 0, 1000000,
           "microseconds the tcp progress threads of each rank's CPU proxy keep polling their connections after "
           "their last work before they sleep (`MOELINK_TCP_SPIN_US` for the proxy's own engine): rows and signals "
           "are then taken on each hop without a thread being woken, while the proxy's traffic is recent",
           "`3000` when the cores the process may run on come to 16 or more for each of the group's ranks on its "
           "host, else `0`"),
    flag("MOELINK_EP_PROXY_SPREAD", "ep", true,
         "`0`: the CPU proxy sends its rows to a peer over tcp in order on one connection, instead of spreading them "
         "over the tcp streams (`MOELINK_TCP_STREAMS`) once 256 KiB or more of them are with the engine"),
    flag("MOELINK_EP_TMA", "ep", true,
         "`0`: the low-latency dispatch and the normal-mode combine's sender write token rows with warp stores "
         "instead of bulk copies (TMA)"),
    flag("MOELINK_EP_TWO_HOP", "ep", true,
         "`0`: normal mode across hosts takes the group path instead of the two-hop route"),
    choice("MOELINK_EP_IBGDA", "ep", "auto|off|emulate",
           "cross-host pairs: `auto` uses IBGDA where both ends have an mlx5 NIC it can use, `off` the proxy, "
           "`emulate` an emulated NIC (ranks of one host; for testing)"),
    text("MOELINK_IBGDA_DEVICE", "ep", "first active mlx5", "the NIC for IBGDA (`mlx5_0` or `mlx5_0:1`)"),
    number("MOELINK_IBGDA_GID_INDEX", "ep", 0, 0, 255, "RoCE: the GID index to address from", "a RoCE v2 GID"),
    text("MOELINK_IBGDA_PLUGIN", "ep", "`moelink_ibgda.so` beside the module",
         "the IBGDA plugin to load (rdma-core's side of IBGDA)"),
    flag("MOELINK_EP_IBGDA_TRACE", "ep", false,
         "`1`: the emulated NIC reports every queue pair's work at teardown, not only failures"),
};

const char* raw(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

uint64_t parseNumber(const Setting& s, const char* v) {
  const std::string text = v;
  bool ok = !text.empty() && text.size() <= 20 && text.find_first_not_of("0123456789") == std::string::npos;
  uint64_t x = 0;
  for (char c : text) {
    if (!ok) break;
    const uint64_t d = static_cast<uint64_t>(c - '0');
    ok = x <= (UINT64_MAX - d) / 10;
    x = x * 10 + d;
  }
  if (s.kind == Kind::kFlag)
    MOELINK_CHECK(ok && x <= 1, s.name, " must be 0 or 1, got '", text, "'");
  MOELINK_CHECK(ok, s.name, " must be a number, got '", text, "'");
  MOELINK_CHECK(x >= s.min && x <= s.max, s.name, " must be ", s.min, "..", s.max, ", got ", x);
  return x;
}

}  // namespace

const Setting& find(const char* name) {
  for (const Setting& s : kSettings)
    if (std::strcmp(s.name, name) == 0) return s;
  MOELINK_THROW("no setting named ", name, " is declared (src/common/settings.cpp)");
}

const std::vector<Setting>& all() { return kSettings; }

std::optional<uint64_t> numberIfSet(const char* name) {
  const Setting& s = find(name);
  MOELINK_CHECK(s.kind == Kind::kNumber || s.kind == Kind::kFlag, name, " is not a number");
  const char* v = raw(name);
  if (!v) return std::nullopt;
  return parseNumber(s, v);
}

uint64_t number(const char* name) { return numberIfSet(name).value_or(find(name).number); }

bool flag(const char* name) { return number(name) != 0; }

std::string text(const char* name) {
  const Setting& s = find(name);
  MOELINK_CHECK(s.kind == Kind::kChoice || s.kind == Kind::kText, name, " is not a text");
  const char* v = raw(name);
  if (s.kind == Kind::kText) return v ? v : "";
  const std::string choices = s.choices;
  const std::string first = choices.substr(0, choices.find('|'));
  if (!v) return first;
  const std::string value = v;
  MOELINK_CHECK(("|" + choices + "|").find("|" + value + "|") != std::string::npos, name, " must be one of ",
                choices, ", got '", value, "'");
  return value;
}

void warnUnknown() {
  static std::once_flag once;
  std::call_once(once, [] {
    for (char** e = environ; e && *e; ++e) {
      const std::string entry = *e;
      if (entry.rfind("MOELINK_", 0) != 0) continue;
      const std::string name = entry.substr(0, entry.find('='));
      bool known = false;
      for (const Setting& s : kSettings) known = known || name == s.name;
      // The project's scripts and tests read a few of their own (MOELINK_TEST_*, the build and
      // fuzz options of scripts/*.sh): not the library's business.
      for (const char* tool : {"MOELINK_TEST_", "MOELINK_SKIP_", "MOELINK_FUZZ_", "MOELINK_BUILD_DIR", "MOELINK_TORCH"})
        known = known || name.rfind(tool, 0) == 0;
      if (!known)
        LOG(WARNING) << "moelink: " << name << " is set but is not a moelink setting (a typo, or a retired name?); "
                     << "the settings are listed in the README";
    }
  });
}

int usableCores() {
  cpu_set_t cpus;
  return sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? std::max(1, CPU_COUNT(&cpus)) : 1;
}

}  // namespace moelink::settings
