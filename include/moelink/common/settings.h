// Every MOELINK_* environment variable of the library, declared once (settings.cpp): its name,
// kind, default, allowed values and meaning, for the unit that reads it ("collectives", "cuda",
// "ep"). Reading one goes through this table, which parses the value and raises moelink::Error
// naming the variable, the value and what is allowed when it does not fit. The README's
// variable tables are generated from it (`python3 -m moelink.settings`; a test fails when they
// differ), and an unknown MOELINK_* variable in the environment (a typo, a retired name) is
// reported once per process.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moelink::settings {

enum class Kind { kNumber, kFlag, kChoice, kText };

struct Setting {
  const char* name;
  Kind kind;
  const char* area;          // the README table it belongs to: "collectives" or "ep"
  uint64_t number = 0;       // kNumber, kFlag: the default (when default_text is empty)
  uint64_t min = 0, max = UINT64_MAX;  // kNumber: the allowed range
  const char* choices = "";  // kChoice: "a|b|c", the first the default
  const char* default_text = "";  // the default as the README states it ("" : the value above)
  const char* doc = "";
};

const std::vector<Setting>& all();
// The declared setting of that name (its default and range); throws for an undeclared name.
const Setting& find(const char* name);

// The value of a number or flag setting (its default when unset or empty).
uint64_t number(const char* name);
// The same, or nullopt when the variable is unset (settings whose default depends on the group).
std::optional<uint64_t> numberIfSet(const char* name);
bool flag(const char* name);
// A choice (its first choice when unset) or a text ("" when unset).
std::string text(const char* name);

// The cores this process may run on (its CPU affinity; at least 1): what the defaults that
// depend on the host (worker spinning, tcp streams, EP proxy threads) are chosen from.
int usableCores();

// Logs, once per process, the MOELINK_* variables of the environment that no setting declares.
void warnUnknown();

}  // namespace moelink::settings
