"""Collectives on CUDA tensors over backend "ep" on 2 GPUs (one process per GPU): the in-host
NVLink path, and the host-staged path with MOELINK_RANKS_PER_HOST=1 (every peer a virtual
remote host), over shared memory, over striped tcp and with every op in small pieces through the
host pipeline; and the NVLink and pieces paths of 4 ranks where there are 4 GPUs (the kernels
choose protocols and thresholds by group size), the two-level route of 4 ranks as 2 virtual hosts
of 2, and the NVLink path of 8 ranks on them, two to a GPU. Each case checks its results against what every rank
computes itself (and a subset against NCCL). Skipped without 2 GPUs (the 4-rank group without
4)."""

import functools
import os

import pytest
import torch

import cases_cuda
from harness import assert_case_passed, run_cases, run_group

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
SHARED = GPUS == 1 and os.environ.get("MOELINK_TEST_SHARE_GPU") in ("1", "4")
if SHARED:
    # 2 ranks (or with "4", up to 4) on one GPU (time-sliced; correctness only)
    GPUS = int(os.environ["MOELINK_TEST_SHARE_GPU"]) if os.environ["MOELINK_TEST_SHARE_GPU"] == "4" else 2
# "tcp": the host-staged path with its transfer engine on tcp, large writes striped over 4 streams
# (as between real hosts); from 1 MiB its ops run through the host pipeline.
# "pieces": the same, with every all_reduce / reduce_scatter / all_gather / broadcast in small
# pieces through the host pipeline (the default takes it from 1 MiB, in 4 pieces of 1-16 MiB):
# slots of 64 KiB, an op below two slots in two pieces of at least 16 KiB.
TCP = {"MOELINK_RANKS_PER_HOST": "1", "MOELINK_TRANSPORT": "tcp", "MOELINK_TCP_STREAMS": "4"}
PIECES = dict(TCP, MOELINK_HOST_PIPELINE_BYTES="0", MOELINK_HOST_PIECE_BYTES="65536", MOELINK_HOST_PIECES="2",
              MOELINK_HOST_MIN_PIECE_BYTES="16384")
# "two_level": 4 ranks as 2 virtual hosts of 2, every op in pieces as in "pieces": all_reduce in
# two levels (the in-host kernels within each host, the host pipeline between the hosts).
PATHS = {"nvlink": {}, "host": {"MOELINK_RANKS_PER_HOST": "1"}, "tcp": TCP, "pieces": PIECES,
         "two_level": dict(PIECES, MOELINK_RANKS_PER_HOST="2")}


# 8 ranks, two to a GPU, where there are 4 GPUs (no machine of 8 has been lent): the kernels'
# code for groups above 4 ranks (their thresholds and block shapes) on the NVLink path, with the
# cases of the kernels themselves (NCCL refuses two ranks on one GPU).
EIGHT = ["all_reduce_every_dtype_op_size", "movement_ops_every_dtype", "reduce_scatter_and_reduce",
         "uneven_all_to_all", "in_place_all_to_all", "all_to_all_mixed_protocols", "broadcast_forwarded",
         "stream_order", "async_interleaved", "small_op_burst", "lamport_boundaries", "lamport_two_shot",
         "two_shot_staged", "graph_capture",
         "point_to_point", "bad_input"]
assert set(EIGHT) <= set(cases_cuda.CASES), sorted(set(EIGHT) - set(cases_cuda.CASES))  # a renamed case stays in


@functools.lru_cache(maxsize=None)
def results(path, world):
    names = EIGHT if world == 8 else cases_cuda.CASES
    if os.environ.get("MOELINK_TEST_CASES"):  # a subset (device runs on a budget); the others are skipped
        names = [n for n in names if n in os.environ["MOELINK_TEST_CASES"].split(",")]
    return run_group(world, run_cases, kwargs={"cases_mod": "cases_cuda", "names": names},
                     env=PATHS[path], timeout=900, pg_timeout=120)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", cases_cuda.CASES)
def test_cuda_collectives(world, path, case):
    if world > 2 and path in ("host", "tcp"):
        pytest.skip("4 ranks on the host-staged route run as the \"pieces\" path (every op of the host "
                    "pipeline in pieces); the one-shot staging at 4 ranks is the 2-rank code, and its CPU "
                    "collectives run at 4 ranks in test_collectives.py")
    if SHARED and world == 8:
        pytest.skip("8 ranks: 4 GPUs")
    if os.environ.get("MOELINK_TEST_CASES") and case not in os.environ["MOELINK_TEST_CASES"].split(","):
        pytest.skip("not in MOELINK_TEST_CASES")
    if path == "two_level" and world != 4:
        pytest.skip("2 virtual hosts of 2: 4 ranks")
    if case.startswith("two_level_") and path != "two_level":
        pytest.skip("the two-level route's own case")
    if world == 8 and (path != "nvlink" or case not in EIGHT):
        pytest.skip("8 ranks on 4 GPUs: the NVLink path's kernel cases only")
    if GPUS < min(world, 4):
        pytest.skip(f"needs {min(world, 4)} GPUs, found {GPUS}")
    if SHARED and "nccl" in case:
        pytest.skip("NCCL refuses two ranks on one GPU")
    assert_case_passed(results(path, world), case)


def test_two_level_interleaved_hosts():
    """The two-level route on 2 hosts whose ranks interleave ({0, 2} and {1, 3}, MOELINK_HOST_ID per
    rank): a rank's rail and its host peers are not its neighbours; all_gather places every block
    by rank, reduce_scatter takes each rank's block from its place, and broadcast finds the root's
    rail."""
    if GPUS < 4:
        pytest.skip(f"needs 4 GPUs (or MOELINK_TEST_SHARE_GPU=4 and one), found {GPUS}")
    names = ["two_level_all_reduce", "two_level_all_gather", "two_level_reduce_scatter", "two_level_broadcast"]
    env = {k: v for k, v in PIECES.items() if k != "MOELINK_RANKS_PER_HOST"}
    res = run_group(4, run_cases, kwargs={"cases_mod": "cases_cuda", "names": names}, env=env,
                    rank_env={r: {"MOELINK_HOST_ID": "interleaved-" + "AB"[r % 2]} for r in range(4)},
                    timeout=600, pg_timeout=120)
    for case in names:
        assert_case_passed(res, case)
