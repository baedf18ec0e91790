"""Collectives on CUDA tensors over backend "ep", one process per GPU (run by
test_cuda_collectives.py through harness.run_cases). Every result is checked against what each
rank computes itself from all ranks' known inputs, and a subset against NCCL on the same inputs."""

import os

import torch
import torch.distributed as dist

import moelink

import cases_fsdp
import cases_funcol
from cases_cuda_host import (host_graph_capture, host_pieces, two_level_all_gather,  # noqa: F401 (cases named in CASES)
                             two_level_all_reduce, two_level_broadcast, two_level_reduce_scatter)
from cases_cuda_broadcast import broadcast_disagreement, broadcast_forwarded  # noqa: F401 (cases named in CASES)
from cases_cuda_lamport import lamport_two_shot, two_shot_disagreement  # noqa: F401 (cases named in CASES)
from cases_cuda_allreduce import two_shot_staged, two_shot_staged_disagreement  # noqa: F401 (cases named in CASES)
from cuda_support import DTYPES, REDUCE_OPS, SIZES, capture, dev, fails_with, reduce_ref, same, setting, valid, value  # noqa: F401


def all_reduce_every_dtype_op_size(rank, world):
    d = dev(rank)
    for dtype in DTYPES:
        for op in REDUCE_OPS:
            if not valid(dtype, op):
                continue
            sizes = SIZES if dtype in (torch.float32, torch.bfloat16) and op in ("SUM", "MAX") else SIZES[:4]
            for n in sizes:
                xs = [value(r, n, dtype, d) for r in range(world)]
                x = xs[rank].clone()
                dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
                ref = reduce_ref(xs, op, world)
                if op == "AVG":
                    ref = ref.to(dtype)
                same(x, ref, f"all_reduce {dtype} {op} n={n}")


def movement_ops_every_dtype(rank, world):
    d = dev(rank)
    for dtype in DTYPES + [torch.complex64]:
        for n in SIZES[:4] + ([SIZES[4]] if dtype in (torch.float32, torch.uint8) else []):
            xs = [value(r, n, dtype, d, salt=3) if dtype != torch.complex64
                  else torch.complex(value(r, n, torch.float32, d), value(r, n, torch.float32, d, 1))
                  for r in range(world)]
            # broadcast from the last rank
            x = xs[rank].clone()
            dist.broadcast(x, src=world - 1)
            same(x, xs[world - 1], f"broadcast {dtype} n={n}")
            # all_gather_into_tensor and list all_gather
            out = torch.empty(world * n, dtype=dtype, device=d)
            dist.all_gather_into_tensor(out, xs[rank])
            same(out, torch.cat(xs), f"all_gather_into_tensor {dtype} n={n}")
            outs = [torch.empty(n, dtype=dtype, device=d) for _ in range(world)]
            dist.all_gather(outs, xs[rank])
            for r in range(world):
                same(outs[r], xs[r], f"all_gather {dtype} n={n} from {r}")
            # all_to_all_single, even
            m = n - n % world
            ins = [x[:m] for x in xs]
            o = torch.empty(m, dtype=dtype, device=d)
            dist.all_to_all_single(o, ins[rank])
            ref = torch.cat([ins[r].view(world, -1)[rank] for r in range(world)]) if m else o
            same(o, ref, f"all_to_all_single {dtype} n={m}")
            # gather / scatter to / from rank 0
            g = [torch.empty(n, dtype=dtype, device=d) for _ in range(world)] if rank == 0 else None
            dist.gather(xs[rank], gather_list=g, dst=0)
            if rank == 0:
                for r in range(world):
                    same(g[r], xs[r], f"gather {dtype} from {r}")
            s = torch.empty(n, dtype=dtype, device=d)
            dist.scatter(s, scatter_list=[xs[r] for r in range(world)] if rank == 0 else None, src=0)
            same(s, xs[rank], f"scatter {dtype}")


def reduce_scatter_and_reduce(rank, world):
    d = dev(rank)
    for dtype in [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8]:
        for op in ["SUM", "MAX", "MIN", "PRODUCT"]:
            for n in [0, 1, 1000, 1 << 18] + ([(1 << 22) + 3] if op == "SUM" else []):
                xs = [value(r, n * world, dtype, d) for r in range(world)]
                out = torch.empty(n, dtype=dtype, device=d)
                dist.reduce_scatter_tensor(out, xs[rank], op=getattr(dist.ReduceOp, op))
                ref = reduce_ref(xs, op, world).view(world, -1)[rank] if n else out
                same(out, ref, f"reduce_scatter_tensor {dtype} {op} n={n}")
                outl = torch.empty(n, dtype=dtype, device=d)
                dist.reduce_scatter(outl, list(xs[rank].chunk(world)) if n else [torch.empty(0, dtype=dtype, device=d)] * world,
                                    op=getattr(dist.ReduceOp, op))
                same(outl, ref, f"reduce_scatter {dtype} {op} n={n}")
                x = xs[rank].clone()
                dist.reduce(x, dst=world - 1, op=getattr(dist.ReduceOp, op))
                if rank == world - 1:
                    same(x, reduce_ref(xs, op, world), f"reduce {dtype} {op} n={n}")


