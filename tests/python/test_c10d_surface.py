"""c10d methods beyond the core collectives, on CPU tensors over "ep", checked against values
each rank computes itself: all_gather_coalesced, gather_into_tensor, monitored_barrier (passing,
and failing with the missing rank named), a walk over the whole public torch.distributed
surface (cases_surface.py), and functional collectives with DTensor and torch.compile
(cases_funcol.py)."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import cases_funcol
from harness import run_group


def coalesced_and_gather_into_tensor(rank, world):
    ins = [torch.full((3,), float(rank)), torch.arange(4, dtype=torch.float32).view(2, 2) + 10 * rank]
    outs = [[torch.empty(3), torch.empty(2, 2)] for _ in range(world)]
    dist.all_gather_coalesced(outs, ins)
    for r in range(world):
        assert torch.equal(outs[r][0], torch.full((3,), float(r)))
        assert torch.equal(outs[r][1], torch.arange(4, dtype=torch.float32).view(2, 2) + 10 * r)
    out = torch.empty(world * 4, dtype=torch.int64) if rank == world - 1 else None
    dist.gather_into_tensor(torch.full((4,), rank, dtype=torch.int64), out, dst=world - 1)
    if rank == world - 1:
        assert torch.equal(out, torch.arange(world).repeat_interleave(4))
    with pytest.raises(ValueError, match="expected"):
        dist.gather_into_tensor(torch.ones(4), torch.empty(3), dst=rank)  # each rank its own root: bad size


def monitored_barrier_passes(rank, world):
    for _ in range(3):
        dist.monitored_barrier(timeout=timedelta(seconds=20), wait_all_ranks=True)
    x = torch.ones(4)
    dist.all_reduce(x)
    assert torch.all(x == world)


def monitored_barrier_names_the_missing(rank, world):
    if rank != world - 1:  # the last rank never arrives
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=2), wait_all_ranks=True)
            raise AssertionError("the barrier passed without the last rank")
        except RuntimeError as e:
            # gloo's wording, which PyTorch's own tests match on
            if rank == 0:
                assert f"Rank {world - 1} failed to pass monitoredBarrier" in str(e), e
            else:
                assert f"Rank {rank} successfully reached monitoredBarrier, but received errors" in str(e), e
                assert "other ranks failed" in str(e), e
    dist.barrier()
    # A zero timeout is a zero budget (rank 0 cannot wait for anyone), not "the default".
    if rank == 0:
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=0))
            raise AssertionError("a monitored barrier with a zero timeout passed")
        except RuntimeError as e:
            assert "Rank 0 timed out in monitoredBarrier" in str(e), e
    x = torch.ones(4)
    dist.all_reduce(x)  # the group still works
    assert torch.all(x == world)


@pytest.mark.parametrize("world", [2, 3])
def test_coalesced_and_gather_into_tensor(world):
    run_group(world, coalesced_and_gather_into_tensor, timeout=120, pg_timeout=30)


def test_monitored_barrier_passes():
    run_group(3, monitored_barrier_passes, timeout=120, pg_timeout=30)


def test_monitored_barrier_names_the_missing():
    run_group(3, monitored_barrier_names_the_missing, timeout=120, pg_timeout=30)


@pytest.mark.parametrize("world", [2, 4])
def test_public_surface_walk(world):
    """Every public torch.distributed collective, object collective, group constructor and
    coalescing manager on "ep": right values or a clean Python exception (only where listed in
    cases_surface.MAY_RAISE), and the group usable after each call."""
    import cases_surface

    res = run_group(world, cases_surface.walk, timeout=300)
    for r, calls in enumerate(res):
        for name, outcome in calls.items():
            if name.endswith("(trace)"):
                continue
            assert outcome == "ok" or name in cases_surface.MAY_RAISE, f"rank {r}: {name}: {outcome}"


def debug_detail(rank, world):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the backend in c10d's ProcessGroupWrapper, which
    checks every collective's fingerprint and sequence number across ranks first."""
    pg = dist.group.WORLD._get_backend(torch.device("cpu"))
    assert "Wrapper" in type(pg).__name__, type(pg)
    x = torch.full((5,), float(rank + 1))
    dist.all_reduce(x)
    assert torch.all(x == sum(range(1, world + 1)))
    out = torch.empty(world * 3)
    dist.all_gather_into_tensor(out, torch.full((3,), float(rank)))
    assert torch.equal(out, torch.arange(world, dtype=torch.float32).repeat_interleave(3))
    y = torch.full((2,), float(rank))
    dist.broadcast(y, src=world - 1)
    assert torch.all(y == world - 1)
    r = torch.empty(2)
    dist.reduce_scatter_tensor(r, torch.ones(world * 2))
    assert torch.all(r == world)
    dist.barrier()


def test_debug_detail_wrapper():
    run_group(2, debug_detail, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, timeout=120, pg_timeout=30)


@pytest.mark.parametrize("world", [2, 3])
def test_functional_collectives_and_dtensor(world):
    run_group(world, cases_funcol.functional_and_dtensor, timeout=240, pg_timeout=60)
