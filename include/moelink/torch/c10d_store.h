// The transfer engine's MetadataStore over a c10d::Store (the group's prefixed store), for the
// torch-facing units that run an engine (the backend, the EP buffer's CPU proxy).
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "moelink/transfer/metadata_store.h"

namespace moelink {

class C10dStore : public transfer::MetadataStore {
 public:
  explicit C10dStore(c10::intrusive_ptr<c10d::Store> s) : s_(std::move(s)) {}
  void set(const std::string& key, const std::string& value) override {
    s_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override {
    s_->wait({key}, timeout);
    auto v = s_->get(key);
    return std::string(v.begin(), v.end());
  }
  int64_t add(const std::string& key, int64_t delta) override { return s_->add(key, delta); }
  bool check(const std::string& key) override { return s_->check({key}); }
  std::string compareSet(const std::string& key, const std::string& expected, const std::string& desired) override {
    auto v = s_->compareSet(key, std::vector<uint8_t>(expected.begin(), expected.end()),
                            std::vector<uint8_t>(desired.begin(), desired.end()));
    return std::string(v.begin(), v.end());
  }

 private:
  c10::intrusive_ptr<c10d::Store> s_;
};

}  // namespace moelink