def uneven_all_to_all(rank, world):
    d = dev(rank)
    # rank r sends (r + 1) * (q + 1) rows of 3 to rank q
    send = [(rank + 1) * (q + 1) for q in range(world)]
    recv = [(q + 1) * (rank + 1) for q in range(world)]
    inp = torch.cat([torch.full((send[q], 3), rank * 100 + q, dtype=torch.float32, device=d) for q in range(world)])
    out = torch.empty(sum(recv), 3, device=d)
    dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send)
    ref = torch.cat([torch.full((recv[q], 3), q * 100 + rank, dtype=torch.float32, device=d) for q in range(world)])
    same(out, ref, "uneven all_to_all_single")
    # list form with a non-contiguous input
    ins = [torch.full((4, 2), float(rank * 10 + q), device=d).t() for q in range(world)]
    outs = [torch.empty(2, 4, device=d) for _ in range(world)]
    dist.all_to_all(outs, ins)
    for q in range(world):
        same(outs[q], torch.full((2, 4), float(q * 10 + rank), device=d), "all_to_all list")


def in_place_all_to_all(rank, world):
    """all_to_all_single with the output as its input, at sizes within one round and across
    rounds. Rank r sends f((q - r) % world) rows to rank q (f(k) = k + 1), so that a rank's pairs
    are laid out differently in the output than in the input from 3 ranks on (rows that arrive
    land where rows still to be sent lie), alike at 2."""
    d = dev(rank)
    for rows_per_unit, width in ((1, 3), (700, 1024)):
        send = [((q - rank) % world + 1) * rows_per_unit for q in range(world)]
        recv = [((rank - q) % world + 1) * rows_per_unit for q in range(world)]
        assert sum(send) == sum(recv)
        x = torch.cat([torch.arange(send[q] * width, dtype=torch.int64, device=d).view(send[q], width)
                       + 10**8 * (rank * world + q) for q in range(world)])
        dist.all_to_all_single(x, x, output_split_sizes=recv, input_split_sizes=send)
        ref = torch.cat([torch.arange(recv[q] * width, dtype=torch.int64, device=d).view(recv[q], width)
                         + 10**8 * (q * world + rank) for q in range(world)])
        same(x, ref, f"in-place all_to_all_single, {rows_per_unit} row(s) per unit")


def all_to_all_mixed_protocols(rank, world):
    """An all-to-all whose pairs are long for some ranks and short for others: a rank with a long
    pair runs the staged kernel and sends its short pairs as Lamport lines, a rank whose pairs
    are all short runs the Lamport kernel; every rank gets every block, several times in a row
    (both parities of the Lamport area) and around ops of the other protocols."""
    d = dev(rank)
    limit = lamport_threshold(world)
    big = limit // 4 + 1000  # float32 elements: longer than any Lamport pair

    def count(src, dst):  # rank 0 -> rank 1 is long; the rest short (some empty)
        if src == 0 and dst == 1 % world:
            return big
        return (src * 7 + dst * 3) % 11 * 5

    for it in range(4):
        send = [count(rank, q) for q in range(world)]
        recv = [count(q, rank) for q in range(world)]
        inp = torch.cat([torch.arange(send[q], device=d, dtype=torch.float32) + 1000 * rank + 100 * q + it
                         for q in range(world)])
        out = torch.full((sum(recv),), -1.0, device=d)
        dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send)
        ref = torch.cat([torch.arange(recv[q], device=d, dtype=torch.float32) + 1000 * q + 100 * rank + it
                         for q in range(world)])
        same(out, ref, f"mixed all_to_all #{it}")
        x = torch.full((100,), float(rank + it), device=d)
        dist.all_reduce(x)
        same(x, torch.full_like(x, float(sum(r + it for r in range(world)))), f"all_reduce after #{it}")


