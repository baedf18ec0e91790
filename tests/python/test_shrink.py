"""torch.distributed.shrink_group on backend "ep": the ranks that stay get a group over
themselves, renumbered in order, whether the excluded rank is alive, dead (SIGKILLed) or
only left out of a subgroup; every op on the shrunk group is checked against what the old
ranks hold. Bad calls raise and leave the group usable."""

import os
import signal

import pytest
import torch
import torch.distributed as dist

import moelink
from harness import run_group

pytestmark = pytest.mark.skipif(not hasattr(dist, "shrink_group"), reason="torch without shrink_group")

TRANSPORTS = ["auto", "tcp"]


def check_shrunk(group, old_rank, stay):
    """Ops on `group` (over the old ranks `stay`, in order) against local computations."""
    new_rank, n = stay.index(old_rank), len(stay)
    assert dist.get_rank(group) == new_rank and dist.get_world_size(group) == n
    assert dist.get_backend(group) == "ep"
    backend = moelink.get_backend(group)  # c10d's Backend API, which shrink_group itself calls
    assert (backend.rank(), backend.size()) == (new_rank, n)
    assert moelink.get_active_ranks(group).tolist() == [1] * n
    x = torch.arange(6, dtype=torch.float64) + old_rank
    dist.all_reduce(x, group=group)
    assert torch.equal(x, sum(torch.arange(6, dtype=torch.float64) + r for r in stay))
    got = [torch.empty(3, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(got, torch.full((3,), old_rank, dtype=torch.int64), group=group)
    assert [int(t[0]) for t in got] == stay, "all_gather is in the shrunk group's rank order"
    y = torch.full((5,), float(old_rank))
    dist.broadcast(y, src=dist.get_global_rank(group, n - 1), group=group)
    assert torch.all(y == stay[-1])
    a2a = torch.empty(n, dtype=torch.int64)
    dist.all_to_all_single(a2a, torch.full((n,), old_rank, dtype=torch.int64), group=group)
    assert a2a.tolist() == stay
    # Point to point in the new numbering: a ring.
    nxt, prv = (new_rank + 1) % n, (new_rank - 1) % n
    r = torch.empty(1, dtype=torch.int64)
    reqs = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, torch.tensor([old_rank]), dist.get_global_rank(group, nxt), group),
        dist.P2POp(dist.irecv, r, dist.get_global_rank(group, prv), group),
    ])
    for q in reqs:
        q.wait()
    assert int(r) == stay[prv]
    dist.barrier(group=group)


def shrink_default(rank, world, exclude, die):
    x = torch.ones(4)
    dist.all_reduce(x)
    assert torch.all(x == world)
    if rank in exclude:
        if die:
            os.kill(os.getpid(), signal.SIGKILL)
        # A live rank that is left out: it calls nothing more on the group and leaves.
        return "excluded"
    stay = [r for r in range(world) if r not in exclude]
    dist.shrink_group(list(exclude), shrink_flags=1 if die else 0)  # SHRINK_ABORT after a failure
    assert dist.get_world_size() == len(stay), "the shrunk group is the default group now"
    check_shrunk(dist.group.WORLD, rank, stay)
    # New groups come from the shrunk world, in its numbering.
    g = dist.new_group(list(range(len(stay))))
    z = torch.ones(2)
    dist.all_reduce(z, group=g)
    assert torch.all(z == len(stay))
    return dist.get_rank()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_shrink_drops_a_live_rank(transport):
    out = run_group(4, shrink_default, kwargs={"exclude": [1], "die": False}, env={"MOELINK_TRANSPORT": transport},
                    timeout=240)
    assert out == [0, "excluded", 1, 2]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_shrink_after_ranks_died(transport):
    # Rank 0 hosts the store here (tcp:// init), which the new group is built through: it stays.
    out = run_group(4, shrink_default, kwargs={"exclude": [1, 2], "die": True}, env={"MOELINK_TRANSPORT": transport},
                    killed=(1, 2), timeout=240)
    assert out[0] == 0 and out[3] == 1


def shrink_subgroup(rank, world):
    sub = dist.new_group(list(range(world)))
    if rank != world - 1:
        stay = list(range(world - 1))
        shrunk = dist.shrink_group([world - 1], group=sub)
        check_shrunk(shrunk, rank, stay)
    # The default group is untouched: all ranks, the left-out one included.
    x = torch.ones(3)
    dist.all_reduce(x)
    assert torch.all(x == world) and dist.get_world_size() == world


def test_shrink_a_subgroup_keeps_the_default_group():
    run_group(3, shrink_subgroup, timeout=240)


def bad_shrinks(rank, world):
    for bad, kind in (([world + 3], ValueError), ([rank], (RuntimeError, ValueError)), ([], ValueError)):
        with pytest.raises(kind):
            dist.shrink_group(bad)
        x = torch.ones(2)
        dist.all_reduce(x)
        assert torch.all(x == world), f"the group is usable after shrink_group({bad})"
    with pytest.raises(ValueError):
        dist.shrink_group([world - 1], shrink_flags=7)


def test_bad_shrink_raises_and_keeps_the_group():
    run_group(3, bad_shrinks, timeout=240)


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
SHARED = GPUS == 1 and os.environ.get("MOELINK_TEST_SHARE_GPU") == "1"  # 3 ranks on one GPU


def shrink_cuda(rank, world):
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    sub = dist.new_group(list(range(world)), device_id=dev)  # bound: its shrunk group serves CUDA tensors
    x = torch.ones(1024, device=dev)
    dist.all_reduce(x, group=sub)
    assert torch.all(x == world)
    if rank == 1:
        return "excluded"
    stay = [0, 2]
    shrunk = dist.shrink_group([1], group=sub)
    n, me = len(stay), stay.index(rank)
    assert dist.get_rank(shrunk) == me and dist.get_world_size(shrunk) == n
    for numel in (1024, 3 << 20):  # one round and several
        y = torch.arange(numel, device=dev, dtype=torch.float32) + rank
        dist.all_reduce(y, group=shrunk)
        assert torch.equal(y, sum(torch.arange(numel, device=dev, dtype=torch.float32) + r for r in stay))
        got = torch.empty(n * numel, device=dev)
        dist.all_gather_into_tensor(got, torch.full((numel,), float(rank), device=dev), group=shrunk)
        assert torch.equal(got.view(n, numel)[:, 0].cpu(), torch.tensor(stay, dtype=torch.float32))
    torch.cuda.synchronize()
    assert moelink.get_active_ranks(shrunk).tolist() == [1] * n, "moelink's API reaches the shrunk group's backend"
    return me


@pytest.mark.skipif(GPUS < 3 and not SHARED, reason="needs 3 GPUs (or MOELINK_TEST_SHARE_GPU=1 with one)")
def test_shrink_a_bound_cuda_group():
    out = run_group(3, shrink_cuda, timeout=300)
    assert out == [0, "excluded", 1]
