"""The EP buffer's normal mode on 2 GPUs: the NVLink kernels, and the group route that a
group split across (virtual) hosts takes; every output against pure-torch references, async
events, and a short MoE training loop against a single-process reference (cases_normal.py).
Skipped without 2 GPUs."""

import os

import pytest
import torch

import cases_normal
from harness import run_group


def _gpus():
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # MOELINK_TEST_SHARE_GPU=1: both ranks on one GPU (time-sliced; correctness only)
    return 2 if n and os.environ.get("MOELINK_TEST_SHARE_GPU") == "1" else n


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs (or one and MOELINK_TEST_SHARE_GPU=1)")
@pytest.mark.parametrize("route", ["nvlink", "group"])
def test_normal_mode_gpu(route):
    env = {"MOELINK_EP_RANKS_PER_HOST": "1"} if route == "group" else {}
    res = run_group(2, cases_normal.all_gpu, env=env, timeout=600)
    assert [r["path"] for r in res] == [route, route]
    assert res[0]["losses"] == res[1]["losses"]
