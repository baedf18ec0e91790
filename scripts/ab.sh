#!/usr/bin/env bash
# A/B of kernel variants in one device call: `bash scripts/ab.sh v1 v2 ...` builds the tree
# as it is ("cur") and, for each name v, a copy with scripts/v.patch applied (in /tmp/v_v),
# then runs examples/bench/ep.py for each in turn, twice (ROUNDS), on GPUS GPUs with EXPERTS
# experts. Performance claims come from such side-by-side runs on one machine (docs/PERF.md).
set -u
ROOT=$PWD
OUTB=${OUT:-$PWD/gpu-out}
bash scripts/gpu-run.sh >/dev/null 2>&1   # build the current tree
for v in "$@"; do
  [ -d /tmp/v_$v/build-dev ] && continue
  rm -rf /tmp/v_$v; mkdir -p /tmp/v_$v
  git ls-files -z | xargs -0 -I{} cp --parents {} /tmp/v_$v/ 2>/dev/null
  cp -r .devdeps scripts /tmp/v_$v/
  (cd /tmp/v_$v && git init -q 2>/dev/null; git apply scripts/$v.patch && OUT=$OUTB/$v bash scripts/gpu-run.sh >/dev/null 2>&1) || echo "variant $v failed to build"
done
for round in ${ROUNDS:-1 2}; do
  for v in cur "$@"; do
    d=$ROOT; [ $v != cur ] && d=/tmp/v_$v
    echo "=== $v round $round"
    (cd $d && export PYTHONPATH=$d/integration NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 && source .devdeps/unpack.sh >/dev/null 2>&1; timeout 120 python3 examples/bench/ep.py --gpus ${GPUS:-4} --experts ${EXPERTS:-256} --iters 200 --out /tmp/ab.png 2>&1 | sed -n '3,4p;7,8p')
  done
done
