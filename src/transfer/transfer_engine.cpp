#include "moelink/transfer/transfer_engine.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include <glog/logging.h>

#include "moelink/common/error.h"
#include "moelink/common/settings.h"
#include "moelink/transfer/records.h"
#include "moelink/transfer/shm/process_read.h"
#include "moelink/transfer/shm/transport.h"
#include "moelink/transfer/tcp/socket.h"
#include "moelink/transfer/tcp/transport.h"

namespace moelink::transfer {

using std::chrono::milliseconds;

void LocalSegments::add(SegmentId id, void* addr, uint64_t length) {
  std::unique_lock<std::shared_mutex> g(mu_);
  MOELINK_CHECK(entries_.count(id) == 0, "segment ", id, " is already registered");
  entries_[id] = Entry{addr, length};
}

void LocalSegments::remove(SegmentId id) {
  std::unique_lock<std::shared_mutex> g(mu_);
  entries_.erase(id);
}

void* LocalSegments::resolve(SegmentId id, uint64_t offset, uint64_t length) const {
  std::shared_lock<std::shared_mutex> g(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return nullptr;
  const Entry& e = it->second;
  if (offset > e.length || length > e.length - offset) return nullptr;
  return static_cast<char*>(e.addr) + offset;
}

void LocalSegments::expect(SegmentId id, uint64_t offset, void* dest, uint64_t length) {
  std::lock_guard<std::mutex> g(expect_mu_);
  expected_[{id, offset}] = Expectation{dest, length, false};
  expecting_.store(expected_.size());
}

void* LocalSegments::resolveIncomingWrite(SegmentId id, uint64_t offset, uint64_t length) {
  // (an expectation is installed before its writer may send: one that matters here was counted)
  if (expecting_.load() != 0) {
    std::lock_guard<std::mutex> g(expect_mu_);
    if (!expected_.empty()) {
      auto it = expected_.find({id, offset});
      if (it != expected_.end() && !it->second.used && length <= it->second.length && length > 0) {
        it->second.used = true;
        return it->second.dest;
      }
    }
  }
  return resolve(id, offset, length);
}

void* LocalSegments::claim(SegmentId id, uint64_t offset) {
  std::lock_guard<std::mutex> g(expect_mu_);
  auto it = expected_.find({id, offset});
  if (it == expected_.end()) return nullptr;
  void* dest = it->second.used ? it->second.dest : nullptr;
  expected_.erase(it);
  expecting_.store(expected_.size());
  return dest;
}

std::vector<LocalSegments::UsedExpectation> LocalSegments::clearExpectations(SegmentId id) {
  std::vector<UsedExpectation> used;
  std::lock_guard<std::mutex> g(expect_mu_);
  for (auto it = expected_.begin(); it != expected_.end();) {
    if (it->first.first != id) {
      ++it;
      continue;
    }
    if (it->second.used) used.push_back({it->first.second, it->second.dest, it->second.length});
    it = expected_.erase(it);
  }
  expecting_.store(expected_.size());
  return used;
}

std::string localHostId() {
  if (std::string id = settings::text("MOELINK_HOST_ID"); !id.empty()) return id;
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  std::string boot;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::getline(f, boot);
  return str(host, "/", boot);
}

namespace {

std::string modeFromEnv(const std::string& given) {
  const std::string m = given.empty() ? settings::text("MOELINK_TRANSPORT") : given;
  MOELINK_CHECK(m == "auto" || m == "tcp" || m == "shm", "the transport must be auto, tcp or shm, got '", m, "'");
  return m;
}

// Field 22 of /proc/<pid>/stat (start time in clock ticks) and the state letter; {0, 0}
// when the process does not exist.
std::pair<uint64_t, char> processStart(int64_t pid) {
  std::ifstream f(str("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(f, line)) return {0, 0};
  auto close = line.rfind(')');  // the command name may hold spaces and parentheses
  if (close == std::string::npos) return {0, 0};
  std::istringstream rest(line.substr(close + 2));
  std::string field;
  char state = 0;
  uint64_t start = 0;
  for (int i = 3; i <= 22 && rest >> field; ++i) {
    if (i == 3) state = field[0];
    if (i == 22) start = std::stoull(field);
  }
  return {start, state};
}

std::string pidNamespace() {
  char buf[128] = {0};
  ssize_t n = readlink("/proc/self/ns/pid", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, n) : std::string();
}

// The claim tokens of this process's live engines (claimRank): a rank held by this process
// is free once the engine that holds it is gone.
struct LiveClaims {
  std::mutex mu;
  std::set<std::string> tokens;
};
LiveClaims& liveClaims() {
  static LiveClaims* c = new LiveClaims;  // outlives every engine, static destruction included
  return *c;
}

// The value of `rank`'s cross-memory probe word: from the group's secret, so that a reader
// that finds it has read the right process.
uint64_t readProbeValue(uint64_t secret, int rank) {
  return (secret ^ 0x6d6f656c696e6b21ull) * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(rank);
}

}  // namespace

TransferEngine::TransferEngine(std::shared_ptr<MetadataStore> store, EngineOptions options)
    : store_(std::move(store)), opts_(std::move(options)) {
  MOELINK_CHECK(opts_.world_size >= 1 && opts_.rank >= 0 && opts_.rank < opts_.world_size,
                "bad rank ", opts_.rank, " for world size ", opts_.world_size);
  mode_ = modeFromEnv(opts_.transport);
  if (!settings::flag("MOELINK_SHM_PULL")) opts_.cross_memory_reads = false;
  settings::warnUnknown();
  host_id_ = localHostId();
  // Nothing is written to the store before the rank is this process's (claimRank): a process
  // that is refused leaves the group it tried to join as it was.
  claimRank();
  if (opts_.rank == 0 && !opts_.extension) {
    store_->set(kGroupKey, std::to_string(opts_.world_size));
    std::random_device rd;
    uint64_t s = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    store_->set("engine/secret", std::to_string(s ? s : 1));
  } else {
    checkGroupSize();
  }
  secret_ = parseCount(store_->get("engine/secret", opts_.timeout), "group secret");
  peer_doorbells_.assign(opts_.world_size, nullptr);
  doorbell_ = static_cast<DoorbellWord*>(allocateSegment(kDoorbellSegment, sizeof(DoorbellWord)));
  tcp_ = std::make_unique<tcp::TcpTransport>(opts_.rank, opts_.world_size, secret_, local_, opts_.timeout,
                                             [this] { ringDoorbell(doorbell_); }, opts_.listen_ip,
                                             opts_.tcp_tuning.value_or(tcp::TcpTuning::fromEnv(opts_.world_size)));
  shm_ = std::make_unique<shm::ShmTransport>(host_id_);
  read_probe_ = readProbeValue(secret_, opts_.rank);
  PeerInfo me;
  me.host_id = host_id_;
  me.tcp_address = tcp_->address();
  me.pid = getpid();
  me.start_time = processStart(me.pid).first;
  me.pid_ns = pidNamespace();
  me.read_probe = reinterpret_cast<uint64_t>(&read_probe_);
  store_->set(key(opts_.rank, "peer"), endpointRecord(me));
}

void TransferEngine::claimRank() {
  const int rank = opts_.rank;
  const std::string counter = str("engine/incarnation/", rank);
  const auto deadline = std::chrono::steady_clock::now() + opts_.timeout;
  std::random_device rd;
  const std::string token = str(getpid(), ".", host_id_, ".", rd(), rd());
  while (true) {
    const int64_t held = store_->check(counter) ? store_->add(counter, 0) : 0;
    if (held > 0) {
      std::string holder = liveHolder(rank, held);
      if (!holder.empty())
        MOELINK_THROW("rank ", rank, " of this group is held by ", holder,
                      "; a process joins a group only as a rank that no live process holds (another job on the "
                      "same store address, or a rank started twice?). A replacement for a failed rank joins once "
                      "that rank's process is gone.");
    }
    // One process wins each incarnation: the claim key of the next one is set only once.
    if (store_->compareSet(str("engine/claim/", rank, ".", held + 1), "", token) == token) {
      {
        std::lock_guard<std::mutex> g(liveClaims().mu);
        liveClaims().tokens.insert(token);
      }
      claim_token_ = token;
      incarnation_ = store_->add(counter, 1);
      MOELINK_CHECK(incarnation_ == held + 1, "rank ", rank, "'s incarnation counter moved from ", held, " to ",
                    incarnation_, " while this process claimed the rank (a process outside moelink's protocol?)");
      return;
    }
    // Another process claimed it just now: look at that one (alive: refused above).
    if (std::chrono::steady_clock::now() > deadline)
      MOELINK_THROW_TIMEOUT("could not claim rank ", rank, " within ", opts_.timeout.count(), " ms");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

std::string TransferEngine::liveHolder(int rank, int64_t incarnation) {
  // The holder publishes its record right after its claim; one that died in between has none.
  const std::string k = str("engine/peer/", rank, ".", incarnation);
  const auto wait = std::min<milliseconds>(opts_.timeout, std::chrono::seconds(5));
  PeerInfo info;
  try {
    info = parseEndpointRecord(store_->get(k, wait), rank);
  } catch (const TimeoutError&) {
    return "";
  }
  const std::string host = info.host_id.substr(0, info.host_id.find('/'));
  if (info.host_id == host_id_ && info.pid == getpid() && info.pid_ns == pidNamespace()) {
    // This process: held while the engine that claimed it lives (an earlier group on the same
    // store whose engine is gone leaves it free).
    const std::string claim = str("engine/claim/", rank, ".", incarnation);
    const std::string token = store_->check(claim) ? store_->get(claim, opts_.timeout) : "";
    std::lock_guard<std::mutex> g(liveClaims().mu);
    if (!liveClaims().tokens.count(token)) return "";
  } else if (!processGone(info, milliseconds(1000), nullptr).empty()) {
    return "";
  }
  return str("pid ", info.pid, " on host ", host, " (incarnation ", incarnation, ", listening at ", info.tcp_address,
             ")");
}

void TransferEngine::checkGroupSize() {
  std::string rec;
  try {
    rec = store_->get(kGroupKey, opts_.timeout);
  } catch (const TimeoutError&) {
    MOELINK_THROW_TIMEOUT("rank 0 did not create the group within ", opts_.timeout.count(),
                          " ms (is it running, with world size ", opts_.world_size, " and the same store?)");
  }
  const uint64_t size = parseCount(rec, "group size record");
  if (size == static_cast<uint64_t>(opts_.world_size)) return;
  const std::string why = str("rank ", opts_.rank, " was started with world size ", opts_.world_size,
                              ", rank 0 with ", size, ": every rank of a group must be given the same world size");
  store_->set(kRefusedKey, why);  // the ranks waiting for this one fail with it at once
  MOELINK_THROW(why);
}

std::string TransferEngine::key(int rank, const std::string& what, std::optional<milliseconds> wait) {
  int64_t inc = rank == opts_.rank ? incarnation_ : 0;
  if (!inc) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = incarnations_.find(rank);
    if (it != incarnations_.end()) inc = it->second;
  }
  if (!inc) {
    // The counter exists once the rank's process has started; wait for it as for any key.
    std::string k = str("engine/incarnation/", rank);
    store_->get(k, wait.value_or(opts_.timeout));
    inc = store_->add(k, 0);
    std::lock_guard<std::mutex> g(mu_);
    incarnations_[rank] = inc;
  }
  return str("engine/", what, "/", rank, ".", inc);
}

std::string TransferEngine::probe(int peer, milliseconds timeout, int64_t incarnation, bool* certain) {
  MOELINK_CHECK(peer >= 0 && peer < opts_.world_size && peer != opts_.rank, "cannot probe rank ", peer);
  if (certain) *certain = false;
  // The endpoint record comes from the store, which may itself be out of reach (a cut link):
  // wait for it no longer than for the probe, and report that as no answer.
  PeerInfo info;
  try {
    info = incarnation > 0 ? readPeerInfo(peer, str("engine/peer/", peer, ".", incarnation), timeout)
                           : peerInfo(peer, timeout);
  } catch (const std::exception& e) {
    return str("its endpoint record could not be read from the store within ", timeout.count(), " ms (", e.what(),
               ")");
  }
  return processGone(info, timeout, certain);
}

std::string TransferEngine::processGone(const PeerInfo& info, milliseconds timeout, bool* certain) {
  if (certain) *certain = false;
  if (info.host_id == host_id_ && info.pid > 0 && info.pid_ns == pidNamespace()) {
    if (certain) *certain = true;
    auto [start, state] = processStart(info.pid);
    if (start == 0) return str("its process (pid ", info.pid, ") has exited");
    if (state == 'Z' || state == 'X') return str("its process (pid ", info.pid, ") has exited");
    if (start != info.start_time) return str("its process (pid ", info.pid, ") has exited (the pid is reused)");
    return "";
  }
  return tcp::probeListener(info.tcp_address, timeout, certain);
}

void TransferEngine::forgetPeer(int peer) {
  MOELINK_CHECK(peer >= 0 && peer < opts_.world_size && peer != opts_.rank, "cannot forget rank ", peer);
  std::vector<std::unique_ptr<RemoteSegment>> closing;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto it = opened_.begin(); it != opened_.end();) {
      if (it->first.first == peer) {
        closing.push_back(std::move(it->second));
        it = opened_.erase(it);
      } else {
        ++it;
      }
    }
    peers_.erase(peer);
    readable_.erase(peer);
    incarnations_.erase(peer);
    peer_doorbells_[peer] = nullptr;
  }
  for (auto& seg : closing)
    if (seg->via) seg->via->close(*seg);
  tcp_->forget(peer);
  // A peer is forgotten when it left the group (or its replacement takes its rank): where its
  // process is gone, nothing will open its names again.
  shm::reclaimOrphanedRegions();
}

TransferEngine::~TransferEngine() {
  {
    std::lock_guard<std::mutex> g(liveClaims().mu);
    liveClaims().tokens.erase(claim_token_);
  }
  tcp_->shutdown();
  std::lock_guard<std::mutex> g(mu_);
  for (auto& [key, seg] : opened_) {
    if (seg->via) seg->via->close(*seg);
  }
  opened_.clear();
  for (auto& [id, seg] : segments_) releaseOwned(seg);
}

namespace {
// An owned segment's mapping in tcp mode: whole pages, at least one.
uint64_t mappedBytes(uint64_t length) { return (length ? length + 4095 : 4096) / 4096 * 4096; }
}  // namespace

void TransferEngine::releaseOwned(OwnedSegment& seg) {
  if (!seg.owned) return;
  if (seg.shared) {
    shm::SharedRegion r{seg.addr, seg.length, seg.shm_name};
    shm::destroyRegion(r, /*unlink=*/!seg.shm_name.empty());
  } else {
    munmap(seg.addr, mappedBytes(seg.length));
  }
  seg.owned = false;
}

std::string TransferEngine::tcpAddress() const { return tcp_->address(); }

void* TransferEngine::allocateSegment(SegmentId id, uint64_t length) {
  OwnedSegment s;
  s.length = length;
  s.owned = true;
  if (mode_ == "tcp") {
    // Page-aligned and zeroed, as shared-memory segments are (the layouts in them assume
    // cache-line alignment); anonymous pages, so that slots never written (tcp receives large
    // payloads straight to where they land) take no memory.
    void* addr = mmap(nullptr, mappedBytes(length), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    MOELINK_CHECK(addr != MAP_FAILED, "out of memory allocating segment ", id, " of ", length, " bytes");
    s.addr = addr;
  } else {
    auto r = shm::createRegion(opts_.rank, id, length);
    s.addr = r.addr;
    s.shm_name = r.name;
    s.shared = true;
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    MOELINK_CHECK(segments_.count(id) == 0, "segment ", id, " is already registered");
    segments_[id] = s;
  }
  local_.add(id, s.addr, length);
  store_->set(str(key(opts_.rank, "seg"), "/", id), SegmentDesc{opts_.rank, id, length, s.shm_name}.serialize());
  return s.addr;
}

void TransferEngine::registerSegment(SegmentId id, void* addr, uint64_t length) {
  {
    std::lock_guard<std::mutex> g(mu_);
    MOELINK_CHECK(segments_.count(id) == 0, "segment ", id, " is already registered");
    segments_[id] = OwnedSegment{addr, length, "", false, false};
  }
  local_.add(id, addr, length);
  store_->set(str(key(opts_.rank, "seg"), "/", id), SegmentDesc{opts_.rank, id, length, ""}.serialize());
}

void TransferEngine::unregisterSegment(SegmentId id) {
  local_.remove(id);
  std::lock_guard<std::mutex> g(mu_);
  auto it = segments_.find(id);
  if (it == segments_.end()) return;
  releaseOwned(it->second);
  segments_.erase(it);
}

void TransferEngine::unlinkSharedNames() {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& [id, seg] : segments_) {
    if (!seg.shm_name.empty()) {
      shm_unlink(seg.shm_name.c_str());
      seg.shm_name.clear();  // the mapping stays; nothing left to unlink later
    }
  }
}

const PeerInfo& TransferEngine::peerInfo(int peer, std::optional<milliseconds> wait) {
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = peers_.find(peer);
    if (it != peers_.end()) return it->second;
  }
  PeerInfo info = readPeerInfo(peer, key(peer, "peer", wait), wait);
  std::lock_guard<std::mutex> g(mu_);
  return peers_.emplace(peer, info).first->second;
}

PeerInfo TransferEngine::readPeerInfo(int peer, const std::string& k, std::optional<milliseconds> wait) {
  return parseEndpointRecord(store_->get(k, wait.value_or(opts_.timeout)), peer);
}

std::string TransferEngine::openSegment(int peer, SegmentId id) {
  MOELINK_CHECK(peer >= 0 && peer < opts_.world_size, "peer rank ", peer,
                " out of range for world size ", opts_.world_size);
  if (auto* s = findOpened(peer, id)) return s->via ? s->via->name() : "local";
  auto seg = std::make_unique<RemoteSegment>();
  seg->desc = parseSegmentRecord(store_->get(str(key(peer, "seg"), "/", id), opts_.timeout), peer, id);
  if (peer != opts_.rank) {
    const PeerInfo& info = peerInfo(peer);
    if (mode_ != "tcp" && shm_->open(info, *seg)) {
      seg->via = shm_.get();
    } else {
      MOELINK_CHECK(mode_ != "shm", "MOELINK_TRANSPORT=shm but rank ", peer,
                    "'s segment ", id, " is not reachable through shared memory (host '",
                    info.host_id, "' vs '", host_id_, "')");
      tcp_->open(info, *seg);
      seg->via = tcp_.get();
    }
  }
  std::string name = seg->via ? seg->via->name() : "local";
  VLOG(1) << "moelink: rank " << opts_.rank << " opened segment " << id << " of rank " << peer
          << " via " << name;
  RemoteSegment* opened;
  {
    std::lock_guard<std::mutex> g(mu_);
    opened = opened_.emplace(std::make_pair(peer, id), std::move(seg)).first->second.get();
  }
  if (id == kDoorbellSegment) {
    peer_doorbells_[peer] = opened;
  } else if (!peer_doorbells_[peer]) {
    openSegment(peer, kDoorbellSegment);  // every opened peer can be notified
  }
  return name;
}

RemoteSegment* TransferEngine::findOpened(int peer, SegmentId id) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = opened_.find({peer, id});
  return it == opened_.end() ? nullptr : it->second.get();
}

std::string TransferEngine::transportOf(int peer, SegmentId id) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = opened_.find({peer, id});
  MOELINK_CHECK(it != opened_.end(), "segment ", id, " of rank ", peer, " is not opened");
  return it->second->via ? it->second->via->name() : "local";
}

