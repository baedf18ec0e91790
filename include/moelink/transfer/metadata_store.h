// MetadataStore: the small key-value rendezvous that the transfer engine uses to
// exchange opaque endpoint and segment descriptors. Transports never run their own
// rendezvous; they publish bytes here and read their peers' bytes back.
//
// Contract: set() publishes a value (overwriting); get() blocks until the key exists
// or the timeout expires (then throws TimeoutError); add() atomically adds to an
// integer counter stored under the key and returns the new value; compareSet() replaces
// the value atomically when it is `expected` ("" : the key does not exist) and returns the
// value the key holds afterwards (c10d's semantics). The backend adapts c10d::Store; tests
// use InProcessStore (ranks as threads of one process).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace moelink::transfer {

class MetadataStore {
 public:
  virtual ~MetadataStore() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  virtual std::string get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Whether the key exists (does not wait).
  virtual bool check(const std::string& key) = 0;
  virtual std::string compareSet(const std::string& key, const std::string& expected, const std::string& desired) = 0;
};

// Shared by threads of one process.
class InProcessStore : public MetadataStore {
 public:
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::string& key) override;
  std::string compareSet(const std::string& key, const std::string& expected, const std::string& desired) override;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> kv_;
};

// Prepends a prefix to every key, so that several engines (groups) share one store.
class PrefixStore : public MetadataStore {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<MetadataStore> base)
      : prefix_(std::move(prefix)), base_(std::move(base)) {}
  void set(const std::string& key, const std::string& value) override {
    base_->set(prefix_ + key, value);
  }
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override {
    return base_->get(prefix_ + key, timeout);
  }
  int64_t add(const std::string& key, int64_t delta) override {
    return base_->add(prefix_ + key, delta);
  }
  bool check(const std::string& key) override { return base_->check(prefix_ + key); }
  std::string compareSet(const std::string& key, const std::string& expected, const std::string& desired) override {
    return base_->compareSet(prefix_ + key, expected, desired);
  }

 private:
  std::string prefix_;
  std::shared_ptr<MetadataStore> base_;
};

// Waits until `count` participants have arrived at barrier `name` (one add each). Fails at
// once, with its text, when `abort_key` is set meanwhile (a participant that cannot come says
// why there), and after `timeout` naming how many arrived.
void storeBarrier(MetadataStore& store, const std::string& name, int count,
                  std::chrono::milliseconds timeout, const std::string& abort_key = "");

// The last store step of a set-up among ranks 0..count-1 (after its last barrier): every rank
// but 0 records that it is done with the store, and rank 0 returns only once each of them has,
// or has been found gone (`gone(r)`: why rank r's process is gone, "" while it lives; asked
// after a short wait), or `timeout` passed. Under torch's tcp:// and env:// rendezvous rank 0's
// process serves the store: a rank 0 that made its group and exited at once would otherwise
// take the store down under a rank still polling the barrier's release.
void storeLeaveHostLast(MetadataStore& store, const std::string& name, int rank, int count,
                        std::chrono::milliseconds timeout, const std::function<std::string(int)>& gone);

// Whether all `count` participants of vote `name` say yes (each calls it once, with its own
// answer). One that says no returns false at once (it needs nobody's answer, so it waits for
// nobody: e.g. not for ranks that have not joined yet); one that says yes waits until every
// participant has answered and returns whether all said yes, or false when `cancelled()` turns
// true or `timeout` passes first. Two adds per participant, then one key polled with a backoff
// (no participant reads the others' keys one by one: cheap for large groups).
bool storeAllAgree(MetadataStore& store, const std::string& name, int count, bool yes,
                   std::chrono::milliseconds timeout, const std::function<bool()>& cancelled = nullptr);

}  // namespace moelink::transfer
