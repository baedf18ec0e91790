"""The EP buffer's normal mode (DeepEP's layout / dispatch / combine) on CPU tensors, in real
process groups of 2, 3 and 4 ranks, against pure-torch references (cases_normal.py); and the
two-hop route (two_hop.py) on groups split into virtual hosts. The GPU runs of the same cases
are in test_ep_normal_gpu.py."""

import pytest

import cases_normal
from harness import run_group


@pytest.mark.parametrize("world", [2, 3, 4])
def test_normal_mode_host_path(world):
    hiddens = (2048, 7168) if world == 2 else (2048,)
    run_group(world, cases_normal.all_cpu, kwargs=dict(hiddens=hiddens), timeout=900)


@pytest.mark.parametrize("world,per_host,two_hop", [(4, 2, "1"), (6, 3, "1"), (4, 2, "0")],
                         ids=["2x2", "2x3", "2x2-off"])
def test_normal_mode_two_hop_route(world, per_host, two_hop):
    """Hosts of `per_host` ranks (MOELINK_EP_RANKS_PER_HOST): every output of the two-hop route
    (host hop, then the local hop between the host's ranks) against the same references as the
    one-hop group path; MOELINK_EP_TWO_HOP=0 turns the route off."""
    env = {"MOELINK_EP_RANKS_PER_HOST": str(per_host), "MOELINK_EP_TWO_HOP": two_hop}
    expect = "two_hop" if two_hop == "1" else "group"
    run_group(world, cases_normal.two_hop_cpu, kwargs=dict(expect=expect), env=env, timeout=900)
