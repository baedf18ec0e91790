#!/usr/bin/env bash
# The tcp wire fuzzer (tests/fuzz/tcp_wire_fuzz.cpp: arbitrary bytes on a live tcp transport's
# port) for a bounded time, built with clang, libFuzzer, ASan and UBSan in its own CPU-only build
# (build-fuzz/). Usage: scripts/fuzz.sh [seconds] (default 60; scripts/test.sh runs it, and
# MOELINK_SKIP_FUZZ=1 skips it there). Starts from tests/fuzz/corpus; an input that crashes the
# target is written to tests/fuzz/regressions/ and the script fails: commit that file, and
# TcpWire.ReplaysCorpusAndRegressions (a gtest of every build) replays it from then on.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-60}
DIR=${MOELINK_FUZZ_BUILD_DIR:-build-fuzz}
command -v clang++ >/dev/null || { echo "[moelink fuzz] clang++ not found (scripts/install.sh installs it)"; exit 1; }
FLAGS="-fsanitize=fuzzer-no-link,address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
cmake -S . -B "$DIR" -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DMOELINK_BUILD_PYTHON=OFF \
  -DMOELINK_BUILD_TESTS=OFF -DMOELINK_FUZZ=ON -DCMAKE_CUDA_COMPILER=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS="$FLAGS" >/dev/null
ninja -C "$DIR" moelink_tcp_wire_fuzz | tail -n 1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp tests/fuzz/corpus/* "$work"/
mkdir -p tests/fuzz/regressions
# One transport serves the whole run; glog's per-connection warnings would drown the output.
GLOG_minloglevel=2 ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
  "$DIR/moelink_tcp_wire_fuzz" -max_total_time="$SECS" -max_len=2048 -timeout=10 \
  -artifact_prefix=tests/fuzz/regressions/ -print_final_stats=1 "$work" > "$work/log" 2>&1 || {
  grep -E "tcp wire harness|ERROR|runtime error|SUMMARY" "$work/log" | head -5; tail -25 "$work/log"
  echo "[moelink fuzz] the target crashed: its input is in tests/fuzz/regressions/"
  exit 1
}
grep -E "^stat::number_of_executed_units|^Done" "$work/log" | tr '\n' ' '; echo