std::vector<uint64_t> TransferEngine::tcpSentPerStream() const { return tcp_->sentPerStream(); }

void TransferEngine::notify(int peer) {
  RemoteSegment* bell = peer >= 0 && peer < opts_.world_size ? peer_doorbells_[peer] : nullptr;
  MOELINK_CHECK(bell, "rank ", peer, "'s doorbell is not opened");
  if (!bell->via) {
    ringDoorbell(doorbell_);
  } else if (bell->mapped) {
    ringDoorbell(static_cast<DoorbellWord*>(bell->mapped));
  } else {  // an empty write that rings on arrival
    submit({TransferRequest{Opcode::kWrite, nullptr, peer, kDoorbellSegment, 0, 0, true}});
  }
}

bool TransferEngine::canReadFrom(int peer) {
  if (peer < 0 || peer >= opts_.world_size || peer == opts_.rank || mode_ == "tcp" || !opts_.cross_memory_reads)
    return false;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = readable_.find(peer);
    if (it != readable_.end()) return it->second;
  }
  const PeerInfo& info = peerInfo(peer);
  bool ok = info.host_id == host_id_ && info.pid_ns == pidNamespace() &&
            shm::canReadProcess(info.pid, info.read_probe, readProbeValue(secret_, peer));
  VLOG(1) << "moelink: rank " << opts_.rank << (ok ? " can" : " cannot") << " read rank " << peer
          << "'s memory directly";
  std::lock_guard<std::mutex> g(mu_);
  readable_[peer] = ok;
  return ok;
}

