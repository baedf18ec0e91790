#!/usr/bin/env bash
# The build on a machine without a CUDA compiler: the Python module must build, import and run
# the CPU collectives and the EP buffer's CPU path without the CUDA unit and the EP kernels. A
# separate build (build-cpu/, CUDA off, no C++ tests) places its module in a copy of the package,
# the quickstart and the Python tests under build-cpu/tree/ (the tests find the package beside
# them), so the main build's module stays where it is; then the quickstart runs 2 ranks on it, and
# the EP buffer's CPU rounds. Run by scripts/test.sh (after install.sh); MOELINK_SKIP_CPU_ONLY=1
# skips it there.
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONPATH  # (scripts/test.sh sets it to the main build's package; this build has its own)
PY=${PYTHON:-python3}
DIR=${MOELINK_CPU_BUILD_DIR:-build-cpu}
TREE="$(pwd)/$DIR/tree"
rm -rf "$TREE" && mkdir -p "$TREE/integration" "$TREE/examples" "$TREE/tests"
cp -r integration/moelink "$TREE/integration/"
rm -f "$TREE"/integration/moelink/*.so "$TREE/integration/moelink/_build_info.py"
cp examples/quickstart.py "$TREE/examples/"
cp -r tests/python "$TREE/tests/"
cmake -S . -B "$DIR" -G Ninja -DCMAKE_CUDA_COMPILER=OFF -DMOELINK_BUILD_TESTS=OFF \
  -DPython3_EXECUTABLE="$(command -v "$PY")" -DMOELINK_MODULE_DIR="$TREE/integration/moelink" >/dev/null
ninja -C "$DIR" moelink_python | tail -n 1
# (the build places them there itself only when it links the module anew)
cp "$DIR"/_C*.so "$DIR/_build_info.py" "$TREE/integration/moelink/"
# The quickstart puts its own ../integration first on the path: this copy's package.
"$PY" -c "
import sys; sys.path.insert(0, '$TREE/integration')
import moelink
assert moelink.__file__.startswith('$TREE'), moelink.__file__
assert not getattr(moelink._C, 'HAS_CUDA', False)
print('cpu-only module:', moelink._C.__file__)
"
"$PY" -m torch.distributed.run --nproc-per-node 2 "$TREE/examples/quickstart.py"
"$PY" -m pytest -q -p no:cacheprovider "$TREE/tests/python/test_mooncake_compat.py" -k rounds_cpu
