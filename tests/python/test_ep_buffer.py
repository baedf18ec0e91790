"""The EP buffer on 2 and 4 GPUs (one process per GPU, NVLink), checked against pure-torch
references of the same routing. Skipped without enough GPUs."""

import functools

import pytest
import torch

import cases_ep
from harness import run_cases, run_group

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@functools.lru_cache(maxsize=None)
def results(world):
    return run_group(world, run_cases, kwargs={"cases_mod": "cases_ep", "names": cases_ep.CASES}, timeout=900)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", cases_ep.CASES)
def test_ep_buffer(world, case):
    if GPUS < world:
        pytest.skip(f"needs {world} GPUs, found {GPUS}")
    failures = [f"rank {r}:\n{res[case]}" for r, res in enumerate(results(world)) if res[case]]
    assert not failures, "\n".join(failures)
