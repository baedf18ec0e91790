"""A short DistributedDataParallel training on backend "ep" ends with the same parameters as
the same training on gloo (both in one run, same seeds, same data), with dense gradients and with
the sparse gradients of nn.Embedding(sparse=True); an FSDP2 training ends with the parameters of
the same training in one process (cases_fsdp.py)."""

import torch
import torch.distributed as dist
import torch.nn as nn

import cases_fsdp
from harness import run_group


def _train(process_group, rank, steps=8):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    ddp = nn.parallel.DistributedDataParallel(model, process_group=process_group, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen)
        y = torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def ddp_matches_gloo(rank, world):
    gloo = dist.new_group(backend="gloo")
    ours = _train(dist.group.WORLD, rank)
    theirs = _train(gloo, rank)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # replicas agree with each other across ranks
    flat = torch.cat([p.reshape(-1) for p in ours])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    for other in everyone:
        assert torch.equal(other, flat)
    return float(flat.abs().sum())


def _train_sparse(process_group, rank, steps=6):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 8, sparse=True), nn.Linear(8, 1))
    ddp = nn.parallel.DistributedDataParallel(model, process_group=process_group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(2000 + rank)
    for _ in range(steps):
        ids = torch.randint(0, 50, (6, 3), generator=gen)  # repeated ids across and within ranks
        opt.zero_grad()
        ddp(ids).sum().backward()
        assert model[0].weight.grad.is_sparse
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def ddp_sparse_matches_gloo(rank, world):
    gloo = dist.new_group(backend="gloo")
    for a, b in zip(_train_sparse(dist.group.WORLD, rank), _train_sparse(gloo, rank)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_ddp_sparse_gradients_match_gloo():
    run_group(2, ddp_sparse_matches_gloo, timeout=300)


def test_ddp_matches_gloo():
    sums = run_group(3, ddp_matches_gloo, timeout=300)
    assert len(set(sums)) == 1


def test_fsdp2_matches_local():
    run_group(2, cases_fsdp.fsdp2_matches_local, timeout=240, pg_timeout=60)
