#!/usr/bin/env bash
# The main job: a 4-process demo of the standard collectives over backend "ep" (CPU
# tensors), each result checked against a local reference. NPROC=N changes the size.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
export PYTHONPATH="$(pwd)/integration${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m torch.distributed.run --nproc-per-node "${NPROC:-4}" examples/quickstart.py
