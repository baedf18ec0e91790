#!/usr/bin/env bash
# The transfer engine's, the collective worker's and the EP proxy carrier's C++ tests under
# ThreadSanitizer, in a separate CPU-only build (build-tsan/: no libtorch, no CUDA). Run by scripts/test.sh;
# MOELINK_SKIP_SANITIZERS=1 skips it there. Suppressions, each with its reason: scripts/tsan.supp.
# (TcpWire.* is left out: its harness orders its reads of a segment after the transport's
# through the tcp connection's close, which ThreadSanitizer cannot see.)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${MOELINK_TSAN_BUILD_DIR:-build-tsan}
FLAGS="-fsanitize=thread -fno-omit-frame-pointer"
cmake -S . -B "$DIR" -G Ninja -DMOELINK_BUILD_PYTHON=OFF -DCMAKE_CUDA_COMPILER=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS="$FLAGS" -DCMAKE_EXE_LINKER_FLAGS="$FLAGS" >/dev/null
ninja -C "$DIR" moelink_cpp_tests | tail -n 1
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$(pwd)/scripts/tsan.supp" \
  "$DIR/tests/cpp/moelink_cpp_tests" --gtest_brief=1 \
  --gtest_filter='MailboxLandings*:TransferEngine*:TcpTransport*:TcpStriping*:*/StripedWrites*:ShmTransport*:Collective*:All/CollectiveTest*:*/TransferEngineTest*:HostPieces*:All/HostPieces*:ProxyCarrier.*'
