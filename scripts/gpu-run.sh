#!/usr/bin/env bash
# GPU-machine batch: builds into build-dev, then runs the named stages, writing logs and plots
# to $OUT (default ./gpu-out). Stages: gtest gtestall test proxy ibgda quick bench4 bench2
# benchnotma benchp benchi ctest cudatest cudabench cudasmall cudabenchhost elastic elasticgpu normal benchnormal.
# cudabench: 8 KiB-1 GiB beside NCCL; cudasmall: 8-256 KiB, latency, host issue time and time per op replayed in a CUDA graph beside NCCL; both on `GPUS` ranks
# (default 2; GPUS=1: without peers).
# MOELINK_TEST_SHARE_GPU=1 runs the 2-GPU tests (elasticgpu, normal) on one GPU. Env: ITERS, TRACE=1 (phase breakdown), BT/TT/PT (timeouts, s),
# NK (a pytest -k filter for the normal stage).
# On the lent GPU machine (no apt), `.devdeps/unpack.sh` (from ../shared/tools/device-deps.sh)
# provides glog, gflags, GTest and rdma-core headers; elsewhere they come from scripts/install.sh.
[ -f .devdeps/unpack.sh ] && source .devdeps/unpack.sh
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
(python3 -c "import pytest" 2>/dev/null || pip install -q --no-index .devdeps/wheels/*.whl) >/dev/null 2>&1
T0=$(date +%s)
st() { echo "=== [$(( $(date +%s) - T0 ))s] $*"; }
st build
cmake -S . -B build-dev -G Ninja -DPython3_EXECUTABLE=$(which python3) > $OUT/cmake.log 2>&1 || { tail -30 $OUT/cmake.log; exit 1; }
ninja -C build-dev > $OUT/build.log 2>&1 || { grep -E "error" -A5 $OUT/build.log | head -60; exit 1; }
export PYTHONPATH=$PWD/integration
for s in "$@"; do
  case $s in
    gtest) st gtest; timeout 120 ./build-dev/tests/cpp/moelink_cpp_tests --gtest_filter='Ibgda*' 2>&1 | tail -6 ;;
    bench4) st bench4; timeout ${BT:-150} python3 examples/bench/ep.py --gpus 4 --iters ${ITERS:-200} ${TRACE:+--trace} --out $OUT/ep4.png 2>&1 | tail -40 ;;
    benchnotma) st benchnotma; MOELINK_EP_TMA=0 timeout ${BT:-150} python3 examples/bench/ep.py --gpus 4 --iters ${ITERS:-200} ${TRACE:+--trace} --out $OUT/ep4-warpstores.png 2>&1 | tail -40 ;;
    bench2) st bench2; timeout ${BT:-150} python3 examples/bench/ep.py --gpus 2 --iters ${ITERS:-200} --out $OUT/ep2.png 2>&1 | tail -12 ;;
    benchp) st benchproxy; MOELINK_EP_RANKS_PER_HOST=2 timeout ${BT:-150} python3 examples/bench/ep.py --gpus 4 --iters 50 --out $OUT/ep4proxy.png 2>&1 | tail -12 ;;
    test) st test; (cd tests/python && MOELINK_EP_TIMEOUT_US=${EPT:-5000000} timeout ${TT:-400} python3 -m pytest -q test_ep_buffer.py -k 'not ibgda' > $OUT/test.log 2>&1; grep -E "Error|assert|passed|failed|FAILED" $OUT/test.log | grep -v "^frame" | head -30) ;;
    ibgda) st ibgda; (cd tests/python && MOELINK_EP_TIMEOUT_US=${EPT:-5000000} timeout ${IT:-300} python3 -m pytest -q test_ep_buffer.py -k ibgda > $OUT/ibgda.log 2>&1; grep -E "Error|error|assert|passed|failed" $OUT/ibgda.log | grep -v "^frame" | head -30) ;;
    benchi) st benchibgda; MOELINK_EP_RANKS_PER_HOST=2 MOELINK_EP_IBGDA=emulate timeout ${BT:-150} python3 examples/bench/ep.py --gpus 4 --iters 20 --out $OUT/ep4ibgda.png 2>&1 | tail -12 ;;
    proxy) st proxy; (cd tests/python && MOELINK_EP_TIMEOUT_US=${EPT:-5000000} timeout ${PT:-300} python3 -m pytest -q test_ep_buffer.py -k proxy > $OUT/proxy.log 2>&1; grep -E "Error|error|assert|passed|failed" $OUT/proxy.log | grep -v "^frame" | head -30) ;;
    all) st all-tests; (cd tests/python && timeout ${AT:-500} python3 -m pytest -q . 2>&1 | tail -15) ;;
    gtestall) st gtestall; timeout 150 ./build-dev/tests/cpp/moelink_cpp_tests > $OUT/gtest.log 2>&1; tail -4 $OUT/gtest.log; grep -E "FAILED|SKIPPED" $OUT/gtest.log | head ;;
    quick) st quickstart; timeout 120 torchrun --nproc-per-node 4 examples/quickstart.py 2>&1 | grep -v "^W1\|OMP_NUM\|\*\*\*\*" | tail -12 ;;
    cudatest) st cudatest; (cd tests/python && timeout ${CT:-300} python3 -m pytest -q -rf test_cuda_collectives.py > $OUT/cudatest.log 2>&1; grep -E "^FAILED|passed|failed" $OUT/cudatest.log | head -40) ;;
    cudabench) st cudabench; timeout ${BT:-300} python3 examples/bench/collectives.py --device cuda --gpus ${GPUS:-2} --iters ${ITERS:-20} --min-bytes 8192 --max-bytes $((1 << 30)) --out $OUT/cuda2.png 2>&1 | tail -60 ;;
    cudasmall) st cudasmall; timeout ${BT:-300} python3 examples/bench/collectives.py --device cuda --gpus ${GPUS:-2} --issue --graph --iters ${ITERS:-20} --min-bytes 8192 --max-bytes 262144 --out $OUT/cudasmall.png 2>&1 | grep -v -i warn | tail -82 ;;
    cudabenchhost) st cudabenchhost; MOELINK_RANKS_PER_HOST=1 timeout ${BT:-300} python3 examples/bench/collectives.py --device cuda --gpus 2 --iters ${ITERS:-10} --min-bytes 8192 --max-bytes $((256 << 20)) --ops all_reduce,all_gather --out $OUT/cuda2host.png 2>&1 | tail -30 ;;
    elastic) st elastic; (cd tests/python && timeout ${ET:-400} python3 -m pytest -q -rs -rf test_elastic.py > $OUT/elastic.log 2>&1; grep -E "^FAILED|^SKIPPED|passed|failed|Error:" $OUT/elastic.log | grep -v "^frame" | head -30) ;;
    elasticgpu) st elasticgpu; (cd tests/python && timeout ${ET:-300} python3 -m pytest -q -rs -rf test_elastic.py -k gpu > $OUT/elasticgpu.log 2>&1; grep -E "^FAILED|^SKIPPED|passed|failed|Error" $OUT/elasticgpu.log | grep -v "^frame" | head -30) ;;
    normal) st normal; (cd tests/python && MOELINK_EP_TIMEOUT_US=${EPT:-5000000} timeout ${NT:-400} python3 -m pytest -q -rf test_ep_normal_gpu.py ${NK:+-k "$NK"} --durations=5 > $OUT/normal.log 2>&1; grep -E "^FAILED|passed|failed|Error" $OUT/normal.log | grep -v "^frame" | head -30) ;;
    benchnormal) st benchnormal; ([ -f .devdeps/deepep/build.sh ] && bash .devdeps/deepep/build.sh && export PYTHONPATH=$PWD/.devdeps/deepep:$PYTHONPATH
      timeout ${BT:-300} python3 examples/bench/ep_normal.py --gpus ${GPUS:-2} --deepep ${NBARGS:-} --out $OUT/ep_normal.png > $OUT/ep_normal.log 2>&1
      grep -vE "^[WI][0-9]|^\[rank|warn" $OUT/ep_normal.log | tail -40) ;;
    ctest) st ctest; ctest --test-dir build-dev -j 8 2>&1 | tail -5 ;;
  esac
done
st done
