// Error reporting for every layer below the backend.
//
// Contract: a failed check throws moelink::Error whose message starts with
// "[file:line] " and names the failed expression or the reason. Code that runs
// inside an event loop (the tcp progress thread, the collective worker) keeps
// errors as values (a Status or a request's failure reason) and converts them
// to exceptions once, where control returns to the caller.
#pragma once

#include <cerrno>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>

namespace moelink {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A wait that ran past its deadline.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

namespace detail {
inline void appendAll(std::ostringstream&) {}
template <typename T, typename... Rest>
void appendAll(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  appendAll(os, rest...);
}
}  // namespace detail

template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  detail::appendAll(os, args...);
  return os.str();
}

template <typename E = Error, typename... Args>
[[noreturn]] void throwAt(const char* file, int line, const Args&... args) {
  const char* base = std::strrchr(file, '/');
  throw E(str("[", base ? base + 1 : file, ":", line, "] ", args...));
}

}  // namespace moelink

#define MOELINK_THROW(...) ::moelink::throwAt(__FILE__, __LINE__, __VA_ARGS__)
#define MOELINK_THROW_TIMEOUT(...) \
  ::moelink::throwAt<::moelink::TimeoutError>(__FILE__, __LINE__, __VA_ARGS__)

// MOELINK_CHECK(cond, "message parts", ...): throws with the expression and the message.
#define MOELINK_CHECK(cond, ...) \
  do {                           \
    if (!(cond)) {               \
      MOELINK_THROW("check failed: " #cond ": ", __VA_ARGS__); \
    }                            \
  } while (0)

// MOELINK_SYSCHECK(expr, "what"): expr returning < 0 throws with errno's text.
#define MOELINK_SYSCHECK(expr, ...)                                                 \
  do {                                                                              \
    if ((expr) < 0) {                                                               \
      int moelink_errno_ = errno;                                                   \
      MOELINK_THROW(__VA_ARGS__, ": ", #expr, " failed: ", std::strerror(moelink_errno_)); \
    }                                                                               \
  } while (0)
