"""Collectives on CUDA tensors over backend "ep" on 2 GPUs (one process per GPU): the in-host
NVLink path, and the host-staged path with MOELINK_RANKS_PER_HOST=1 (every peer a virtual
remote host). Each case checks its results against what every rank computes itself (and a
subset against NCCL). Skipped without 2 GPUs."""

import functools
import os

import pytest
import torch

import cases_cuda
from harness import assert_case_passed, run_cases, run_group

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
SHARED = GPUS == 1 and os.environ.get("MOELINK_TEST_SHARE_GPU") == "1"
if SHARED:
    GPUS = 2  # both ranks on one GPU (time-sliced; correctness only)
PATHS = {"nvlink": {}, "host": {"MOELINK_RANKS_PER_HOST": "1"}}


@functools.lru_cache(maxsize=None)
def results(path):
    return run_group(2, run_cases, kwargs={"cases_mod": "cases_cuda", "names": cases_cuda.CASES},
                     env=PATHS[path], timeout=900, pg_timeout=120)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", cases_cuda.CASES)
def test_cuda_collectives(path, case):
    if GPUS < 2:
        pytest.skip(f"needs 2 GPUs, found {GPUS}")
    if SHARED and "nccl" in case:
        pytest.skip("NCCL refuses two ranks on one GPU")
    assert_case_passed(results(path), case)
