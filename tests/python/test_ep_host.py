"""The EP buffer's CPU-tensor implementation, checked with the same pure-torch references as
the GPU tests, in real process groups (runs everywhere, no GPU needed)."""

import pytest

from harness import run_group
import cases_ep


@pytest.mark.parametrize("world", [2, 4])
def test_ep_host_path(world):
    run_group(world, cases_ep.host_path, timeout=600)
