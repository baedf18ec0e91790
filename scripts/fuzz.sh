#!/usr/bin/env bash
# The fuzzers, each for a bounded time, built with clang, libFuzzer, ASan and UBSan in their own
# CPU-only build (build-fuzz/):
#   tcp_wire  arbitrary bytes on a live tcp transport's port (tests/fuzz/tcp_wire_harness.h);
#             corpus tests/fuzz/corpus, crashes into tests/fuzz/regressions
#   message   arbitrary messages in a rank's mailboxes (point-to-point and collective), its
#             membership board and the tcp handshake check (tests/fuzz/message_harness.h);
#             corpus tests/fuzz/message_corpus, crashes into tests/fuzz/message_regressions
# Usage: scripts/fuzz.sh [seconds per fuzzer] [fuzzer...] (default 60, both; scripts/test.sh runs
# it, and MOELINK_SKIP_FUZZ=1 skips it there). An input that crashes a target is written to its
# regressions folder and the script fails: commit that file, and the replay tests of every build
# (TcpWire.ReplaysCorpusAndRegressions, MessageFuzz.ReplaysCorpusAndRegressions) replay it.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-60}
shift || true
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(tcp_wire message)
DIR=${MOELINK_FUZZ_BUILD_DIR:-build-fuzz}
command -v clang++ >/dev/null || { echo "[moelink fuzz] clang++ not found (scripts/install.sh installs it)"; exit 1; }
FLAGS="-fsanitize=fuzzer-no-link,address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
cmake -S . -B "$DIR" -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DMOELINK_BUILD_PYTHON=OFF \
  -DMOELINK_BUILD_TESTS=OFF -DMOELINK_FUZZ=ON -DCMAKE_CUDA_COMPILER=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS="$FLAGS" >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for target in "${TARGETS[@]}"; do
  case $target in
    tcp_wire) corpus=tests/fuzz/corpus; crashes=tests/fuzz/regressions; max_len=2048 ;;
    message) corpus=tests/fuzz/message_corpus; crashes=tests/fuzz/message_regressions; max_len=4096 ;;
    *) echo "[moelink fuzz] unknown fuzzer '$target' (tcp_wire, message)"; exit 2 ;;
  esac
  ninja -C "$DIR" "moelink_${target}_fuzz" | tail -n 1
  mkdir -p "$work/$target" "$crashes"
  cp "$corpus"/* "$work/$target"/
  # glog's per-connection and per-message warnings would drown the output.
  GLOG_minloglevel=2 ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
    "$DIR/moelink_${target}_fuzz" -max_total_time="$SECS" -max_len=$max_len -timeout=10 \
    -artifact_prefix="$crashes/" -print_final_stats=1 "$work/$target" > "$work/$target.log" 2>&1 || {
    grep -E "harness|ERROR|runtime error|SUMMARY" "$work/$target.log" | head -5; tail -25 "$work/$target.log"
    echo "[moelink fuzz] $target: the target crashed: its input is in $crashes/"
    exit 1
  }
  echo -n "[moelink fuzz] $target: "
  grep -E "^stat::number_of_executed_units|^Done" "$work/$target.log" | tr '\n' ' '; echo
done
