#include "moelink/transfer/metadata_store.h"

#include <algorithm>
#include <thread>
#include <vector>

#include "moelink/common/error.h"

namespace moelink::transfer {

void InProcessStore::set(const std::string& key, const std::string& value) {
  {
    std::lock_guard<std::mutex> g(mu_);
    kv_[key] = value;
  }
  cv_.notify_all();
}

std::string InProcessStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  if (!cv_.wait_for(lk, timeout, [&] { return kv_.count(key) > 0; })) {
    MOELINK_THROW_TIMEOUT("store key '", key, "' not set within ", timeout.count(), " ms");
  }
  return kv_[key];
}

bool InProcessStore::check(const std::string& key) {
  std::lock_guard<std::mutex> g(mu_);
  return kv_.count(key) > 0;
}

int64_t InProcessStore::add(const std::string& key, int64_t delta) {
  int64_t v;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = kv_.find(key);
    v = (it == kv_.end() ? 0 : std::stoll(it->second)) + delta;
    kv_[key] = std::to_string(v);
  }
  cv_.notify_all();
  return v;
}

std::string InProcessStore::compareSet(const std::string& key, const std::string& expected,
                                      const std::string& desired) {
  std::string now;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = kv_.find(key);
    if (it == kv_.end()) {
      if (!expected.empty()) return expected;  // as c10d's stores answer for a missing key
      now = kv_[key] = desired;
    } else {
      if (it->second == expected) it->second = desired;
      now = it->second;
    }
  }
  cv_.notify_all();
  return now;
}

void storeBarrier(MetadataStore& store, const std::string& name, int count,
                  std::chrono::milliseconds timeout, const std::string& abort_key) {
  // Each participant adds one; the last one to arrive publishes the release key.
  if (store.add(name + "/arrived", 1) == count) store.set(name + "/released", "1");
  if (abort_key.empty()) {
    store.get(name + "/released", timeout);
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::microseconds(200);
  while (!store.check(name + "/released")) {
    if (store.check(abort_key)) MOELINK_THROW(store.get(abort_key, timeout));
    if (std::chrono::steady_clock::now() > deadline)
      MOELINK_THROW_TIMEOUT("timed out after ", timeout.count(), " ms at '", name, "': ",
                            store.add(name + "/arrived", 0), " of ", count, " ranks arrived");
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(20000));
  }
}

void storeLeaveHostLast(MetadataStore& store, const std::string& name, int rank, int count,
                        std::chrono::milliseconds timeout, const std::function<std::string(int)>& gone) {
  const std::string prefix = name + "/left/";
  if (rank != 0) {
    store.set(prefix + std::to_string(rank), "1");  // this rank's last use of the store in the set-up
    return;
  }
  std::vector<int> waiting;
  for (int r = 1; r < count; ++r) waiting.push_back(r);
  const auto start = std::chrono::steady_clock::now();
  auto next_probe = start + std::chrono::milliseconds(100);
  auto pause = std::chrono::microseconds(100);
  while (!waiting.empty()) {
    const bool probe = gone && std::chrono::steady_clock::now() >= next_probe;
    waiting.erase(std::remove_if(waiting.begin(), waiting.end(),
                                 [&](int r) {
                                   return store.check(prefix + std::to_string(r)) || (probe && !gone(r).empty());
                                 }),
                  waiting.end());
    if (waiting.empty() || std::chrono::steady_clock::now() - start > timeout) return;
    if (probe) next_probe = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(2000));
  }
}

bool storeAllAgree(MetadataStore& store, const std::string& name, int count, bool yes,
                   std::chrono::milliseconds timeout, const std::function<bool()>& cancelled) {
  // A no is counted before its answer: whoever sees every answer sees every no.
  if (!yes) store.add(name + "/no", 1);
  int64_t answered = store.add(name + "/answered", 1);
  if (!yes) return false;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::microseconds(200);
  while (answered < count) {
    if ((cancelled && cancelled()) || std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(20000));
    answered = store.add(name + "/answered", 0);
  }
  return store.add(name + "/no", 0) == 0;
}

}  // namespace moelink::transfer
