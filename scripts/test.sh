#!/usr/bin/env bash
# Runs every test: the C++ tests (GoogleTest through ctest, then again under ASan + UBSan,
# scripts/sanitize.sh, and the engine's, worker's and EP proxy carrier's under TSan,
# scripts/tsan.sh), the Python tests (pytest, multi-process groups over backend "ep"), the build
# without a CUDA compiler (scripts/cpu_only.sh: the module builds, imports, runs the quickstart
# and the EP buffer's CPU rounds), then the fuzzers (the tcp wire, and the messages peers write
# into a rank's memory) for a bounded time each (scripts/fuzz.sh). Installs and builds first. GPU
# tests skip cleanly without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
BUILD_DIR=${MOELINK_BUILD_DIR:-build}
echo "[moelink test] C++ tests"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j 2
if [ "${MOELINK_SKIP_SANITIZERS:-0}" != 1 ]; then
  echo "[moelink test] C++ tests under ASan + UBSan"
  bash scripts/sanitize.sh
  echo "[moelink test] the engine's, the worker's and the EP proxy carrier's C++ tests under TSan"
  bash scripts/tsan.sh
fi
echo "[moelink test] Python tests"
export PYTHONPATH="$(pwd)/integration${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -m pytest tests/python -q "$@"
if [ "${MOELINK_SKIP_CPU_ONLY:-0}" != 1 ]; then
  echo "[moelink test] the build without a CUDA compiler"
  bash scripts/cpu_only.sh
fi
if [ "${MOELINK_SKIP_FUZZ:-0}" != 1 ]; then
  echo "[moelink test] fuzzers, ${MOELINK_FUZZ_SECONDS:-60} s each"
  bash scripts/fuzz.sh "${MOELINK_FUZZ_SECONDS:-60}"
fi