def stream_order(rank, world):
    """Inputs written behind a long sleep, outputs read on the stream with no host sync."""
    d = dev(rank)
    n = 1 << 20
    x = torch.zeros(n, device=d)
    torch.cuda._sleep(200_000_000)  # ~100 ms on the current stream
    x.fill_(rank + 1.0)
    dist.all_reduce(x)
    y = x * 2  # queued after the op on the same stream
    g = torch.empty(world * n, device=d)
    torch.cuda._sleep(100_000_000)
    x.add_(1)
    dist.all_gather_into_tensor(g, x)
    z = g.clone()
    torch.cuda.synchronize()
    total = sum(r + 1.0 for r in range(world))
    same(y, torch.full_like(y, 2 * total), "all_reduce after sleep")
    same(z, torch.full_like(z, total + 1), "all_gather after sleep")


def async_interleaved(rank, world):
    d = dev(rank)
    xs = [torch.full((1000 * (k + 1),), float(rank + k), device=d) for k in range(6)]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    g = torch.empty(world * 10, device=d)
    wg = dist.all_gather_into_tensor(g, torch.full((10,), float(rank), device=d), async_op=True)
    for w in works:
        w.wait()
    wg.wait()
    fut = wg.get_future()
    fut.wait()
    assert wg.is_completed()
    for k, x in enumerate(xs):
        same(x, torch.full_like(x, float(sum(r + k for r in range(world)))), f"async all_reduce {k}")
    same(g, torch.cat([torch.full((10,), float(r), device=d) for r in range(world)]), "async all_gather")
    # is_completed is honest: not done while the stream sleeps
    torch.cuda._sleep(500_000_000)
    w = dist.all_reduce(torch.ones(10, device=d), async_op=True)
    early = w.is_completed()
    w.get_future().wait()
    assert w.is_completed()
    assert not early, "is_completed() was True while the op was queued behind a sleep"


def streams_sync_and_async(rank, world):
    """A synchronous op runs on the caller's current stream, an asynchronous one on the group's
    stream: whatever the mix of streams, a group's ops run on the GPU in the order issued (a
    misordered pair would meet the peer's other op and fail its header check)."""
    d = dev(rank)
    total = float(sum(r + 1 for r in range(world)))
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    a = torch.zeros(3000, device=d)
    b = torch.zeros(5000, device=d)
    c = torch.empty(world * 7, device=d)
    # a and b were made (zeroed) on the current stream: the side streams start behind that, as
    # a caller's must, or a zeroing still queued there could land after the fills below.
    s1.wait_stream(torch.cuda.current_stream())
    s2.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s1):
        torch.cuda._sleep(300_000_000)  # a is written late on s1
        a.fill_(rank + 1.0)
        wa = dist.all_reduce(a, async_op=True)
    with torch.cuda.stream(s2):  # idle stream: this op must still run after wa's
        b.fill_(rank + 1.0)
        dist.all_reduce(b)  # synchronous: on s2
        b2 = b * 2  # after it, on s2, no host sync
    with torch.cuda.stream(s1):
        wc = dist.all_gather_into_tensor(c, torch.full((7,), float(rank), device=d), async_op=True)
    x = torch.full((100,), rank + 1.0, device=d)
    dist.all_reduce(x)  # synchronous, on the default stream
    wa.wait()
    wc.wait()
    torch.cuda.synchronize()
    same(a, torch.full_like(a, total), "async all_reduce behind a sleep")
    same(b2, torch.full_like(b2, 2 * total), "sync all_reduce on a side stream")
    same(c, torch.cat([torch.full((7,), float(r), device=d) for r in range(world)]), "async all_gather")
    same(x, torch.full_like(x, total), "sync all_reduce on the default stream")
    # A synchronous op under a stream context, behind a sleep there.
    y = torch.zeros(1 << 16, device=d)
    s2.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s2):
        torch.cuda._sleep(100_000_000)
        y.fill_(rank + 1.0)
        dist.all_reduce(y, op=dist.ReduceOp.MAX)
        y2 = y + 1
    s2.synchronize()
    same(y2, torch.full_like(y2, float(world) + 1), "sync all_reduce behind a sleep on a side stream")
    if os.environ.get("MOELINK_RANKS_PER_HOST"):
        return
    # Both kinds in one capture.
    p, q = torch.zeros(64, device=d), torch.zeros(64, device=d)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s1):
        with torch.cuda.graph(graph, stream=s1):
            dist.all_reduce(p)
            w = dist.all_reduce(q, async_op=True)
            w.wait()
            dist.all_reduce(p)
    for it in range(2):
        p.fill_(rank + it)
        q.fill_(rank * 2.0)
        graph.replay()
        torch.cuda.synchronize()
        same(p, torch.full_like(p, world * float(sum(r + it for r in range(world)))), f"captured sync pair {it}")
        same(q, torch.full_like(q, float(sum(2 * r for r in range(world)))), f"captured async op {it}")


