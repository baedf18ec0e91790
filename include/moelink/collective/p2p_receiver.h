// P2PReceiver: the receiving half of point-to-point over one mailbox (worker.h has the
// matching rules): the recvs posted and not yet matched, the send each source is delivering
// into a matched recv, and the stash of sends that arrived before any recv matched them.
//
// Every message is checked against the send it belongs to (message_check.h: checkSendPiece)
// before a byte of it is copied: a peer cannot make this rank write past a recv's buffer, nor
// grow a stash beyond the size its send announced. A message that fails the check fails the
// recv it was for (or, arriving for no recv, the recvs waiting on that source alone), and the
// rest of that send is skipped. Worker-thread only; it owns no thread.
#pragma once

#include <chrono>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "moelink/collective/mailbox.h"
#include "moelink/collective/message_check.h"

namespace moelink::collective {

using RecvCallback = std::function<void(const std::string& error, int source)>;

class P2PReceiver {
 public:
  struct Recv {
    int peer = -1;  // < 0: any source
    char* data = nullptr;
    uint64_t bytes = 0;
    int tag = 0;
    RecvCallback done;
    std::chrono::steady_clock::time_point deadline;
  };

  P2PReceiver(Mailbox& box, int rank, int world);

  void post(std::unique_ptr<Recv> r) { posted_.push_back(std::move(r)); }
  // Matches and receives what has arrived; fails the recvs past their deadline and those on
  // ranks that are not `live`. True when something moved.
  bool progress(const std::vector<char>& live);
  // Whether anything is pending (posted, being received, stashed or skipped).
  bool busy() const;
  // Fails the recvs on `peer` and forgets what it was delivering (it left the group).
  void failPeer(int peer, const std::string& why);
  // A new process has taken `peer`'s rank: nothing of the old one is being received.
  void resetPeer(int peer);
  // Fails every recv (shutdown).
  void failAll(const std::string& why);

 private:
  struct Stashed {
    int peer = -1;
    int tag = 0;
    IncomingSend in;
    std::vector<char> data;
    bool complete = false;
  };
  struct Source {
    std::unique_ptr<Recv> bound;  // the recv this source's current send goes into
    Stashed* stashing = nullptr;  // or the stash entry it goes into
    IncomingSend in;              // that send, as far as it came
    bool discarding = false;      // skipping the rest of a send, up to its LAST
  };

  bool matchStash();
  bool receive(int p);
  bool startSend(int p, const MsgHeader& h);
  bool continueStash(int p);
  bool continueRecv(int p);
  // The head message of `p` broke the protocol (`why`): fails `r` (or the recvs that wait on
  // `p` alone when there is none), drops `p`'s stash entry in progress, skips the rest.
  void reject(int p, std::unique_ptr<Recv> r, const std::string& why);
  // Releases the head message of `p`, skipping the rest of its send unless it is the last.
  void skipSend(int p);
  void expire();
  std::string prefix(int peer, int tag) const;

  Mailbox& box_;
  int rank_, world_;
  std::list<std::unique_ptr<Recv>> posted_;  // unmatched, in post order
  std::list<Stashed> stash_;                 // unmatched sends, in arrival order
  std::vector<Source> src_;                  // per source rank
};

}  // namespace moelink::collective
