#!/usr/bin/env bash
# The GPU machine's batch: builds into build-dev, then runs the named stages in order, each under
# its own timeout with its whole output in $OUT/<stage>.log (OUT defaults to ./gpu-out; plots go
# there too), and prints what each printed last. Ends with "N stages passed, M failed (...)" and
# exits non-zero when a stage failed (its exit status is in the summary; 124: timed out). An
# unknown stage name is an error before anything is built.
#
#   bash scripts/gpu-run.sh cudatest normal      # stages from the table below
#   bash scripts/gpu-run.sh all4                 # every 4-GPU test and benchmark
#   bash scripts/gpu-run.sh list                 # the table
#
# Env: GPUS (ranks of cudabench/cudasmall/benchnormal, default 2), ITERS (benchmark iterations),
# STREAMS (the MOELINK_TCP_STREAMS values cpubench and cudabenchhost sweep, default "1 default"),
# MINB / MAXB (their smallest and largest sizes, default 4 MiB and 256 MiB),
# TRACE=1 (phase breakdown in bench2 and bench4), NK / CK (pytest -k filters for the normal / cudatest stages), EPT (EP
# timeout in us for the EP tests), STAGE_TIMEOUT (seconds, overrides every stage's own).
# MPS=1 runs the stages under an MPS daemon of the run's own (stopped at the end), so that ranks
# sharing a GPU run their kernels side by side: with GPUS above the GPUs, cudabenchhost times ep
# and NCCL-socket as processes on one GPU (each rank a virtual host of its own).
# MOELINK_TEST_SHARE_GPU=1 runs the multi-GPU tests as processes sharing one GPU (=4: the 4-rank
# CUDA collective cases too, as 4 processes); MOELINK_TEST_CASES=a,b limits the CUDA collective
# cases to those named.
# On the lent GPU machine (no apt), `.devdeps/unpack.sh` (from ../shared/tools/device-deps.sh)
# provides glog, gflags, GTest and rdma-core headers; elsewhere scripts/install.sh does.
set -euo pipefail
cd "$(dirname "$0")/.."

