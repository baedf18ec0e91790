// MOELINK_* environment variables: the one parser of numeric settings. Each setting is still
// declared (named, defaulted, documented) beside its use.
#pragma once

#include <cstdint>
#include <cstdlib>

#include "moelink/common/error.h"

namespace moelink {

// The decimal value of `name`, or `dflt` when it is unset or empty; throws moelink::Error
// naming the variable when it is not a number.
inline uint64_t envNumber(const char* name, uint64_t dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  unsigned long long x = std::strtoull(v, &end, 10);
  MOELINK_CHECK(end && *end == '\0', name, " must be a number, got '", v, "'");
  return x;
}

}  // namespace moelink
