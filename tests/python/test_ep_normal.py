"""The EP buffer's normal mode (DeepEP's layout / dispatch / combine) on CPU tensors, in real
process groups of 2, 3 and 4 ranks, against pure-torch references (cases_normal.py). The GPU
runs of the same cases are in test_ep_normal_gpu.py."""

import pytest

import cases_normal
from harness import run_group


@pytest.mark.parametrize("world", [2, 3, 4])
def test_normal_mode_host_path(world):
    hiddens = (2048, 7168) if world == 2 else (2048,)
    run_group(world, cases_normal.all_cpu, kwargs=dict(hiddens=hiddens), timeout=900)
