#!/usr/bin/env bash
# Installs everything moelink needs on a fresh Debian 12 machine, then builds it.
# Idempotent: skips what is present. Used by scripts/demo.sh, scripts/test.sh and CI.
#
#   PYTHON=python3      the interpreter to install into and build against
#   MOELINK_TORCH=2.14.1  the torch release pip installs when no torch is importable
#   MOELINK_BUILD_DIR=build
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${MOELINK_TORCH:-2.14.1}
BUILD_DIR=${MOELINK_BUILD_DIR:-build}

say() { echo "[moelink install] $*"; }

# --- system packages (apt) ---
APT_PKGS=(cmake ninja-build g++ libgtest-dev libgmock-dev libgoogle-glog-dev libgflags-dev
          libibverbs-dev librdmacm-dev)
missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    say "apt-get install ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    say "missing system packages (${missing[*]}) and no apt-get: install them or their equivalents"
  fi
fi

# clang with libFuzzer, for scripts/fuzz.sh (Debian 12's names; elsewhere the fuzz step says
# what is missing).
FUZZ_PKGS=(clang libclang-rt-14-dev)
missing=()
for p in "${FUZZ_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ] && command -v apt-get >/dev/null; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  say "apt-get install ${missing[*]}"
  $SUDO apt-get update -qq || true
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ||
    say "could not install ${missing[*]}: scripts/fuzz.sh will not run here"
fi

# --- Python packages (pip) ---
if ! "$PY" -c "import torch" 2>/dev/null; then
  say "pip install torch==$TORCH_VERSION"
  "$PY" -m pip install -q "torch==$TORCH_VERSION"
fi
"$PY" -c "import pytest, numpy, matplotlib, wheel" 2>/dev/null || {
  say "pip install -r requirements-dev.txt"
  "$PY" -m pip install -q -r requirements-dev.txt
}
say "torch $("$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)')"

# --- build (C++ libraries, tests and the Python module) ---
cmake -S . -B "$BUILD_DIR" -G Ninja -DPython3_EXECUTABLE="$(command -v "$PY")" >/dev/null
ninja -C "$BUILD_DIR" | tail -n 1
say "built; the package is importable with PYTHONPATH=$(pwd)/integration"
