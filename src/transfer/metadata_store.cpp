#include "moelink/transfer/metadata_store.h"

#include <thread>

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

void storeBarrier(MetadataStore& store, const std::string& name, int count,
                  std::chrono::milliseconds timeout) {
  // Each participant adds one; the last one to arrive publishes the release key.
  if (store.add(name + "/arrived", 1) == count) store.set(name + "/released", "1");
  store.get(name + "/released", timeout);
}

}  // namespace moelink::transfer
