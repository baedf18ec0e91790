// CollectiveWorker: one thread per group that runs collectives and point-to-point
// transfers over two mailboxes (one for collectives, one for send/recv, so that a pending
// recv never blocks a collective).
//
// Collectives run one at a time in submission order; each is numbered (op_seq) and every
// message carries {kind, op_seq, dtype, reduce op, root, sizes}. A receiver compares the
// header with its own view and fails the op with a message naming both sides. A failed op
// drains: it tells the peers it was sending to (an ABORT|LAST message) and discards what
// they still send for it, so the next op starts on clean mailboxes. Every op has a
// deadline; nothing waits forever.
//
// Point-to-point: sends to a peer go out in order; a send is matched, by (source, tag) as
// gloo matches, with the earliest posted recv that names its source or takes any source and
// has its tag (the sizes must then agree, else that recv fails). A send that no posted recv
// matches while a recv waits on its source (with another tag) is taken out of the mailbox
// into host memory, so that the sends behind it can reach their recvs; later recvs match
// such stashed sends first, in arrival order.
//
// Membership (membership.h): ops are built when they start, from the active ranks of that
// moment, so that a change of mask applies to every later op. While a change is being
// agreed the thread holds collectives still; then the op in flight is built again over the
// survivors and rerun (every message carries the epoch; those of an older epoch are
// dropped), or fails, as the decision says.
//
// Waiting: peers ring this rank's doorbell (transfer/doorbell.h) with every message and
// credit they send, and submitters ring it with every new op. The thread spins a little
// while work is in flight (MOELINK_WORKER_SPIN pause iterations; default 256 when the host
// has a core per local rank, else 0), then sleeps
// on the doorbell (futex), so that several ranks share few cores without stealing each
// other's time slices, and wakes within microseconds when something arrives. An op held
// back by its `ready` gate, or a step by its own (Step::gate: data still being copied off a
// GPU, which rings no doorbell), is spun on for a while where the host has cores to spare
// (MOELINK_WORKER_GATE_SPIN_US) and then polled every few tens of microseconds.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "moelink/collective/algorithms.h"
#include "moelink/collective/mailbox.h"
#include "moelink/collective/message_check.h"
#include "moelink/collective/p2p_receiver.h"
#include "moelink/collective/membership.h"
#include "moelink/collective/operation.h"
#include "moelink/transfer/metadata_store.h"
#include "moelink/transfer/transfer_engine.h"

namespace moelink::collective {

struct WorkerOptions {
  // MOELINK_CHUNK_BYTES: the mailbox slot's payload, the same on every rank; 0 (unset): by the
  // group, kChunkBytes where its first ranks share a host and shared memory, kTcpChunkBytes where
  // they use tcp (forced, or on several hosts). A process that joins a running group takes the
  // group's, which its own setting must then equal.
  uint64_t chunk_bytes = 0;
  int depth = 4;                             // MOELINK_MAILBOX_DEPTH
  uint64_t allreduce_small_bytes = 64 << 10; // MOELINK_ALLREDUCE_SMALL_BYTES
  // Pieces of at least this size go to same-host peers that can read this process's memory
  // as pulled messages (mailbox.h), in ops whose OpSpec allows it. MOELINK_PULL_MIN_BYTES.
  uint64_t pull_min_bytes = 64 << 10;
  // all_to_all's piece size for such pairs (AlgoContext::pull_chunk). MOELINK_PULL_CHUNK_BYTES.
  uint64_t pull_chunk_bytes = 4 << 20;
  // MOELINK_CHAIN_BROADCAST_BYTES; unset: 1 MiB in groups that span hosts, else never (on one
  // host the root's sends cost CPU, not link bandwidth, and a chain costs more hand-offs).
  int64_t chain_broadcast_bytes = -1;
  // MOELINK_RING_ALLREDUCE_BYTES; unset: 4 MiB in groups that talk over tcp, else never.
  int64_t ring_allreduce_bytes = -1;
  // MOELINK_REDUCE_PIECE_BYTES (AlgoContext::reduce_piece_min); unset: 256 KiB in groups that
  // talk over tcp, else 0.
  int64_t reduce_piece_bytes = -1;
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  bool raise_on_peer_failure = false;  // EpOptions(on_peer_failure="raise")
  // This process replaces a failed rank (or takes a reserved one): construction waits until
  // the group readmits it.
  bool extension = false;
  // Ranks [0, initial_size) create the group; the others are reserved, inactive until
  // readmitted (0: every rank creates it).
  int initial_size = 0;
  // Reads the MOELINK_* variables above over the given defaults.
  static WorkerOptions fromEnv(std::chrono::milliseconds timeout);
};

// Builds a collective over the participants of the moment (called on the worker thread when
// the op starts, and again if a membership change reruns it).
using OpBuilder = std::function<OpSpec(const AlgoContext&)>;

class CollectiveWorker {
 public:
  // Allocates the mailboxes, waits until every rank has, opens the peers' ones and
  // starts the thread. Collective over the group (every rank constructs one).
  CollectiveWorker(transfer::TransferEngine& engine, transfer::MetadataStore& store,
                   WorkerOptions options);
  ~CollectiveWorker();  // stops the thread; fails what has not finished