# name | timeout (s) | what it runs
STAGES="
gtest         | 150 | the IBGDA C++ tests (WQE encoders on GPU threads, the emulated NIC)
gtestall      | 300 | every C++ test
ctest         | 600 | every C++ test through ctest
test          | 500 | EP buffer low-latency tests (tests/python/test_ep_buffer.py, IBGDA cases excluded)
ibgda         | 300 | EP buffer over the emulated IBGDA NIC
proxy         | 300 | EP buffer over the CPU proxy (virtual hosts)
normal        | 500 | EP normal mode on the GPU (tests/python/test_ep_normal_gpu.py)
cudatest      | 400 | CUDA collectives (tests/python/test_cuda_collectives.py), both routes
benchcheck    | 300 | the collectives benchmark's value checks, eager and replayed in a CUDA graph, in-host and host route (test_bench_collectives.py)
elastic       | 500 | elastic membership (tests/python/test_elastic.py)
elasticgpu    | 400 | elastic membership, the GPU cases
exitgpu       | 300 | early exit with CUDA ops in flight keeps the script's status (test_exit_status.py)
all           | 900 | every Python test
quick         | 150 | the quickstart under torchrun, 4 ranks
bench1        | 200 | EP low-latency benchmark on one GPU (EP1: every expert local, no peer), with the phase trace and the launch floor
bench2        | 300 | EP low-latency benchmark, 2 GPUs, beside DeepEP v1 (when .devdeps/deepep is there)
bench4        | 300 | EP low-latency benchmark, 4 GPUs, beside DeepEP v1 (when .devdeps/deepep is there)
benchnotma    | 200 | EP low-latency benchmark, 4 GPUs, warp stores instead of TMA
benchp        | 200 | EP low-latency benchmark, 4 GPUs as 2 virtual hosts (CPU proxy)
benchptcp     | 400 | EP low-latency benchmark, GPUS GPUs (default 4) as 2 virtual hosts whose CPU proxies talk loopback tcp (as between hosts), the rows spread over the tcp streams and in order on one (MOELINK_EP_PROXY_SPREAD 1 and 0)
benchi        | 200 | EP low-latency benchmark, 4 GPUs as 2 virtual hosts (emulated IBGDA)
benchnormal   | 400 | EP normal-mode benchmark beside DeepEP v1 (when .devdeps/deepep is there)
benchtwohop   | 400 | EP normal-mode benchmark, 4 GPUs as 2 virtual hosts of 2 (two-hop route, tcp between them) beside the all_to_all_single pipeline over NCCL-socket
cudabench     | 400 | CUDA collectives 8 KiB-1 GiB beside NCCL, GPUS ranks
cudasmall     | 400 | CUDA collectives 8-256 KiB: latency, issue time, graph replay beside NCCL, GPUS ranks
cudamid       | 400 | CUDA collectives 256 KiB-32 MiB: latency and graph replay beside NCCL, GPUS ranks
cudalarge     | 400 | CUDA collectives 64 MiB-1 GiB: bus bandwidth beside NCCL, GPUS ranks, median of ITERS (5), OPS (every op)
cudasweep     | 600 | the Lamport threshold's sweep: 8-256 KiB graph replay beside NCCL at MOELINK_CUDA_LAMPORT_BYTES 0 and 262144, GPUS ranks
cudatwoshot   | 300 | the two-shot Lamport all_reduce's threshold: 512 KiB, 2 and 8 MiB (or SWEEP_ARGS) all_reduce graph replay beside NCCL at MOELINK_CUDA_LAMPORT_TWO_SHOT_BYTES 0 and 4194304, GPUS ranks
cudaoneshot   | 400 | all_reduce's one exchange against the two-shot staged one: 1-32 MiB graph replay and 64 MiB-1 GiB bus bandwidth beside NCCL at MOELINK_CUDA_ONESHOT_BYTES 1099511627776 (one exchange) and 0 (two-shot above the Lamport sizes), GPUS ranks
cudabcast     | 300 | broadcast's plan: 256 KiB-4 MiB (or SWEEP_ARGS) graph replay beside NCCL at MOELINK_CUDA_ONESHOT_BYTES 262144 (forwarded above it) and 4194304 (one exchange up to it), GPUS ranks
cudapdl       | 400 | the Lamport kernel's launch: 8-256 KiB graph replay beside NCCL at MOELINK_CUDA_PDL 0 and 1, GPUS ranks
cudabenchhost | 500 | CUDA collectives over the host route (virtual hosts of 1, tcp between them) beside NCCL on its socket transport, 4 MiB-256 MiB, GPUS ranks, MOELINK_TCP_STREAMS 1 and the default
cudabench2lvl | 500 | CUDA collectives over the two-level route (GPUS ranks, default 4, as virtual hosts of 2: NVLink inside, tcp between) beside NCCL with the same hosts (NCCL_HOSTID; NVLink inside, sockets between), 4 MiB-256 MiB, with MOELINK_HOST_TWO_LEVEL 1 and 0
nvlinkbench   | 200 | the NVLink all-to-all ceiling by way of copying and SMs (examples/bench/nvlink.py), GPUS GPUs
tcpbench      | 300 | the tcp transport's own loopback bandwidth by number of streams (examples/bench/tcp_transport.py), then of EP rows (7392 and 14336 bytes) in order and unordered, with a signal after the batch and after every 256 KiB
proxybench    | 200 | the EP proxy's carrier over loopback tcp (examples/bench/proxy_carrier.py): bursts of 7392- and 14336-byte rows posted one by one, beside one batch of the same rows
cpubench      | 500 | CPU collectives over tcp beside gloo, 4 ranks, 4 MiB-256 MiB, MOELINK_TCP_STREAMS 1 and the default
mooncake      | 400 | Mooncake's API on moelink (moelink.compat.mooncake): its GPU tests, the migration example
mooncakeown   | 400 | Mooncake's own EP test (its wheel's tests, .devdeps/anchors/mooncake-tests) on moelink, imports changed
benchmooncake | 400 | EP low-latency benchmark beside Mooncake's EP buffer (its wheel in .devdeps/anchors), GPUS ranks
"
# all4: every 4-GPU test and benchmark in one call.
ALL4="gtestall test ibgda proxy normal cudatest benchcheck elastic exitgpu quick mooncake bench4 benchp benchi benchnormal cudabench cudasmall"

