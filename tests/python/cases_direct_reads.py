"""Same-host groups where a receiver reads the sender's memory directly (pulled messages; see
include/moelink/collective/mailbox.h). Every copy-only op, with pieces cut small and at odd
sizes so that each op crosses many pulled pieces, checked against a local reference; the op of
a rank that gave up is withdrawn from a late reader."""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import moelink


def reads_directly_reported(rank, world):
    """Returns what `moelink.reads_directly` says about every peer (None for this rank)."""
    return [None if p == rank else moelink.reads_directly(p) for p in range(world)]


def _block(src, dst, n):
    """The data rank `src` sends rank `dst`: distinct per pair and position."""
    return torch.arange(n, dtype=torch.float64) * 0.5 + src * 1000 + dst * 10


def all_to_all_exact(rank, world):
    # Uneven: rank s sends (s + d + 1) * 70001 elements (odd byte counts) to rank d.
    sizes = lambda s, d: (s + d + 1) * 70001
    inp = torch.cat([_block(rank, d, sizes(rank, d)) for d in range(world)])
    out = torch.full((sum(sizes(s, rank) for s in range(world)),), -1.0, dtype=torch.float64)
    dist.all_to_all_single(out, inp, [sizes(s, rank) for s in range(world)], [sizes(rank, d) for d in range(world)])
    assert torch.equal(out, torch.cat([_block(s, rank, sizes(s, rank)) for s in range(world)]))
    # Even, as a list of tensors.
    n = 300007
    outs = [torch.empty(n, dtype=torch.float64) for _ in range(world)]
    dist.all_to_all(outs, [_block(rank, d, n) for d in range(world)])
    for s in range(world):
        assert torch.equal(outs[s], _block(s, rank, n)), s


def all_gather_exact(rank, world):
    n = 250001
    out = torch.empty(world * n, dtype=torch.float64)
    dist.all_gather_into_tensor(out, _block(rank, 0, n))
    assert torch.equal(out, torch.cat([_block(s, 0, n) for s in range(world)]))
    # In place: the input is this rank's own block of the output.
    out = torch.full((world * n,), -1.0, dtype=torch.float64)
    out[rank * n:(rank + 1) * n] = _block(rank, 1, n)
    dist.all_gather_into_tensor(out, out[rank * n:(rank + 1) * n])
    assert torch.equal(out, torch.cat([_block(s, 1, n) for s in range(world)]))
    outs = [torch.empty(n, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(outs, _block(rank, 2, n))
    for s in range(world):
        assert torch.equal(outs[s], _block(s, 2, n))


def rooted_ops_exact(rank, world):
    n = 400003
    for root in range(world):
        x = _block(root, 0, n) if rank == root else torch.zeros(n, dtype=torch.float64)
        dist.broadcast(x, src=root)
        assert torch.equal(x, _block(root, 0, n)), root
        gathered = [torch.empty(n, dtype=torch.float64) for _ in range(world)] if rank == root else None
        dist.gather(_block(rank, root, n), gathered, dst=root)
        if rank == root:
            for s in range(world):
                assert torch.equal(gathered[s], _block(s, root, n)), (root, s)
        got = torch.empty(n, dtype=torch.float64)
        dist.scatter(got, [_block(root, d, n) for d in range(world)] if rank == root else None, src=root)
        assert torch.equal(got, _block(root, rank, n)), root


def late_reader_after_a_timeout(rank, world):
    """The last rank comes after the others gave up on an all_to_all whose data it would read
    from their memory; they have changed that memory since. It must fail, not return it."""
    g = dist.new_group(timeout=timedelta(seconds=1))
    n = 1 << 18
    x = torch.cat([_block(rank, d, n) for d in range(world)])
    out = torch.zeros(world * n, dtype=torch.float64)
    if rank == world - 1:
        time.sleep(3)
    with pytest.raises(RuntimeError, match="Timed out|gave up|withdrew|aborted"):
        dist.all_to_all_single(out, x, group=g)
    x.fill_(-7.0)  # the caller's memory again
    dist.barrier()
    y = torch.cat([_block(rank, d, n) for d in range(world)])
    dist.all_to_all_single(out, y, group=g)
    assert torch.equal(out, torch.cat([_block(s, rank, n) for s in range(world)]))
    dist.destroy_process_group(g)


CASES = ["all_to_all_exact", "all_gather_exact", "rooted_ops_exact", "late_reader_after_a_timeout"]