def small_op_burst(rank, world):
    """Back-to-back one-round ops of several kinds, the ranks now and then far apart (a sleep on
    one of them), with a two-round op here and there: a one-round op that follows a one-round
    op pushes before it has seen the peers' headers, into the other half of their areas."""
    d = dev(rank)
    checks = []
    for i in range(64):
        if rank == world - 1 and i % 7 == 3:
            torch.cuda._sleep(20_000_000)  # this rank falls behind
        x = torch.full((256 + i,), float(rank * 1000 + i), device=d)
        dist.all_reduce(x)
        checks.append((x, float(sum(r * 1000 + i for r in range(world))), f"all_reduce {i}"))
        g = torch.empty(world * 64, device=d)
        dist.all_gather_into_tensor(g, torch.full((64,), float(rank + i), device=d))
        checks.append((g, torch.cat([torch.full((64,), float(r + i), device=d) for r in range(world)]),
                       f"all_gather {i}"))
        b = torch.full((100,), float(rank + 10 * i), device=d)
        dist.broadcast(b, src=i % world)
        checks.append((b, float(i % world + 10 * i), f"broadcast {i}"))
        if i % 16 == 5:  # 12 MiB: two rounds of the default 8 MiB
            y = torch.full((3 << 20,), float(rank + i), device=d)
            dist.all_reduce(y)
            checks.append((y, float(sum(r + i for r in range(world))), f"two-round all_reduce {i}"))
    torch.cuda.synchronize()
    for t, want, what in checks:
        same(t, want if isinstance(want, torch.Tensor) else torch.full_like(t, want), what)


def host_route_on_disagreement(rank, world, name, value):
    """Ranks whose `name` differs (`value` of their rank) cannot share staging areas: a new group
    takes the host-staged route, exact, and says why."""
    with setting(name, value):
        g = dist.new_group()
        x = torch.full((4096,), rank + 1.0, device=dev(rank))
        dist.all_reduce(x, group=g)
        same(x, torch.full_like(x, float(sum(r + 1 for r in range(world)))), f"all_reduce ({name})")
        assert moelink.get_backend(g).cuda_path() == "host", moelink.get_backend(g).cuda_path()
        dist.destroy_process_group(g)


def round_size_disagreement(rank, world):
    """Ranks that stage rounds of different sizes (MOELINK_CUDA_ROUND_BYTES) would write past a
    peer's area: the host-staged route instead."""
    host_route_on_disagreement(rank, world, "MOELINK_CUDA_ROUND_BYTES", str((1 << 20) * (rank + 1)))


def mismatch_fails_then_usable(world, d, n, what, dtype=torch.float32, op=dist.ReduceOp.SUM, words="expects"):
    """An all_reduce of `n` elements of `dtype` with `op`, which the ranks disagree about, fails on
    this rank with the header check's words (through its future); an all_reduce after it is exact."""
    w = dist.all_reduce(torch.ones(n, device=d, dtype=dtype), op=op, async_op=True)
    fails_with(w, f"an all_reduce that the ranks disagree about {what}", words, "rank")
    y = torch.ones(16, device=d)
    dist.all_reduce(y)
    same(y, torch.full_like(y, float(world)), f"all_reduce after a mismatch {what}")


def lamport_threshold(world):
    """The largest pair the Lamport protocol carries in a group of `world`."""
    return moelink.cuda_tuning(world)["lamport_bytes"]


