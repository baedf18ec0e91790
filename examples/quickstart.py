"""moelink quickstart: the standard collectives over backend "ep".

    torchrun --nproc-per-node 4 examples/quickstart.py

Every rank runs the collectives on CPU tensors, checks each result against what it
computes itself from every rank's known inputs, and rank 0 prints a line per op with the
transport used between ranks. With a GPU per rank it also runs one MoE dispatch + combine
round through moelink.Buffer (NVLink), checked the same way.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
import moelink  # noqa: E402  (registers backend "ep")


def value(rank: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + 100 * rank


def ep_round(rank: int, world: int) -> bool:
    """One MoE round on the GPUs: dispatch tokens to their top-2 experts, let every expert
    double its tokens, combine with the top-k weights; compare with the local expectation."""
    torch.cuda.set_device(rank)
    tokens, hidden, experts = 64, 1024, 8 * world
    buf = moelink.Buffer(None, tokens, hidden, experts)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).cuda()
    idx = torch.rand(tokens, experts, generator=g).topk(2, dim=1).indices.cuda()
    w = torch.rand(tokens, 2, generator=g).cuda()
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, tokens, experts, use_fp8=False)
    out, _, _ = buf.low_latency_combine((recv_x.float() * 2).to(torch.bfloat16), idx, w, handle)
    want = (x.float() * 2) * w.sum(1, keepdim=True)
    return torch.allclose(out.float(), want, rtol=2e-2, atol=5e-2)


def main() -> None:
    dist.init_process_group(backend="ep")
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 1 << 16
    log = []

    def check(name, ok, t0):
        log.append((name, ok, (time.perf_counter() - t0) * 1e3))
        if not ok:
            raise SystemExit(f"rank {rank}: {name} produced a wrong result")

    t0 = time.perf_counter()
    x = value(rank, n)
    dist.all_reduce(x)
    check("all_reduce", torch.equal(x, sum(value(r, n) for r in range(world))), t0)

    t0 = time.perf_counter()
    outs = [torch.empty(n) for _ in range(world)]
    dist.all_gather(outs, value(rank, n))
    check("all_gather", all(torch.equal(outs[r], value(r, n)) for r in range(world)), t0)

    t0 = time.perf_counter()
    y = value(rank, n) if rank == 0 else torch.zeros(n)
    dist.broadcast(y, src=0)
    check("broadcast", torch.equal(y, value(0, n)), t0)

    t0 = time.perf_counter()
    out = torch.empty(n // world)
    # reduce_scatter_single is the newer name (torch 2.14 deprecates reduce_scatter_tensor).
    getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, value(rank, n))
    full = sum(value(r, n) for r in range(world))
    check("reduce_scatter", torch.equal(out, full.chunk(world)[rank]), t0)

    t0 = time.perf_counter()
    a2a_out = torch.empty(n)
    dist.all_to_all_single(a2a_out, value(rank, n))
    expect = torch.cat([value(r, n).chunk(world)[rank] for r in range(world)])
    check("all_to_all_single", torch.equal(a2a_out, expect), t0)

    t0 = time.perf_counter()
    if world > 1:
        if rank == 0:
            dist.send(value(0, 16), dst=1)
        elif rank == 1:
            got = torch.empty(16)
            dist.recv(got, src=0)
            check("send/recv", torch.equal(got, value(0, 16)), t0)
    dist.barrier()

    if torch.cuda.is_available() and torch.cuda.device_count() >= world and moelink._C.HAS_CUDA:
        t0 = time.perf_counter()
        check("ep dispatch/combine", ep_round(rank, world), t0)

    if rank == 0:
        peers = {moelink.transport_of(r) for r in range(world) if r != rank} or {"local"}
        print(f"moelink quickstart: {world} ranks, backend 'ep', transport {'/'.join(sorted(peers))}")
        for name, ok, ms in log:
            print(f"  {name:<18} {'ok' if ok else 'WRONG':<6} {ms:8.2f} ms")
        print("all results match the local reference")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