  int rank() const { return rank_; }
  int worldSize() const { return world_; }
  const WorkerOptions& options() const { return opts_; }

  // Active-rank mask: ops built after a change leave inactive ranks out.
  bool isActive(int rank) const;
  std::vector<char> mask() const;
  uint64_t epoch() const;
  // Why this rank is out of the group ("" while it is in).
  std::string outReason() const;
  // During a completion callback: the ranks the op lost while it ran.
  const std::vector<int>& opLost() const { return op_lost_; }
  // Whether a process that replaces `rank` has joined and waits to be readmitted and is alive,
  // or `rank` is active and its process alive.
  bool peerWaiting(int rank);
  // Readmits `ranks` (each waiting): an op of the active ranks, which all call it; the ranks
  // take part from the next op on.
  void readmit(const std::vector<int>& ranks, OpCallback done, std::chrono::milliseconds timeout);
  // Any thread: something outside the worker (a GPU op) has waited a while on the group; the
  // thread checks the active peers' liveness (as for a stalled op) soon.
  void watchPeers();
  // Runs `f` on the worker thread after every change of the mask (registration: any thread).
  void onChange(std::function<void()> f);
  // The participants and tunables that algorithms build ops for, as of now.
  AlgoContext context() const;
  std::string transportTo(int peer) const { return coll_->transportTo(peer); }
  // Whether `peer` reads this rank's large collective messages straight from its memory
  // (mailbox.h: pulled messages) instead of out of shared-memory slots.
  bool peerReadsDirectly(int peer) const { return coll_->peerReadsDirectly(peer); }

  void submit(OpBuilder build, OpCallback done, std::chrono::milliseconds timeout);
  // A prebuilt op: it fails, rather than rerun, if the mask changes while it runs.
  void submit(OpSpec op, OpCallback done, std::chrono::milliseconds timeout);
  // `ready`, when set, holds the send back as OpSpec::ready holds a collective.
  void send(int peer, const void* data, uint64_t bytes, int tag, OpCallback done,
            std::chrono::milliseconds timeout, std::function<bool()> ready = nullptr);
  // peer < 0: any source.
  void recv(int peer, void* data, uint64_t bytes, int tag, RecvCallback done,
            std::chrono::milliseconds timeout);

  struct Collective;
  struct SendOp;