def lamport_boundaries(rank, world):
    """Every op whose pairs are one element below, at and above the Lamport threshold (so both
    protocols, back to back, in one group), in dtypes of 1, 2, 4 and 8 bytes and every reduce op
    that a dtype takes; and an op whose pairs are longer on some ranks than on others (one rank
    Lamport, the other staged) fails on every rank with the mismatch, the group usable after."""
    d = dev(rank)
    limit = lamport_threshold(world)
    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.float64):
        es = torch.empty(0, dtype=dtype).element_size()
        at = limit // es
        for n in (at - 1, at, at + 1):
            for op in ("SUM", "MAX", "AVG", "PRODUCT"):
                if not valid(dtype, op):
                    continue
                xs = [value(r, n, dtype, d) for r in range(world)]
                x = xs[rank].clone()
                dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
                same(x, reduce_ref(xs, op, world), f"all_reduce {dtype} {op} n={n}")
            xs = [value(r, n, dtype, d, salt=3) for r in range(world)]
            g = torch.empty(world * n, dtype=dtype, device=d)
            dist.all_gather_into_tensor(g, xs[rank])
            same(g, torch.cat(xs), f"all_gather {dtype} n={n}")
            b = xs[rank].clone()
            dist.broadcast(b, src=world - 1)
            same(b, xs[world - 1], f"broadcast {dtype} n={n}")
            ins = [value(r, n * world, dtype, d, salt=5) for r in range(world)]
            out = torch.empty(n, dtype=dtype, device=d)
            dist.reduce_scatter_tensor(out, ins[rank])
            same(out, reduce_ref(ins, "SUM", world).view(world, -1)[rank], f"reduce_scatter {dtype} n={n}")
            r = xs[rank].clone()
            dist.reduce(r, dst=0)
            if rank == 0:
                same(r, reduce_ref(xs, "SUM", world), f"reduce {dtype} n={n}")
            gl = [torch.empty(n, dtype=dtype, device=d) for _ in range(world)] if rank == 0 else None
            dist.gather(xs[rank], gather_list=gl, dst=0)
            if rank == 0:
                for q in range(world):
                    same(gl[q], xs[q], f"gather {dtype} n={n} from {q}")
            s = torch.empty(n, dtype=dtype, device=d)
            dist.scatter(s, scatter_list=[ins[0][q * n:(q + 1) * n] for q in range(world)] if rank == 0 else None,
                         src=0)
            same(s, ins[0][rank * n:(rank + 1) * n], f"scatter {dtype} n={n}")
    # the Lamport kernel's block size changes above the row's lamport_narrow_bytes (256 threads
    # per block up to it, lamport_threads above): pairs one element either side of it
    narrow = moelink.cuda_tuning(world)["lamport_narrow_bytes"]
    for dtype in (torch.float32, torch.bfloat16):
        at = narrow // torch.empty(0, dtype=dtype).element_size()
        for n in (at - 1, at, at + 1):
            if n * torch.empty(0, dtype=dtype).element_size() > limit:
                continue
            xs = [value(r, n, dtype, d, salt=7) for r in range(world)]
            x = xs[rank].clone()
            dist.all_reduce(x)
            same(x, reduce_ref(xs, "SUM", world), f"all_reduce {dtype} n={n} (block size)")
            g = torch.empty(world * n, dtype=dtype, device=d)
            dist.all_gather_into_tensor(g, xs[rank])
            same(g, torch.cat(xs), f"all_gather {dtype} n={n} (block size)")
    # complex: a SUM takes the Lamport protocol (complex64) or the staged one (complex128's
    # 16-byte elements); a copy op the Lamport protocol either way
    for dtype in (torch.complex64, torch.complex128):
        n = 100
        xs = [torch.complex(value(r, n, torch.float64, d), value(r, n, torch.float64, d, salt=1)).to(dtype)
              for r in range(world)]
        x = xs[rank].clone()
        dist.all_reduce(x)
        same(x, sum(xs), f"all_reduce {dtype}")
        g = torch.empty(world * n, dtype=dtype, device=d)
        dist.all_gather_into_tensor(g, xs[rank])
        same(g, torch.cat(xs), f"all_gather {dtype}")
    # one rank below the threshold, the others above: the protocols differ, the op fails with
    # the header check's words on every rank (not at its deadline)
    mismatch_fails_then_usable(world, d, limit // 4 + (1 if rank else 0), "across the Lamport threshold")


def plain_launch_beside_dependent(rank, world):
    """MOELINK_CUDA_PDL is a rank's own choice: in a group where rank 0 launches the Lamport kernel
    plainly and the others as programmatic dependents, small ops back to back, eager and replayed
    in a CUDA graph, are exact on the NVLink route."""
    if os.environ.get("MOELINK_RANKS_PER_HOST"):
        return  # the setting is the in-host kernel's
    # read at the group's first CUDA op
    with setting("MOELINK_CUDA_PDL", "0" if rank == 0 else "1"):
        g = dist.new_group()
        d = dev(rank)
        x = torch.empty(2048, device=d)
        ag = torch.empty(world * 512, device=d)
        a_out = torch.empty(world * 16, device=d)
        a_in = torch.empty(world * 16, device=d)

        def ops():
            for _ in range(3):
                dist.all_reduce(x, group=g)
            dist.all_gather_into_tensor(ag, x[:512], group=g)
            dist.all_to_all_single(a_out, a_in, group=g)

        def fill(it):
            x.fill_(rank + it)
            a_in.copy_(torch.arange(world * 16, device=d, dtype=torch.float32) + 100 * rank + it)

        def check(it, what):
            total = float(sum(r + it for r in range(world)) * world ** 2)  # three all_reduces
            same(x, torch.full_like(x, total), f"{what} all_reduce")
            same(ag, torch.full_like(ag, total), f"{what} all_gather")
            exp = torch.cat([(torch.arange(world * 16, device=d, dtype=torch.float32) + 100 * r + it)
                             .view(world, 16)[rank] for r in range(world)])
            same(a_out, exp, f"{what} all_to_all")

        fill(0)
        ops()
        check(0, "eager")
        assert moelink.get_backend(g).cuda_path() == "nvlink", moelink.get_backend(g).cuda_path()
        graph = capture(ops)
        for it in range(1, 4):
            fill(it)
            graph.replay()
            torch.cuda.synchronize()
            check(it, f"graph replay {it}")
        dist.destroy_process_group(g)


def lamport_disagreement(rank, world):
    """Ranks with different MOELINK_CUDA_LAMPORT_BYTES would pick different protocols for one op:
    the host-staged route instead."""
    host_route_on_disagreement(rank, world, "MOELINK_CUDA_LAMPORT_BYTES", "0" if rank == 0 else "65536")


def graph_capture(rank, world):
    if os.environ.get("MOELINK_RANKS_PER_HOST"):
        host_graph_capture(rank, world)
        return
    d = dev(rank)
    n = 4096
    x = torch.zeros(n, device=d)
    g_in = torch.zeros(n, device=d)
    g_out = torch.empty(world * n, device=d)
    rs_in = torch.zeros(world * n, device=d)
    rs_out = torch.empty(n, device=d)
    a_in = torch.zeros(world * 8, device=d)
    a_out = torch.empty(world * 8, device=d)
    dist.all_reduce(x)  # warm-up outside the graph

    def ops():
        dist.all_reduce(x)
        dist.all_gather_into_tensor(g_out, g_in)
        dist.reduce_scatter_tensor(rs_out, rs_in)
        dist.all_to_all_single(a_out, a_in)

    graph = capture(ops)
    for it in range(3):
        x.fill_(rank + it)
        g_in.fill_(rank * 10 + it)
        rs_in.copy_(torch.arange(world * n, device=d, dtype=torch.float32) + rank + it)
        a_in.copy_(torch.arange(world * 8, device=d, dtype=torch.float32) + 100 * rank)
        graph.replay()
        torch.cuda.synchronize()
        same(x, torch.full_like(x, float(sum(r + it for r in range(world)))), f"graph all_reduce {it}")
        same(g_out, torch.cat([torch.full((n,), float(r * 10 + it), device=d) for r in range(world)]), "graph all_gather")
        base = torch.arange(world * n, device=d, dtype=torch.float32).view(world, n)[rank]
        same(rs_out, base * world + sum(r + it for r in range(world)), "graph reduce_scatter")
        ref = torch.cat([(torch.arange(world * 8, device=d, dtype=torch.float32) + 100 * r).view(world, 8)[rank]
                         for r in range(world)])
        same(a_out, ref, "graph all_to_all")


def point_to_point(rank, world):
    d = dev(rank)
    peer = (rank + 1) % world
    src = (rank - 1) % world
    x = torch.full((1 << 20,), float(rank), device=d)
    y = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, src)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    same(y, torch.full_like(y, float(src)), "batch_isend_irecv")
    # recv posted first on both ranks, then send: no deadlock
    z = torch.empty(1000, device=d)
    wr = dist.irecv(z, src)
    ws = dist.isend(torch.full((1000,), rank + 0.5, device=d), peer)
    wr.wait()
    ws.wait()
    same(z, torch.full_like(z, src + 0.5), "irecv before isend")
    if rank == 0:
        got = torch.empty(10, device=d)
        sender = dist.recv(got)
        same(got, torch.full_like(got, float(sender)), "recv from any source")
    elif rank == 1:
        dist.send(torch.full((10,), 1.0, device=d), 0)


