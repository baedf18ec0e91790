"""Calls that once killed the process: an exception thrown inside torch (c10's checks) that
unwound through a moelink frame met a second unwinder in the module and ended in SIGABRT.
Each case runs in a fresh two-rank group (no moelink exception raised before it in the
process) and must end in a Python exception or a result, with the process and group alive."""

import pytest
import torch
import torch.distributed as dist

from harness import run_group


def _group_alive(world):
    x = torch.ones(8)
    dist.all_reduce(x)
    assert torch.all(x == world)


def all_gather_coalesced(rank, world):
    out = [[torch.empty(4) for _ in range(world)]]
    try:
        dist.all_gather_coalesced(out, [torch.full((4,), float(rank))])
        for r in range(world):
            assert torch.all(out[0][r] == r)
    except (RuntimeError, ValueError, NotImplementedError):
        pass
    _group_alive(world)


def gather_into_tensor(rank, world):
    out = torch.empty(world * 4) if rank == 0 else None
    try:
        dist.gather_into_tensor(torch.full((4,), float(rank)), out, dst=0)
        if rank == 0:
            assert torch.equal(out, torch.arange(world).repeat_interleave(4).float())
    except (RuntimeError, ValueError, NotImplementedError):
        pass
    _group_alive(world)


def monitored_barrier(rank, world):
    try:
        dist.monitored_barrier(wait_all_ranks=True)
    except (RuntimeError, ValueError, NotImplementedError):
        pass
    _group_alive(world)


def new_subgroups_of_one(rank, world):
    try:
        sub, _ = dist.new_subgroups(group_size=1)
        x = torch.ones(2)
        dist.all_reduce(x, group=sub)
        assert torch.all(x == 1)
    except (RuntimeError, ValueError, NotImplementedError):
        pass
    _group_alive(world)


def expanded_output(rank, world):
    x = torch.ones(1).expand(4)  # stride 0: four elements share one location
    with pytest.raises((RuntimeError, ValueError)):
        dist.all_reduce(x)
    _group_alive(world)


def backend_after_destroy(rank, world):
    import moelink

    backend = moelink.get_backend()
    dist.destroy_process_group()
    with pytest.raises((RuntimeError, ValueError)):
        backend.transport_of(0)
    with pytest.raises((RuntimeError, ValueError)):
        backend.allreduce([torch.ones(2)], dist.AllreduceOptions()).wait()


CASES = [all_gather_coalesced, gather_into_tensor, monitored_barrier, new_subgroups_of_one, expanded_output,
         backend_after_destroy]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_no_abort(case):
    run_group(2, case, timeout=120, pg_timeout=30)
