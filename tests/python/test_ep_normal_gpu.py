"""The EP buffer's normal mode on GPUs: the NVLink kernels (2 and 4 GPUs), the group route that a
group split into hosts of one GPU takes (2 GPUs), and the two-hop route on 2 virtual hosts of
2 GPUs (4 GPUs: host hop over the group, NVLink hop between each host's two); every output
against pure-torch references, async events, and a short MoE training loop against a
single-process reference (cases_normal.py). Skipped without the GPUs."""

import os

import pytest
import torch

import cases_normal
from harness import run_group


def _gpus():
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # MOELINK_TEST_SHARE_GPU=1: the ranks share the GPUs there are (time-sliced; correctness only)
    return 4 if n and os.environ.get("MOELINK_TEST_SHARE_GPU") == "1" else n


@pytest.mark.parametrize("route,world", [("nvlink", 2), ("nvlink", 4), ("group", 2), ("two_hop", 4)])
def test_normal_mode_gpu(route, world):
    if _gpus() < world:
        pytest.skip(f"needs {world} GPUs (or one and MOELINK_TEST_SHARE_GPU=1)")
    env = {"MOELINK_EP_RANKS_PER_HOST": {"nvlink": "", "group": "1", "two_hop": "2"}[route]}
    kwargs = dict(big_tokens=1024 if route == "two_hop" else 2048, hiddens=(7168,)) if world == 4 else {}
    # The NVLink and group cases take about a minute on their own GPUs: a hang there is reported
    # (with the ranks' stacks) well inside the GPU script's stage timeout. Ranks sharing one GPU,
    # and the two-hop route's host hop, take longer.
    shared = os.environ.get("MOELINK_TEST_SHARE_GPU") == "1"
    timeout = 900 if shared or route == "two_hop" else 240
    res = run_group(world, cases_normal.all_gpu, env=env, kwargs=kwargs, timeout=timeout)
    assert [r["path"] for r in res] == [route] * world
    assert all(r["losses"] == res[0]["losses"] for r in res)
