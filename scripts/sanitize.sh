#!/usr/bin/env bash
# The C++ tests under AddressSanitizer (with leak detection) and UndefinedBehaviorSanitizer, in
# a separate CPU-only build (build-asan/: no libtorch, no CUDA). Run by scripts/test.sh;
# MOELINK_SKIP_SANITIZERS=1 skips it there.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${MOELINK_ASAN_BUILD_DIR:-build-asan}
FLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
cmake -S . -B "$DIR" -G Ninja -DMOELINK_BUILD_PYTHON=OFF -DCMAKE_CUDA_COMPILER=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS="$FLAGS" -DCMAKE_EXE_LINKER_FLAGS="$FLAGS" >/dev/null
ninja -C "$DIR" | tail -n 1
ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
  "$DIR/tests/cpp/moelink_cpp_tests" --gtest_brief=1