def near_sum(ours, nccl, parts, what):
    """float32: ours equals NCCL's. Half types: NCCL rounds to the dtype after every addition (in
    its ring's order), ep once after summing in float32: each within the rounding of len(parts)
    additions of the exact sum of `parts`."""
    if ours.dtype == torch.float32:
        same(ours, nccl, what)
        return
    exact = sum(v.float() for v in parts)
    eps = 2.0 ** -8 if ours.dtype == torch.bfloat16 else 2.0 ** -11
    bound = len(parts) * eps * sum(v.float().abs() for v in parts) + 1e-6
    for got, who in ((ours, "ep"), (nccl, "nccl")):
        err = (got.float() - exact).abs()
        assert bool((err <= bound).all()), (f"{what}: {who} is off the exact sum by {err.max().item()} (bound "
                                            f"there {bound[err.argmax()].item()})")


def against_nccl(rank, world):
    d = dev(rank)
    nccl = dist.new_group(backend="nccl")
    for dtype in [torch.float32, torch.bfloat16, torch.float16]:
        n = (1 << 20) + 5
        xs = [torch.randn(n, device=d, generator=torch.Generator(device=d).manual_seed(r)).to(dtype)
              for r in range(world)]
        x = xs[rank]
        a, b = x.clone(), x.clone()
        dist.all_reduce(a)
        dist.all_reduce(b, group=nccl)
        near_sum(a, b, xs, f"all_reduce vs nccl {dtype}")
        ga = torch.empty(world * n, dtype=dtype, device=d)
        gb = torch.empty_like(ga)
        dist.all_gather_into_tensor(ga, x)
        dist.all_gather_into_tensor(gb, x, group=nccl)
        assert torch.equal(ga, gb), "all_gather vs nccl"
        m = n - n % world
        ra = torch.empty(m // world, dtype=dtype, device=d)
        rb = torch.empty_like(ra)
        dist.reduce_scatter_tensor(ra, x[:m].contiguous())
        dist.reduce_scatter_tensor(rb, x[:m].contiguous(), group=nccl)
        near_sum(ra, rb, [v[:m].view(world, -1)[rank] for v in xs], f"reduce_scatter vs nccl {dtype}")
    dist.destroy_process_group(nccl)


def bad_input(rank, world):
    d = dev(rank)
    try:
        dist.all_gather_into_tensor(torch.empty(world * 4), torch.ones(4, device=d))
        raise AssertionError("mixed CPU/CUDA was accepted")
    except ValueError as e:
        assert "mixed" in str(e), e
    if torch.cuda.device_count() > 1:
        other = torch.device("cuda", (d.index + 1) % torch.cuda.device_count())
        try:
            dist.all_reduce(torch.ones(4, device=other))
            raise AssertionError("a tensor on another device was accepted")
        except ValueError as e:
            assert "cuda:" in str(e), e
    # a disagreement fails the op on every rank, with the CPU path's wording, and the group
    # stays usable
    mismatch_fails_then_usable(world, d, 4096 if rank == 0 else 8192, "of 4096 / 8192 elements")
    # the same size but not the same reduce op or dtype: every rank receives all of its data (the
    # Lamport kernel checks the header once the data is in), and the op still fails everywhere
    mismatch_fails_then_usable(world, d, 1024, "(SUM / MAX)", op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX,
                               words="reduces with")
    mismatch_fails_then_usable(world, d, 1024, "(float32 / int32)", dtype=torch.float32 if rank == 0 else torch.int32,
                               words="dtype")


def cpu_and_cuda_in_one_group(rank, world):
    d = dev(rank)
    c = torch.ones(100)
    g = torch.ones(100, device=d)
    dist.all_reduce(c)
    dist.all_reduce(g)
    dist.all_reduce(c)
    same(c, torch.full_like(c, float(world * world)), "CPU all_reduce")
    same(g, torch.full_like(g, float(world)), "CUDA all_reduce")


def ddp_matches_nccl(rank, world):
    """A few DDP training steps on "ep" and on NCCL from the same start: same parameters."""
    d = dev(rank)
    nccl = dist.new_group(backend="nccl")

    def train(group):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(d)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[d.index], process_group=group,
                                                        bucket_cap_mb=0.01)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator(device=d).manual_seed(100 + rank)
        for _ in range(5):
            loss = ddp(torch.randn(16, 32, device=d, generator=g)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        torch.cuda.synchronize()
        return [p.detach().clone() for p in model.parameters()]

    ours, theirs = train(dist.group.WORLD), train(nccl)
    for a, b in zip(ours, theirs):
        same(a, b, "DDP parameters, ep vs nccl")
    dist.destroy_process_group(nccl)


def c10d_extras(rank, world):
    """all_gather_coalesced, gather_into_tensor, PREMUL_SUM and Work.get_future_result() on CUDA
    tensors."""
    from torch._C._distributed_c10d import WorkResult

    d = dev(rank)
    w = dist.all_reduce(torch.ones(64, device=d), async_op=True)
    assert WorkResult(w.get_future_result().wait()) == WorkResult.SUCCESS
    w = dist.all_reduce(torch.ones(64 if rank == 0 else 128, device=d), async_op=True)
    assert WorkResult(w.get_future_result().wait()) == WorkResult.COMM_ERROR
    try:
        w.wait()
        torch.cuda.synchronize()
        raise AssertionError("an all_reduce of different sizes passed")
    except RuntimeError as e:
        assert "expects" in str(e), e
    total = float(sum(range(1, world + 1)))
    x = torch.full((1000,), float(rank + 1), device=d)
    dist.all_reduce(x, op=dist._make_nccl_premul_sum(2.0))
    same(x, torch.full((1000,), 2 * total, device=d), "premul_sum all_reduce")
    x = torch.full((1000,), float(rank + 1), device=d, dtype=torch.bfloat16)
    dist.all_reduce(x, op=dist._make_nccl_premul_sum(torch.tensor([0.5], device=d)))
    same(x, torch.full((1000,), 0.5 * total, device=d, dtype=torch.bfloat16), "premul_sum tensor factor")
    r = torch.empty(8, device=d)
    dist.reduce_scatter_tensor(r, torch.full((world * 8,), float(rank + 1), device=d),
                               op=dist._make_nccl_premul_sum(3.0))
    same(r, torch.full((8,), 3 * total, device=d), "premul_sum reduce_scatter_tensor")
    ins = [torch.full((3,), float(rank), device=d), torch.arange(4, device=d, dtype=torch.float32) + 10 * rank]
    outs = [[torch.empty(3, device=d), torch.empty(4, device=d)] for _ in range(world)]
    dist.all_gather_coalesced(outs, ins)
    for r in range(world):
        same(outs[r][0], torch.full((3,), float(r), device=d), "all_gather_coalesced 0")
        same(outs[r][1], torch.arange(4, device=d, dtype=torch.float32) + 10 * r, "all_gather_coalesced 1")
    if not hasattr(dist, "gather_into_tensor"):  # torch < 2.14 has no dist.gather_into_tensor
        return
    out = torch.empty(world * 4, device=d) if rank == 0 else None
    dist.gather_into_tensor(torch.full((4,), float(rank), device=d), out, dst=0)
    if rank == 0:
        same(out, torch.arange(world, device=d, dtype=torch.float32).repeat_interleave(4), "gather_into_tensor")


def sparse_all_reduce(rank, world):
    """all_reduce of a CUDA sparse COO tensor (through host memory): the sum of every rank's
    known input, on the caller's stream."""
    d = dev(rank)

    def make(r):
        n = 2 + r
        idx = torch.tensor([[(3 * r + i) % 5 for i in range(n)], [i % 2 for i in range(n)]])
        return torch.sparse_coo_tensor(idx, torch.arange(n, dtype=torch.float32) + r + 1, (5, 2), check_invariants=True)

    x = make(rank).to(d)
    dist.all_reduce(x)
    assert x.is_sparse and x.is_cuda
    same(x.to_dense(), sum(make(r).to_dense() for r in range(world)).to(d), "sparse all_reduce")


def functional_and_dtensor(rank, world):
    """Functional collectives (one under torch.compile) and a DTensor, on CUDA tensors."""
    cases_funcol.functional_and_dtensor(rank, world, device="cuda")


def fsdp2_matches_local(rank, world):
    """FSDP2 training on CUDA tensors against the same training in one process."""
    cases_fsdp.fsdp2_matches_local(rank, world, device="cuda")


CASES = ["all_reduce_every_dtype_op_size", "movement_ops_every_dtype", "reduce_scatter_and_reduce",
         "uneven_all_to_all", "in_place_all_to_all", "all_to_all_mixed_protocols", "broadcast_forwarded", "broadcast_disagreement", "stream_order", "async_interleaved", "streams_sync_and_async", "small_op_burst",
         "round_size_disagreement", "lamport_boundaries", "lamport_two_shot", "two_shot_disagreement",
         "two_shot_staged", "two_shot_staged_disagreement", "plain_launch_beside_dependent", "lamport_disagreement", "graph_capture", "host_pieces", "two_level_all_reduce", "two_level_all_gather", "two_level_broadcast", "two_level_reduce_scatter", "point_to_point", "against_nccl", "bad_input",
         "cpu_and_cuda_in_one_group", "ddp_matches_nccl", "c10d_extras", "sparse_all_reduce",
         "functional_and_dtensor", "fsdp2_matches_local"]
