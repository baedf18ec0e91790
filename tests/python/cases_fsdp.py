"""FSDP2 (`fully_shard`) training over backend "ep": after a few SGD steps the sharded model's
parameters match a model trained in one process on every rank's batch (the mean of the ranks'
losses), for CPU or CUDA tensors."""

import torch
import torch.distributed as dist
import torch.nn as nn


def fsdp2_matches_local(rank, world, device="cpu"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    d = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(d)

    ref, model = net(), net()
    mesh = init_device_mesh(device, (world,))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(4):
        xs = torch.randn(world, 8, 16, generator=torch.Generator().manual_seed(100 + step)).to(d)
        model(xs[rank]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        (sum(ref(xs[r]).pow(2).mean() for r in range(world)) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        full = p.full_tensor()
        assert torch.allclose(full, q, atol=1e-5), f"{name}: off by {(full - q).abs().max().item()}"
    t = torch.ones(2, device=d)
    dist.all_reduce(t)
    assert torch.equal(t.cpu(), torch.full((2,), float(world))), t
