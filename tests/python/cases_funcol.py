"""Functional collectives (torch.distributed._functional_collectives, what DTensor and
torch.compile'd models call), one of them under torch.compile, and a DTensor over a device mesh,
on backend "ep" for CPU or CUDA tensors. Every result is checked against values each rank
computes itself."""

import warnings

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def _same(got, want, what):
    assert torch.equal(got.cpu(), want), f"{what}: got {got}, expected {want}"


def functional_and_dtensor(rank, world, device="cpu"):
    d = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    g = dist.group.WORLD
    total = float(sum(range(1, world + 1)))
    ranks = torch.arange(world, dtype=torch.float32)

    _same(funcol.all_reduce(torch.full((5,), rank + 1.0, device=d), "sum", g), torch.full((5,), total), "all_reduce")
    _same(funcol.all_reduce(torch.full((5,), rank + 1.0, device=d), "max", g), torch.full((5,), float(world)),
          "all_reduce max")
    _same(funcol.all_gather_tensor(torch.full((3,), float(rank), device=d), 0, g), ranks.repeat_interleave(3),
          "all_gather_tensor")
    _same(funcol.reduce_scatter_tensor(torch.full((world * 2,), rank + 1.0, device=d), "sum", 0, g),
          torch.full((2,), total), "reduce_scatter_tensor")
    _same(funcol.all_to_all_single(torch.full((world,), float(rank), device=d), None, None, g), ranks,
          "all_to_all_single")
    # Uneven splits: rank r sends q + 1 elements to rank q.
    x = torch.cat([torch.full((q + 1,), float(rank), device=d) for q in range(world)])
    got = funcol.all_to_all_single(x, [rank + 1] * world, [q + 1 for q in range(world)], g)
    _same(got, ranks.repeat_interleave(rank + 1), "all_to_all_single, uneven splits")
    _same(funcol.broadcast(torch.full((4,), float(rank), device=d), world - 1, g), torch.full((4,), world - 1.0),
          "broadcast")
    a, b = funcol.all_reduce_coalesced([torch.full((2,), rank + 1.0, device=d), torch.ones(3, device=d)], "sum", g)
    _same(a, torch.full((2,), total), "all_reduce_coalesced 0")
    _same(b, torch.full((3,), float(world)), "all_reduce_coalesced 1")
    a, b = funcol.all_gather_into_tensor_coalesced(
        [torch.full((2,), float(rank), device=d), torch.full((1,), 5.0 + rank, device=d)], g)
    _same(a, ranks.repeat_interleave(2), "all_gather_into_tensor_coalesced 0")
    _same(b, 5.0 + ranks, "all_gather_into_tensor_coalesced 1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        (c,) = funcol.reduce_scatter_tensor_coalesced([torch.full((world * 2,), rank + 1.0, device=d)], "sum", [0], g)
    _same(c, torch.full((2,), total), "reduce_scatter_tensor_coalesced")

    @torch.compile(backend="eager", fullgraph=True)
    def step(t):
        return funcol.all_reduce(t * 2, "sum", g) + 1

    _same(step(torch.full((4,), rank + 1.0, device=d)), torch.full((4,), 2 * total + 1), "compiled all_reduce")

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(device, (world,))
    full = torch.arange(world * 4, dtype=torch.float32)
    dt = distribute_tensor(full.to(d), mesh, [Shard(0)])
    _same(dt.to_local(), full[rank * 4:(rank + 1) * 4], "DTensor shard")
    _same(dt.redistribute(mesh, [Replicate()]).to_local(), full, "DTensor Shard -> Replicate")
    _same((dt * 2).sum().full_tensor(), full.sum() * 2, "DTensor sum")
    # The group works as before.
    t = torch.full((3,), rank + 1.0, device=d)
    dist.all_reduce(t)
    _same(t, torch.full((3,), total), "all_reduce after")
