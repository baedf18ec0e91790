"""The EP buffer on 2, 4 and 8 GPUs (one process per GPU, NVLink; the CPU-proxy path with
MOELINK_EP_RANKS_PER_HOST=2 on 4 GPUs; IBGDA through the emulated NIC on 2 and 4 GPUs),
checked against pure-torch references of the same routing. Skipped without enough GPUs."""

import functools
import os

import pytest
import torch

import cases_ep
from harness import assert_case_passed, run_cases, run_group

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
SHARED = GPUS >= 1 and os.environ.get("MOELINK_TEST_SHARE_GPU") == "1"
if GPUS == 1 and SHARED:
    GPUS = 2  # the 2-rank cases with both ranks on one GPU (time-sliced; correctness only)


@functools.lru_cache(maxsize=None)
def results(world):
    return run_group(world, run_cases, kwargs={"cases_mod": "cases_ep", "names": cases_ep.CASES}, timeout=900)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("case", cases_ep.CASES)
def test_ep_buffer(world, case):
    if GPUS < world:
        pytest.skip(f"needs {world} GPUs, found {GPUS}")
    assert_case_passed(results(world), case)


@functools.lru_cache(maxsize=None)
def proxy_results(transport):
    case = "proxy_path" if transport == "shm" else "proxy_path_tcp"
    env = {"MOELINK_EP_RANKS_PER_HOST": "2", "MOELINK_TRANSPORT": transport}
    return case, run_group(4, run_cases, kwargs={"cases_mod": "cases_ep", "names": [case]}, env=env, timeout=900)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_ep_proxy_path(transport):
    if GPUS < 4 and not SHARED:  # shared: the 4 ranks on the GPUs there are
        pytest.skip(f"needs 4 GPUs (or MOELINK_TEST_SHARE_GPU=1), found {GPUS}")
    case, res = proxy_results(transport)
    assert_case_passed(res, case)


@functools.lru_cache(maxsize=None)
def warp_store_results():
    return run_group(2, run_cases, kwargs={"cases_mod": "cases_ep", "names": ["modes", "two_rounds_in_flight"]},
                     env={"MOELINK_EP_TMA": "0"}, timeout=600)


@pytest.mark.parametrize("case", ["modes", "two_rounds_in_flight"])
def test_ep_warp_store_path(case):
    """Dispatch with warp stores instead of bulk copies (MOELINK_EP_TMA=0)."""
    if GPUS < 2:
        pytest.skip(f"needs 2 GPUs, found {GPUS}")
    assert_case_passed(warp_store_results(), case)


@functools.lru_cache(maxsize=None)
def ibgda_results(world):
    env = {"MOELINK_EP_RANKS_PER_HOST": str(world // 2), "MOELINK_EP_IBGDA": "emulate"}
    return run_group(world, run_cases, kwargs={"cases_mod": "cases_ep", "names": ["ibgda_emulated"]}, env=env,
                     timeout=900)


@pytest.mark.parametrize("world", [2, 4])
def test_ep_ibgda_emulated(world):
    """IBGDA between the two halves of the group (virtual hosts), the NIC emulated."""
    if GPUS < world and not SHARED:  # shared: the ranks on the GPUs there are
        pytest.skip(f"needs {world} GPUs (or MOELINK_TEST_SHARE_GPU=1), found {GPUS}")
    assert_case_passed(ibgda_results(world), "ibgda_emulated")