std::string TransferEngine::readFrom(int peer, void* dst, uint64_t remote_addr, uint64_t length) {
  int64_t pid = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto r = readable_.find(peer);
    auto it = peers_.find(peer);
    if (r != readable_.end() && r->second && it != peers_.end()) pid = it->second.pid;
  }
  if (!pid) return str("rank ", peer, "'s memory cannot be read directly from this process");
  return shm::readProcess(pid, dst, remote_addr, length);
}

void* TransferEngine::mappedAt(int peer, SegmentId id, uint64_t offset, uint64_t length) {
  RemoteSegment* seg = findOpened(peer, id);
  if (!seg || !seg->mapped || offset > seg->desc.length || length > seg->desc.length - offset) return nullptr;
  return static_cast<char*>(seg->mapped) + offset;
}

std::string TransferEngine::lostReason(int peer) const { return tcp_ ? tcp_->lostReason(peer) : ""; }

uint64_t TransferEngine::losses() const { return tcp_ ? tcp_->losses() : 0; }

BatchPtr TransferEngine::submit(const std::vector<TransferRequest>& requests) {
  const size_t n = requests.size();
  auto batch = std::make_shared<TransferBatch>(n);
  std::vector<RemoteSegment*> remote(n, nullptr);  // requests to post to a transport
  for (size_t i = 0; i < n; ++i) {
    const TransferRequest& r = requests[i];
    RemoteSegment* seg = (r.peer >= 0 && r.peer < opts_.world_size) ? findOpened(r.peer, r.segment)
                                                                      : nullptr;
    if (!seg) {
      batch->fail(i, str("segment ", r.segment, " of rank ", r.peer, " is not opened"));
      continue;
    }
    if (r.offset > seg->desc.length || r.length > seg->desc.length - r.offset) {
      batch->fail(i, str("request of ", r.length, " bytes at offset ", r.offset,
                         " is outside segment ", r.segment, " of rank ", r.peer, " (",
                         seg->desc.length, " bytes)"));
      continue;
    }
    if (!seg->via) {  // this rank's own segment
      void* mine = local_.resolve(r.segment, r.offset, r.length);
      if (r.op == Opcode::kWrite)
        shm::orderedCopy(mine, r.local, r.length);
      else if (r.length)
        std::memcpy(r.local, mine, r.length);
      batch->complete(i);
      if (r.notify) ringDoorbell(doorbell_);
      continue;
    }
    remote[i] = seg;
  }
  // A write followed in the batch by a write to the same peer over the same transport needs no
  // acknowledgement of its own (TransferRequest::no_ack): the batch completes with that one.
  std::vector<char> covered(n, 0);
  if (n > 1) {
    std::vector<Transport*> next_write(opts_.world_size, nullptr);
    for (size_t i = n; i-- > 0;) {
      // (an unordered write may be applied before the earlier ones: its acknowledgement says
      // nothing of theirs)
      if (!remote[i] || requests[i].op != Opcode::kWrite || requests[i].unordered) continue;
      covered[i] = next_write[requests[i].peer] == remote[i]->via;
      next_write[requests[i].peer] = remote[i]->via;
    }
  }
  std::vector<Transport*> posted;  // the transports given requests, to flush
  for (size_t i = 0; i < n; ++i) {
    RemoteSegment* seg = remote[i];
    if (!seg) continue;
    const TransferRequest& r = requests[i];
    if (std::find(posted.begin(), posted.end(), seg->via) == posted.end()) posted.push_back(seg->via);
    if (covered[i] && !r.no_ack) {
      TransferRequest unacknowledged = r;
      unacknowledged.no_ack = true;
      seg->via->post(unacknowledged, *seg, batch, i);
    } else {
      seg->via->post(r, *seg, batch, i);
    }
    // tcp carries the flag to the peer, whose progress thread rings there; shm rings here.
    if (r.notify && seg->via == shm_.get()) {
      if (RemoteSegment* bell = peer_doorbells_[r.peer]; bell && bell->mapped)
        ringDoorbell(static_cast<DoorbellWord*>(bell->mapped));
    }
  }
  for (Transport* t : posted) t->flush();
  return batch;
}

}  // namespace moelink::transfer