 private:
  void enqueue(std::unique_ptr<Collective> op, OpCallback done, std::chrono::milliseconds timeout);
  void loop();
  bool progressCollective(Collective& op);
  // progressCollective's steps (worker.cpp).
  void startOp(Collective& op);
  bool gateOpen(Collective& op, size_t step);
  void askLandings(Collective& op);
  bool sendPieces(Collective& op);
  bool consumeSteps(Collective& op);
  void settleTransfers(Collective& op);
  bool finishIfDone(Collective& op);
  bool checkStall(Collective& op);
  bool progressDrain(Collective& op);
  bool progressSends();
  void failCollective(Collective& op, const std::string& why);
  const MsgHeader* nextFresh(int peer, uint64_t seq);
  // Why `peer` is gone ("" while it is not known to be), refreshed from the engine when it
  // reports a new loss.
  const std::string& lostPeer(int peer);
  bool anyPeerLost();  // one atomic load unless the engine reports a new loss
  // What `op` expects of a `bytes`-byte piece from `peer` (message_check.h).
  ExpectedPiece expectedPiece(const Collective& op, int peer, uint64_t bytes) const;
  // Membership (worker_membership.cpp).
  void waitAdmission();
  // The mailbox slot size of this process (WorkerOptions::chunk_bytes): published in the store for
  // the others to compare with (checkChunkBytes), or the group's for a process that joins it.
  uint64_t chunkBytes(int initial);
  // Fails the group's creation, on every rank, where the first ranks' slot sizes differ (each
  // rank's layout of its peers' segments would differ).
  void checkChunkBytes(int initial);
  bool pollMembership();  // true when something changed
  void applyChange(const MembershipChange& c);
  void notifyChange();  // runs the onChange listeners
  void detect(Collective& op, const std::vector<int>& waiting);
  bool startCollective(Collective& op);  // builds it; false if it fails at once
  void finishCollective(Collective& op, const std::string& error);

  transfer::TransferEngine& engine_;
  WorkerOptions opts_;
  int rank_, world_;
  std::unique_ptr<Mailbox> coll_, p2p_;
  std::vector<char> active_;
  std::unique_ptr<Membership> membership_;
  transfer::MetadataStore& store_;
  uint64_t completed_seq_ = 0;   // worker thread: the newest collective finished
  uint64_t fail_through_ = 0;    // worker thread: unfinished collectives up to this fail
  bool is_out_ = false;          // worker thread: the group decided it goes on without this rank
  std::string fail_why_;
  std::string out_;              // guarded by mu_: why this rank left the group
  std::vector<int> op_lost_;
  std::vector<char> live_;       // worker thread's copy of active_
  std::atomic<bool> watch_requested_{false};
  std::vector<std::function<void()>> on_change_;  // guarded by mu_
  std::vector<int64_t> seen_incarnation_;  // per rank: the newest process readmitted
  std::vector<char> probed_loss_;          // per rank: its broken connection was probed
  void failPeerP2P(int peer, const std::string& why);
  uint64_t chain_broadcast_bytes_ = 0;
  uint64_t ring_allreduce_bytes_ = 0;
  uint64_t reduce_piece_bytes_ = 0;
  bool had_failure_ = false;  // worker thread: an op of this group has failed

  mutable std::mutex mu_;
  bool stop_ = false;
  std::deque<std::unique_ptr<Collective>> queue_;   // submitted collectives
  std::deque<std::unique_ptr<SendOp>> new_sends_;
  std::deque<std::unique_ptr<P2PReceiver::Recv>> new_recvs_;
  uint64_t next_seq_ = 0;

  // Worker thread only.
  std::unique_ptr<Collective> current_;
  std::vector<std::deque<std::unique_ptr<SendOp>>> sends_;  // per peer
  std::unique_ptr<P2PReceiver> receiver_;                   // the recv side of send/recv
  std::vector<char> abort_pending_;                         // per peer: owe an ABORT
  std::vector<uint64_t> p2p_sent_;                          // per peer: sends started
  std::vector<std::string> lost_;                           // per peer: why it is gone
  uint64_t losses_seen_ = 0;
  bool any_lost_ = false;
  int spin_;
  std::chrono::microseconds gate_spin_{0};  // MOELINK_WORKER_GATE_SPIN_US
  std::thread thread_;
};

}  // namespace moelink::collective
