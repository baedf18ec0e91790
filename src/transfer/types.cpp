#include "moelink/transfer/types.h"

#include <sstream>
#include <thread>

#include "moelink/common/error.h"

namespace moelink::transfer {

std::string SegmentDesc::serialize() const {
  return str(rank, " ", id, " ", length, " ", shm_name.empty() ? "-" : shm_name);
}

SegmentDesc SegmentDesc::parse(const std::string& bytes) {
  SegmentDesc d;
  std::istringstream is(bytes);
  is >> d.rank >> d.id >> d.length >> d.shm_name;
  MOELINK_CHECK(!is.fail(), "malformed segment descriptor '", bytes, "'");
  if (d.shm_name == "-") d.shm_name.clear();
  return d;
}

TransferBatch::TransferBatch(size_t n) : states_(n), remaining_(n), reasons_(n) {
  for (auto& s : states_) s.store(static_cast<int>(RequestState::kPending));
}

void TransferBatch::finishOne() { remaining_.fetch_sub(1, std::memory_order_acq_rel); }

void TransferBatch::complete(size_t i) {
  states_[i].store(static_cast<int>(RequestState::kCompleted), std::memory_order_release);
  finishOne();
}

void TransferBatch::fail(size_t i, const std::string& reason) {
  {
    std::lock_guard<std::mutex> g(mu_);
    reasons_[i] = reason;
  }
  failed_.store(true, std::memory_order_release);
  states_[i].store(static_cast<int>(RequestState::kFailed), std::memory_order_release);
  finishOne();
}

std::string TransferBatch::reason(size_t i) const {
  std::lock_guard<std::mutex> g(mu_);
  return reasons_[i];
}

std::string TransferBatch::error() const {
  if (!failed()) return {};
  std::lock_guard<std::mutex> g(mu_);
  for (const auto& r : reasons_)
    if (!r.empty()) return r;
  return "transfer failed";
}

bool TransferBatch::wait(std::chrono::milliseconds timeout) const {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  int spins = 0;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    if (++spins < 1000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  return true;
}

}  // namespace moelink::transfer
