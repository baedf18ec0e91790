#!/usr/bin/env bash
# Puts Mooncake's own EP test (mooncake-wheel/tests/test_mooncake_ep.py and its ep_test_utils.py) into
# the ignored .devdeps/anchors/mooncake-tests/, for `bash scripts/gpu-run.sh mooncakeown`, which runs it
# on moelink with only its imports and backend name changed. Mooncake's files, read from a clone of
# github:kvcache-ai/Mooncake; never part of this repository.
#
#   bash scripts/mooncake-tests.sh /path/to/Mooncake(.git)
set -euo pipefail
src=${1:?usage: bash scripts/mooncake-tests.sh MOONCAKE_GIT_DIR}
cd "$(dirname "$0")/.."
excl=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$excl")"
grep -qx '/.devdeps/' "$excl" 2>/dev/null || echo '/.devdeps/' >> "$excl"
out=.devdeps/anchors/mooncake-tests
mkdir -p "$out"
for f in test_mooncake_ep.py ep_test_utils.py; do
  git --git-dir "$src" show "HEAD:mooncake-wheel/tests/$f" > "$out/$f" 2>/dev/null ||
    git -C "$src" show "HEAD:mooncake-wheel/tests/$f" > "$out/$f"
done
git --git-dir "$src" rev-parse HEAD > "$out/COMMIT" 2>/dev/null || git -C "$src" rev-parse HEAD > "$out/COMMIT"
ls -la "$out"