declare -A TIMEOUT WHAT
ORDER=()
trim() { local v="$1"; v="${v#"${v%%[![:space:]]*}"}"; echo "${v%"${v##*[![:space:]]}"}"; }
while IFS='|' read -r name secs what; do
  name=$(trim "$name")
  [ -n "$name" ] || continue
  TIMEOUT[$name]=$(trim "$secs")
  WHAT[$name]=$(trim "$what")
  ORDER+=("$name")
done <<< "$STAGES"

if [ $# -eq 0 ] || [ "$1" = list ]; then
  for n in "${ORDER[@]}"; do printf "%-14s %4ss  %s\n" "$n" "${TIMEOUT[$n]}" "${WHAT[$n]}"; done
  echo "all4           (every 4-GPU test and benchmark: $ALL4)"
  exit 0
fi
REQUESTED=()
for s in "$@"; do
  if [ "$s" = all4 ]; then
    REQUESTED+=($ALL4)
  elif [ -n "${TIMEOUT[$s]+x}" ]; then
    REQUESTED+=("$s")
  else
    echo "gpu-run: unknown stage '$s' (bash scripts/gpu-run.sh list)" >&2
    exit 2
  fi
done

[ -f .devdeps/unpack.sh ] && source .devdeps/unpack.sh
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/integration${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import pytest" 2>/dev/null || pip install -q --no-index .devdeps/wheels/*.whl > /dev/null 2>&1 || true
T0=$(date +%s)
say() { echo "=== [$(($(date +%s) - T0))s] $*"; }

# One function per stage: it runs in the repository root with its output going to the stage's log.
# -v: each test is named as it starts, so a stage that times out shows which test it was in
PYTEST="python3 -u -m pytest -v -rf -rs"
ep_env() { export MOELINK_EP_TIMEOUT_US=${EPT:-5000000}; }
stage_gtest() { ./build-dev/tests/cpp/moelink_cpp_tests --gtest_filter='Ibgda*'; }
stage_gtestall() { ./build-dev/tests/cpp/moelink_cpp_tests; }
stage_ctest() { ctest --test-dir build-dev -j 8 --output-on-failure; }
stage_test() { ep_env; cd tests/python && $PYTEST test_ep_buffer.py -k 'not ibgda'; }
stage_ibgda() { ep_env; cd tests/python && $PYTEST test_ep_buffer.py -k ibgda; }
stage_proxy() { ep_env; cd tests/python && $PYTEST test_ep_buffer.py -k proxy; }
stage_normal() { ep_env; cd tests/python && $PYTEST test_ep_normal_gpu.py ${NK:+-k "$NK"} --durations=5; }
stage_cudatest() { cd tests/python && $PYTEST test_cuda_collectives.py ${CK:+-k "$CK"}; }
stage_benchcheck() { cd tests/python && $PYTEST test_bench_collectives.py -k graph; }
stage_elastic() { cd tests/python && $PYTEST test_elastic.py; }
stage_elasticgpu() { cd tests/python && $PYTEST test_elastic.py -k gpu; }
stage_exitgpu() { cd tests/python && $PYTEST test_exit_status.py -k cuda; }
stage_all() { cd tests/python && $PYTEST .; }
stage_quick() { torchrun --nproc-per-node 4 examples/quickstart.py; }
# DeepEP v1 beside moelink where .devdeps/deepep is there (../shared/tools/deepep-v1.sh): built once
# per machine; DEEPEP is the benchmarks' flag for its rows ("" without it).
with_deepep() {
  DEEPEP=""
  if [ -f .devdeps/deepep/build.sh ]; then
    bash .devdeps/deepep/build.sh
    export PYTHONPATH=$PWD/.devdeps/deepep:${PYTHONPATH:-}
    DEEPEP=--deepep
  fi
}
bench_ep() { python3 examples/bench/ep.py --iters "${ITERS:-200}" --build build-dev "$@"; }
stage_bench1() { bench_ep --gpus 1 --trace --out "$OUT/ep1.png"; }
stage_bench2() { with_deepep; bench_ep --gpus 2 $DEEPEP ${TRACE:+--trace} --out "$OUT/ep2.png"; }
stage_bench4() { with_deepep; bench_ep --gpus 4 $DEEPEP ${TRACE:+--trace} --out "$OUT/ep4.png"; }
stage_benchnotma() { MOELINK_EP_TMA=0 bench_ep --gpus 4 --out "$OUT/ep4-warpstores.png"; }
stage_benchp() { MOELINK_EP_RANKS_PER_HOST=2 bench_ep --gpus 4 --out "$OUT/ep4proxy.png"; }
stage_benchptcp() {
  local g="${GPUS:-4}"
  for spread in 1 0; do
    echo "== MOELINK_EP_PROXY_SPREAD=$spread"
    MOELINK_EP_PROXY_SPREAD=$spread MOELINK_EP_RANKS_PER_HOST=$((g / 2)) MOELINK_TRANSPORT=tcp \
      bench_ep --gpus "$g" --out "$OUT/ep${g}proxytcp-spread$spread.png"
  done
}
stage_benchi() { MOELINK_EP_RANKS_PER_HOST=2 MOELINK_EP_IBGDA=emulate bench_ep --gpus 4 --out "$OUT/ep4ibgda.png"; }
stage_benchnormal() {
  with_deepep
  python3 examples/bench/ep_normal.py --gpus "${GPUS:-2}" $DEEPEP ${NBARGS:-} --out "$OUT/ep_normal.png"
}
stage_benchtwohop() {
  python3 examples/bench/ep_normal.py --gpus 4 --ranks-per-host 2 ${NBARGS:-} --out "$OUT/ep_normal_twohop.png"
}
bench_cuda() { python3 examples/bench/collectives.py --device cuda --iters "${ITERS:-20}" "$@"; }
stage_cudabench() { bench_cuda --gpus "${GPUS:-2}" --min-bytes 8192 --max-bytes $((1 << 30)) --out "$OUT/cuda${GPUS:-2}.png"; }
stage_cudasmall() { bench_cuda --gpus "${GPUS:-2}" --issue --graph --min-bytes 8192 --max-bytes 262144 --out "$OUT/cudasmall${GPUS:-2}.png"; }
stage_cudamid() { bench_cuda --gpus "${GPUS:-2}" --graph --min-bytes 262144 --max-bytes $((32 << 20)) --out "$OUT/cudamid${GPUS:-2}.png"; }
stage_cudalarge() {
  ITERS="${ITERS:-5}" bench_cuda --gpus "${GPUS:-2}" --min-bytes $((64 << 20)) --max-bytes $((1 << 30)) ${OPS:+--ops "$OPS"} \
    --out "$OUT/cudalarge${GPUS:-2}.png"
}
# Graph replay beside NCCL with setting $1 at each later value; plot $OUT/$2<value>.png. SWEEP_ARGS:
# the benchmark's size and op arguments (default 8-256 KiB, every op).
graph_sweep() {
  local name=$1 prefix=$2 v
  shift 2
  for v in "$@"; do
    echo "== $name=$v"
    ( export "$name=$v"
      bench_cuda --gpus "${GPUS:-2}" --graph ${SWEEP_ARGS:---min-bytes 8192 --max-bytes 262144} --out "$OUT/$prefix$v.png" )
  done
}
stage_cudasweep() { graph_sweep MOELINK_CUDA_LAMPORT_BYTES "sweep${GPUS:-2}-lamport" 0 262144; }
stage_cudabcast() {
  SWEEP_ARGS="${SWEEP_ARGS:---ops broadcast --min-bytes 262144 --max-bytes $((4 << 20))}" \
    graph_sweep MOELINK_CUDA_ONESHOT_BYTES "sweep${GPUS:-2}-bcast" 262144 4194304
}
stage_cudaoneshot() {
  local v
  for v in 1099511627776 0; do
    echo "== MOELINK_CUDA_ONESHOT_BYTES=$v"
    ( export MOELINK_CUDA_ONESHOT_BYTES=$v
      bench_cuda --gpus "${GPUS:-2}" --graph --ops all_reduce --min-bytes $((1 << 20)) --max-bytes $((32 << 20)) \
        --out "$OUT/oneshot${GPUS:-2}-mid-$v.png"
      ITERS="${ITERS:-5}" bench_cuda --gpus "${GPUS:-2}" --ops all_reduce --min-bytes $((64 << 20)) --max-bytes $((1 << 30)) \
        --out "$OUT/oneshot${GPUS:-2}-large-$v.png" )
  done
}
stage_cudapdl() { graph_sweep MOELINK_CUDA_PDL "pdl${GPUS:-2}-" 0 1; }
stage_cudatwoshot() {
  SWEEP_ARGS="${SWEEP_ARGS:---ops all_reduce --min-bytes 524288 --max-bytes $((8 << 20))}" \
    graph_sweep MOELINK_CUDA_LAMPORT_TWO_SHOT_BYTES "sweep${GPUS:-2}-twoshot" 0 4194304
}
sweep_sizes() { echo --min-bytes "${MINB:-$((4 << 20))}" --max-bytes "${MAXB:-$((256 << 20))}"; }
stage_cudabenchhost() {
  for st in ${STREAMS:-1 default}; do
    echo "== MOELINK_TCP_STREAMS=$st"
    [ "$st" = default ] && st=""
    MOELINK_TCP_STREAMS=$st MOELINK_RANKS_PER_HOST=1 bench_cuda --gpus "${GPUS:-2}" --nccl-socket --transport auto \
      $(sweep_sizes) --out "$OUT/cuda${GPUS:-2}host-s${st:-default}.png"
  done
}
stage_cudabench2lvl() {
  for tl in 1 0; do
    echo "== MOELINK_HOST_TWO_LEVEL=$tl"
    MOELINK_HOST_TWO_LEVEL=$tl MOELINK_RANKS_PER_HOST=2 bench_cuda --gpus "${GPUS:-4}" --nccl-socket --transport auto \
      $(sweep_sizes) --out "$OUT/cuda${GPUS:-4}twolevel-$tl.png"
  done
}
stage_nvlinkbench() { python3 examples/bench/nvlink.py --gpus "${GPUS:-2}" --build build-dev --out "$OUT/nvlink${GPUS:-2}.png"; }
stage_tcpbench() {
  python3 examples/bench/tcp_transport.py --streams 1,2,4,8,16 --build build-dev --out "$OUT/tcp_transport.png"
  # an EP FP8 dispatch row (7168 bytes and its scales) and a BF16 combine row; one signal after a
  # batch, and one after every 256 KiB of it (the EP proxy's waves)
  local row wave tag
  for wave in 0 262144; do
    tag=""
    [ "$wave" = 0 ] || tag=-waves
    for row in 7392 14336; do
      python3 examples/bench/tcp_transport.py --streams 1,4,8,16 --rows $row --wave $wave --min-bytes 262144 \
        --max-bytes 16777216 --build build-dev --out "$OUT/tcp_transport_rows$row$tag.png"
    done
  done
}
stage_proxybench() {
  local row
  for row in 7392 14336; do
    python3 examples/bench/proxy_carrier.py --row-bytes "$row" --build build-dev --out "$OUT/proxy_carrier$row.png"
  done
}
stage_cpubench() {
  for st in ${STREAMS:-1 default}; do
    echo "== MOELINK_TCP_STREAMS=$st"
    [ "$st" = default ] && st=""
    MOELINK_TCP_STREAMS=$st python3 examples/bench/collectives.py --nproc 4 --transport tcp --iters "${ITERS:-10}" \
      $(sweep_sizes) --cpu --out "$OUT/cpu_tcp-s${st:-default}-${MINB:-4194304}.png"
  done
}

stage_mooncake() {
  (cd tests/python && $PYTEST test_mooncake_compat.py -k "gpu or migration")
  python3 examples/mooncake_migration.py --world "${GPUS:-2}"
}
stage_mooncakeown() {
  # Mooncake's own EP test, run unchanged on moelink but for the imports and the backend name (the
  # migration the compat layer promises); its files are Mooncake's, fetched into .devdeps, not ours.
  local dir; dir=$(mktemp -d)
  cp .devdeps/anchors/mooncake-tests/*.py "$dir"/
  sed -i 's/^from mooncake.mooncake_ep_buffer import Buffer/from moelink.compat.mooncake.mooncake_ep_buffer import Buffer/' \
    "$dir/test_mooncake_ep.py"
  sed -i -e 's/importlib.import_module("mooncake.pg")/importlib.import_module("moelink.compat.mooncake.pg")/' \
    -e "s/backend='mooncake'/backend='ep'/" "$dir/ep_test_utils.py"
  diff -r .devdeps/anchors/mooncake-tests "$dir" || true  # the whole migration
  (cd "$dir" && MASTER_PORT=$((20000 + RANDOM % 20000)) python3 test_mooncake_ep.py)
}
stage_benchmooncake() {
  python3 -m pip install -q --no-deps .devdeps/anchors/mooncake_transfer_engine_cuda13-*.whl
  bench_ep --gpus "${GPUS:-2}" --mooncake --out "$OUT/ep${GPUS:-2}mooncake.png"
}

say build
if ! { cmake -S . -B build-dev -G Ninja -DPython3_EXECUTABLE="$(command -v python3)" > "$OUT/cmake.log" 2>&1 &&
       ninja -C build-dev > "$OUT/build.log" 2>&1; }; then
  tail -30 "$OUT/cmake.log"; grep -E "error" -A5 "$OUT/build.log" | head -60 || tail -30 "$OUT/build.log"
  echo "gpu-run: the build failed; 0 stages passed, ${#REQUESTED[@]} not run"
  exit 1
fi

if [ "${MPS:-0}" = 1 ]; then
  # (the pipe directory short: it holds unix sockets, whose paths have a length limit)
  CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/mps.XXXXXX)
  export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY=$OUT/mps-log
  mkdir -p "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d
  trap 'echo quit | nvidia-cuda-mps-control; rm -rf "$CUDA_MPS_PIPE_DIRECTORY"' EXIT
  say "MPS daemon started"
fi

PASSED=() FAILED=()
for s in "${REQUESTED[@]}"; do
  say "$s: ${WHAT[$s]}"
  log="$OUT/$s.log"
  set +e
  # SIGINT at the time limit (the stage's process group), SIGKILL 30 s later: pytest, interrupted,
  # still prints the failures it has seen, so a stage cut short says what failed before.
  ( set -e; timeout -s INT -k 30 "${STAGE_TIMEOUT:-${TIMEOUT[$s]}}" bash -c "$(declare -f); $(declare -p PYTEST OUT); stage_$s" ) > "$log" 2>&1
  rc=$?
  set -e
  # What the stage said last, without per-rank glog lines and stack frames.
  grep -vE "^[WI][0-9]{4} |^frame #|^\[rank[0-9]+\]:|Warning|warn\(" "$log" | tail -n 30 || true
  if [ $rc -eq 0 ]; then
    PASSED+=("$s")
    echo "--- $s: passed"
  else
    FAILED+=("$s(exit $rc)")
    echo "--- $s: FAILED with exit status $rc (log: $log)"
  fi
done
say done
echo "gpu-run: ${#PASSED[@]} stages passed, ${#FAILED[@]} failed${FAILED[*]:+ (${FAILED[*]})}"
[ ${#FAILED[@]} -eq 0 ]
