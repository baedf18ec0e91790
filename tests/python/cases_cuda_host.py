"""Collectives on CUDA tensors between hosts (route `host`, virtual hosts here): the host
pipeline's pieces at their boundaries and its ops captured in CUDA graphs. Cases of
cases_cuda.py (which names them in CASES), kept apart as the route's own."""

import os

import torch
import torch.distributed as dist

import moelink
from cuda_support import capture, dev, fails_with, reduce_ref, same, setting, value


def pair_counts(world, unit):
    """Elements rank q sends rank r in the uneven all-to-alls below: a different count for each
    pair (some empty, some several of `unit`)."""
    return [[(q * 5 + r * 3) % 7 * unit // 2 + (q + r) % 3 for r in range(world)] for q in range(world)]


def a2a_input(q, counts, salt, device):
    """Rank q's input of such an all-to-all: distinct, exact values by position."""
    n = sum(counts[q])
    return (torch.arange(n, device=device, dtype=torch.int64) * 3 + q * 1000 + salt) % 16_000_000


def a2a_expected(rank, counts, salt, device):
    """What `rank` receives: from each q, q's segment for it."""
    parts = []
    for q in range(len(counts)):
        x = a2a_input(q, counts, salt, device)
        off = sum(counts[q][:rank])
        parts.append(x[off:off + counts[q][rank]])
    return torch.cat(parts)


def host_graph_capture(rank, world):
    """Between hosts all_reduce, all_gather, reduce_scatter, broadcast and all_to_all are captured
    as pieces through the pinned ring (a host node hands each to the worker at every replay); the
    other ops refuse capture there with a clear error, and the group stays usable."""
    d = dev(rank)
    n, big = 4096, 100_003  # big: several pieces under MOELINK_HOST_PIECE_BYTES=65536
    x = torch.zeros(n, device=d)
    y = torch.zeros(big, device=d, dtype=torch.bfloat16)
    m = torch.zeros(big, device=d, dtype=torch.int64)
    g_in, g_out = torch.zeros(big, device=d), torch.empty(world * big, device=d)
    rs_in, rs_out = torch.zeros(world * n, device=d), torch.empty(n, device=d)
    b = torch.zeros(big, device=d)
    counts = pair_counts(world, 40_000)  # pairs of 0 to ~120k floats: many pieces each at 64 KiB
    a_in = torch.zeros(sum(counts[rank]), device=d)
    a_out = torch.full((sum(c[rank] for c in counts),), -1.0, device=d)
    dist.all_reduce(x)  # the group's first CUDA op sets its buffers up, outside the graph

    def ops():
        dist.all_reduce(x)
        dist.all_reduce(y, op=dist.ReduceOp.AVG)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        dist.all_gather_into_tensor(g_out, g_in)
        dist.reduce_scatter_tensor(rs_out, rs_in)
        dist.broadcast(b, src=world - 1)
        dist.all_to_all_single(a_out, a_in, output_split_sizes=[c[rank] for c in counts],
                               input_split_sizes=counts[rank])

    graph = capture(ops)
    iota = torch.arange(big, device=d)
    for it in range(3):
        x.fill_(rank + it)
        y.copy_(((iota + rank + it) % 7).to(torch.bfloat16))
        m.copy_((iota * 3 + rank * 5 + it) % 11)
        g_in.copy_(iota.float() + rank * 10 + it)
        rs_in.copy_(torch.arange(world * n, device=d, dtype=torch.float32) + rank + it)
        b.copy_(iota.float() + it if rank == world - 1 else torch.zeros_like(b))
        a_in.copy_(a2a_input(rank, counts, it, d).float())
        graph.replay()
        torch.cuda.synchronize()
        same(x, torch.full_like(x, float(sum(r + it for r in range(world)))), f"graph all_reduce {it}")
        same(y, sum(((iota + r + it) % 7).float() for r in range(world)).div(world).to(torch.bfloat16),
             f"graph all_reduce AVG {it}")
        same(m, torch.stack([(iota * 3 + r * 5 + it) % 11 for r in range(world)]).amax(0), f"graph all_reduce MAX {it}")
        same(g_out, torch.cat([iota.float() + r * 10 + it for r in range(world)]), f"graph all_gather {it}")
        base = torch.arange(world * n, device=d, dtype=torch.float32).view(world, n)[rank]
        same(rs_out, base * world + sum(r + it for r in range(world)), f"graph reduce_scatter {it}")
        same(b, iota.float() + it, f"graph broadcast {it}")
        same(a_out, a2a_expected(rank, counts, it, d).float(), f"graph uneven all_to_all_single {it}")
    # reduce stages the whole tensor at once there: not capturable, said before anything is queued.
    r_buf = torch.zeros(n, device=d)
    err = ""
    try:
        capture(lambda: dist.reduce(r_buf, dst=0))
    except Exception as e:  # noqa: BLE001
        err = str(e)
    assert "cannot be captured" in err and "broadcast and all_to_all can" in err, err
    torch.cuda.synchronize()
    z = torch.full((n,), rank + 1.0, device=d)
    dist.all_reduce(z)
    same(z, torch.full_like(z, float(sum(r + 1 for r in range(world)))), "all_reduce after a refused capture")


def host_pieces(rank, world):
    """The host pipeline at its piece boundaries (MOELINK_HOST_PIECE_BYTES, every op in pieces
    under MOELINK_HOST_PIPELINE_BYTES=0): sizes one below, at and one above 1 and 3 pieces, for
    all_reduce (several dtypes and ops), reduce_scatter, all_gather and broadcast, eager and
    async, and all-to-alls whose pairs end around piece boundaries (all_to_all_single with
    uneven splits, the list form), against each rank's own computation."""
    if "MOELINK_HOST_PIECE_BYTES" not in os.environ:
        return  # the "pieces" path of test_cuda_collectives.py
    piece = int(os.environ["MOELINK_HOST_PIECE_BYTES"])
    d = dev(rank)
    works = []
    for dtype, op in [(torch.float32, "SUM"), (torch.bfloat16, "AVG"), (torch.int64, "MAX"), (torch.int32, "PRODUCT"),
                      (torch.bool, "BOR"), (torch.complex64, "SUM")]:
        e = torch.empty((), dtype=dtype).element_size()
        per = piece // e
        for k in (1, 3):
            for n in (k * per - 1, k * per, k * per + 1):
                xs = [value(r, n, dtype if dtype != torch.complex64 else torch.float32, d) for r in range(world)]
                if dtype == torch.complex64:
                    xs = [torch.complex(v, v * 2) for v in xs]
                t = xs[rank].clone()
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
                ref = sum(xs) if dtype == torch.complex64 else reduce_ref(xs, op, world)
                same(t, ref.to(dtype), f"all_reduce {dtype} {op} n={n}")
    for k in (1, 3):
        # reduce_scatter: rows of piece / world bytes per rank and piece
        per = piece // (4 * world) // 4 * 4
        for n in (k * per - 1, k * per + 1):
            ins = [value(r, world * n, torch.float32, d, salt=1) for r in range(world)]
            out = torch.empty(n, device=d)
            dist.reduce_scatter_tensor(out, ins[rank])
            same(out, sum(ins).view(world, n)[rank], f"reduce_scatter n={n}")
        per = piece // world // 16 * 16  # all_gather: bytes per rank and piece
        for nb in (k * per - 1, k * per + 1):
            ins = [value(r, nb, torch.uint8, d, salt=2) for r in range(world)]
            out = torch.empty(world * nb, device=d, dtype=torch.uint8)
            works.append((dist.all_gather_into_tensor(out, ins[rank], async_op=True), out, torch.cat(ins), f"all_gather {nb}"))
        for nb in (k * piece - 1, k * piece + 1):
            b = value(0, nb, torch.uint8, d, salt=3) if rank == 0 else torch.zeros(nb, device=d, dtype=torch.uint8)
            dist.broadcast(b, src=0)
            same(b, value(0, nb, torch.uint8, d, salt=3), f"broadcast {nb}")
    # all_to_all (bytes per pair and piece: piece // world // 16 * 16): pairs one below, at and one
    # above 1 and 3 pieces of uint8, and empty ones, a different length for each pair
    per = piece // world // 16 * 16
    lens = [0, per - 1, per, per + 1, 3 * per - 1, 3 * per + 1, 1]
    for salt in range(3):
        counts = [[lens[(q * 5 + r * 3 + salt) % len(lens)] for r in range(world)] for q in range(world)]
        inp = (a2a_input(rank, counts, salt, d) % 251).to(torch.uint8)
        out = torch.empty(sum(c[rank] for c in counts), device=d, dtype=torch.uint8)
        w = dist.all_to_all_single(out, inp, output_split_sizes=[c[rank] for c in counts],
                                   input_split_sizes=counts[rank], async_op=salt == 1)
        works.append((w, out, (a2a_expected(rank, counts, salt, d) % 251).to(torch.uint8), f"all_to_all {salt}"))
    # the list form, float32, pairs of 1 to 3 pieces
    e_per = per // 4
    ins = [value(rank, (rank + q) % 3 * e_per + 1, torch.float32, d, salt=q) for q in range(world)]
    outs = [torch.empty((q + rank) % 3 * e_per + 1, device=d) for q in range(world)]
    dist.all_to_all(outs, ins)
    for q in range(world):
        same(outs[q], value(q, (q + rank) % 3 * e_per + 1, torch.float32, d, salt=rank), f"all_to_all list from {q}")
    for w, out, ref, what in works:
        if w is not None:
            w.wait()
        same(out, ref, what)


def two_level_group(world):
    """Whether this group is one of 2 hosts of world / 2 ranks: virtual ones
    (MOELINK_RANKS_PER_HOST, the "two_level" path of test_cuda_collectives.py) or named per rank
    (MOELINK_HOST_ID, test_two_level_interleaved_hosts)."""
    return world >= 4 and (os.environ.get("MOELINK_RANKS_PER_HOST") == str(world // 2)
                           or bool(os.environ.get("MOELINK_HOST_ID")))


def two_level_all_reduce(rank, world):
    """A group of 2 virtual hosts of world / 2 ranks (MOELINK_RANKS_PER_HOST): all_reduce in two
    levels (route `host+nvlink`: a reduce-scatter among a host's ranks on the in-host kernels, an
    all_reduce of each rank's block with the rank at its position on the other host through the
    host pipeline, an all-gather among the host's ranks), exact for every reduce op at every size,
    those that leave some rank of a host an empty block included, eager, async and captured in a
    CUDA graph; ranks of one host that disagree about an op's size fail it with the header check's
    words, and the group goes on; a group in which one rank sets MOELINK_HOST_TWO_LEVEL=0 runs flat
    on every rank, exact."""
    if not two_level_group(world):
        return  # the "two_level" path of test_cuda_collectives.py
    d = dev(rank)
    local = world // 2
    for dtype, op in [(torch.float32, "SUM"), (torch.float32, "AVG"), (torch.bfloat16, "AVG"), (torch.int64, "MAX"),
                      (torch.int32, "PRODUCT"), (torch.int32, "BXOR"), (torch.bool, "BOR"), (torch.float16, "MIN")]:
        unit = 16 // torch.empty((), dtype=dtype).element_size()  # a block starts on 16 bytes
        smallest = unit * (local - 1) + 1  # the smallest count whose last block is not empty
        for n in (0, 1, smallest - 1, smallest, 1000, 100_003, (1 << 18) + 1):
            xs = [value(r, n, dtype, d, salt=n % 7) for r in range(world)]
            t = xs[rank].clone()
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            same(t, reduce_ref(xs, op, world).to(dtype), f"two-level all_reduce {dtype} {op} n={n}")
    assert moelink.get_backend(dist.group.WORLD).cuda_path() == "host+nvlink", \
        moelink.get_backend(dist.group.WORLD).cuda_path()
    # async, two in flight, then one on a side stream
    a, b = (torch.full((70_001,), rank + k, device=d) for k in (1.0, 2.0))
    wa = dist.all_reduce(a, async_op=True)
    wb = dist.all_reduce(b, op=dist.ReduceOp.MAX, async_op=True)
    wa.wait()
    wb.wait()
    same(a, torch.full_like(a, float(sum(r + 1 for r in range(world)))), "two-level async all_reduce")
    same(b, torch.full_like(b, float(world + 1)), "two-level async all_reduce MAX")
    # captured: replayed with new inputs
    x = torch.zeros(50_007, device=d)
    y = torch.zeros(4, device=d)  # one rank of each host has an empty block
    graph = capture(lambda: (dist.all_reduce(x), dist.all_reduce(y, op=dist.ReduceOp.MAX)))
    iota = torch.arange(x.numel(), device=d, dtype=torch.float32)
    for it in range(3):
        x.copy_(iota * (rank + 1) + it)
        y.fill_(rank * 3 + it)
        graph.replay()
        torch.cuda.synchronize()
        same(x, iota * sum(r + 1 for r in range(world)) + world * it, f"two-level all_reduce in a graph {it}")
        same(y, torch.full_like(y, float((world - 1) * 3 + it)), f"small all_reduce in the same graph {it}")
    # the ranks of the first host disagree about the size (rank 0's is smaller): every rank fails
    # the op with the header check's words, and the next op is exact
    w = dist.all_reduce(torch.ones(4096 if rank == 0 else 8192, device=d), async_op=True)
    fails_with(w, "a two-level all_reduce that the ranks disagree about", "expects", "rank")
    z = torch.ones(70_000, device=d)
    dist.all_reduce(z)
    same(z, torch.full_like(z, float(world)), "two-level all_reduce after a disagreement")
    # one rank turns it off: every rank runs flat
    with setting("MOELINK_HOST_TWO_LEVEL", "0" if rank == 0 else "1"):
        g = dist.new_group()
        z = torch.full((1 << 20,), rank + 1.0, device=d)
        dist.all_reduce(z, group=g)
        same(z, torch.full_like(z, float(sum(r + 1 for r in range(world)))), "all_reduce, two levels turned off")
        assert moelink.get_backend(g).cuda_path() == "host", moelink.get_backend(g).cuda_path()
        dist.destroy_process_group(g)


def two_level_all_gather(rank, world):
    """all_gather in two levels (route `host+nvlink`: each rank's block to the ranks at its position
    on the other hosts through the host pipeline, then every rail's blocks among a host's ranks on
    the in-host kernels, placed by rank): exact for every dtype at every size (empty included), as
    all_gather_into_tensor and as all_gather into a list, async and captured in a CUDA graph (an
    all_reduce beside it); ranks that disagree about the size fail it with the header check's
    words, and the group goes on."""
    if not two_level_group(world):
        return
    d = dev(rank)

    def block(r, n, dtype, salt):
        if dtype == torch.complex64:
            return torch.complex(value(r, n, torch.float32, d, salt), value(r, n, torch.float32, d, salt + 1))
        return value(r, n, dtype, d, salt)

    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8, torch.complex64):
        for n in (0, 1, 7, 1000, 100_003, (1 << 18) + 1):
            xs = [block(r, n, dtype, n % 5) for r in range(world)]
            out = torch.empty(world * n, dtype=dtype, device=d)
            dist.all_gather_into_tensor(out, xs[rank])
            same(out, torch.cat(xs), f"two-level all_gather {dtype} n={n}")
    assert moelink.get_backend(dist.group.WORLD).cuda_path() == "host+nvlink", \
        moelink.get_backend(dist.group.WORLD).cuda_path()
    # into a list, of 2-D blocks
    outs = [torch.empty(3, 1001, device=d) for _ in range(world)]
    dist.all_gather(outs, block(rank, 3003, torch.float32, 2).view(3, 1001))
    for r in range(world):
        same(outs[r], block(r, 3003, torch.float32, 2).view(3, 1001), f"two-level all_gather into a list, from {r}")
    # async, two in flight
    g1, g2 = torch.empty(world * 70_001, device=d), torch.empty(world * 9, device=d, dtype=torch.int32)
    w1 = dist.all_gather_into_tensor(g1, torch.full((70_001,), rank + 1.0, device=d), async_op=True)
    w2 = dist.all_gather_into_tensor(g2, torch.full((9,), rank * 7, device=d, dtype=torch.int32), async_op=True)
    w1.wait()
    w2.wait()
    same(g1, torch.cat([torch.full((70_001,), r + 1.0, device=d) for r in range(world)]), "two-level async all_gather")
    same(g2, torch.cat([torch.full((9,), r * 7, device=d, dtype=torch.int32) for r in range(world)]),
         "two-level async all_gather, small")
    # captured beside an all_reduce: replayed with new inputs
    x = torch.zeros(50_007, device=d)
    g = torch.empty(world * x.numel(), device=d)
    y = torch.zeros(6, device=d)
    graph = capture(lambda: (dist.all_gather_into_tensor(g, x), dist.all_reduce(y)))
    iota = torch.arange(x.numel(), device=d, dtype=torch.float32)
    for it in range(3):
        x.copy_(iota + 1000 * rank + it)
        y.fill_(rank + it)
        graph.replay()
        torch.cuda.synchronize()
        same(g, torch.cat([iota + 1000 * r + it for r in range(world)]), f"two-level all_gather in a graph {it}")
        same(y, torch.full_like(y, float(sum(r + it for r in range(world)))), f"all_reduce in the same graph {it}")
    # rank 0's block is smaller: every rank fails the op with the header check's words, and the
    # next op is exact
    m = 4096 if rank == 0 else 8192
    w = dist.all_gather_into_tensor(torch.empty(world * m, device=d), torch.ones(m, device=d), async_op=True)
    fails_with(w, "a two-level all_gather that the ranks disagree about", "expects", "rank")
    z = torch.empty(world * 5000, device=d)
    dist.all_gather_into_tensor(z, torch.full((5000,), float(rank), device=d))
    same(z, torch.cat([torch.full((5000,), float(r), device=d) for r in range(world)]),
         "two-level all_gather after a disagreement")


def two_level_broadcast(rank, world):
    """broadcast in two levels (route `host+nvlink`: the root's tensor to the ranks at its position
    on the other hosts through the host pipeline, then from each of them to its host's ranks on the
    in-host kernels): exact for every dtype at every size (empty included) from every root, async
    with two in flight from different roots, and captured in a CUDA graph beside an all_reduce;
    ranks that disagree about the size fail it with the header check's words, and the group goes
    on."""
    if not two_level_group(world):
        return
    d = dev(rank)
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8):
        for i, n in enumerate((0, 1, 7, 1000, 100_003, (1 << 18) + 1)):
            root = (i + world // 2) % world  # every position of both hosts
            want = value(root, n, dtype, d, n % 5)
            t = want.clone() if rank == root else torch.zeros(n, dtype=dtype, device=d)
            dist.broadcast(t, src=root)
            same(t, want, f"two-level broadcast {dtype} n={n} from {root}")
    assert moelink.get_backend(dist.group.WORLD).cuda_path() == "host+nvlink", \
        moelink.get_backend(dist.group.WORLD).cuda_path()
    # a 2-D tensor, a view of a larger one (not contiguous)
    base = torch.zeros(3, 2002, device=d)
    if rank == 1:
        base.copy_(value(1, 6006, torch.float32, d, 3).view(3, 2002))
    dist.broadcast(base[:, ::2], src=1)
    same(base[:, ::2], value(1, 6006, torch.float32, d, 3).view(3, 2002)[:, ::2], "two-level broadcast of a view")
    # async, two in flight from roots on different hosts and positions
    b1 = torch.full((70_001,), float(rank), device=d)
    b2 = torch.full((9,), rank * 7, device=d, dtype=torch.int32)
    w1 = dist.broadcast(b1, src=world - 1, async_op=True)
    w2 = dist.broadcast(b2, src=0, async_op=True)
    w1.wait()
    w2.wait()
    same(b1, torch.full_like(b1, float(world - 1)), "two-level async broadcast")
    same(b2, torch.zeros_like(b2), "two-level async broadcast, small")
    # captured beside an all_reduce: replayed with new inputs
    x = torch.zeros(50_007, device=d)
    y = torch.zeros(6, device=d)
    root = world // 2 + 1
    graph = capture(lambda: (dist.broadcast(x, src=root), dist.all_reduce(y)))
    iota = torch.arange(x.numel(), device=d, dtype=torch.float32)
    for it in range(3):
        x.copy_(iota + 1000 * rank + it)
        y.fill_(rank + it)
        graph.replay()
        torch.cuda.synchronize()
        same(x, iota + 1000 * root + it, f"two-level broadcast in a graph {it}")
        same(y, torch.full_like(y, float(sum(r + it for r in range(world)))), f"all_reduce in the same graph {it}")
    # rank 0's tensor is smaller: every rank fails the op with the header check's words, and the
    # next op is exact
    m = 4096 if rank == 0 else 8192
    w = dist.broadcast(torch.ones(m, device=d), src=world - 1, async_op=True)
    fails_with(w, "a two-level broadcast that the ranks disagree about", "expects", "rank")
    z = torch.full((5000,), float(rank), device=d)
    dist.broadcast(z, src=1)
    same(z, torch.full_like(z, 1.0), "two-level broadcast after a disagreement")


def two_level_reduce_scatter(rank, world):
    """reduce_scatter in two levels (route `host+nvlink`: a reduce-scatter among a host's ranks on
    the in-host kernels, each rank getting its rail's blocks reduced over the host, then a
    reduce-scatter of those among the rail through the host pipeline): exact for every reduce op at
    every size (empty included), as reduce_scatter_tensor and from a list, async and captured in a
    CUDA graph; ranks that disagree about the size fail it with the header check's words, and the
    group goes on."""
    if not two_level_group(world):
        return
    d = dev(rank)
    for dtype, op in [(torch.float32, "SUM"), (torch.float32, "AVG"), (torch.bfloat16, "AVG"), (torch.int64, "MAX"),
                      (torch.int32, "PRODUCT"), (torch.int32, "BXOR"), (torch.bool, "BOR"), (torch.float16, "MIN")]:
        for n in (0, 1, 7, 1000, 100_003, (1 << 18) + 1):
            xs = [value(r, world * n, dtype, d, salt=n % 7) for r in range(world)]
            out = torch.empty(n, dtype=dtype, device=d)
            dist.reduce_scatter_tensor(out, xs[rank], op=getattr(dist.ReduceOp, op))
            ref = reduce_ref([x[rank * n:(rank + 1) * n] for x in xs], op, world).to(dtype)
            same(out, ref, f"two-level reduce_scatter {dtype} {op} n={n}")
    assert moelink.get_backend(dist.group.WORLD).cuda_path() == "host+nvlink", \
        moelink.get_backend(dist.group.WORLD).cuda_path()
    # from a list of 2-D blocks
    out = torch.empty(3, 1001, device=d)
    dist.reduce_scatter(out, [torch.full((3, 1001), float(rank * 10 + q), device=d) for q in range(world)])
    same(out, torch.full_like(out, float(sum(r * 10 + rank for r in range(world)))), "two-level reduce_scatter, list")
    # async, two in flight
    o1, o2 = torch.empty(70_001, device=d), torch.empty(9, device=d, dtype=torch.int32)
    w1 = dist.reduce_scatter_tensor(o1, torch.full((world * 70_001,), rank + 1.0, device=d), async_op=True)
    w2 = dist.reduce_scatter_tensor(o2, torch.full((world * 9,), rank * 7, device=d, dtype=torch.int32),
                                    op=dist.ReduceOp.MAX, async_op=True)
    w1.wait()
    w2.wait()
    same(o1, torch.full_like(o1, float(sum(r + 1 for r in range(world)))), "two-level async reduce_scatter")
    same(o2, torch.full_like(o2, (world - 1) * 7), "two-level async reduce_scatter MAX")
    # captured beside an all_gather: replayed with new inputs
    x = torch.zeros(world * 50_007, device=d)
    o = torch.empty(50_007, device=d)
    g = torch.empty(world * 6, device=d)
    y = torch.zeros(6, device=d)
    graph = capture(lambda: (dist.reduce_scatter_tensor(o, x), dist.all_gather_into_tensor(g, y)))
    iota = torch.arange(x.numel(), device=d, dtype=torch.float32)
    for it in range(3):
        x.copy_(iota * (rank + 1) + it)
        y.fill_(rank + it)
        graph.replay()
        torch.cuda.synchronize()
        mine = iota[rank * o.numel():(rank + 1) * o.numel()]
        same(o, mine * sum(r + 1 for r in range(world)) + world * it, f"two-level reduce_scatter in a graph {it}")
        same(g, torch.cat([torch.full((6,), float(r + it), device=d) for r in range(world)]),
             f"all_gather in the same graph {it}")
    # rank 0's blocks are smaller: every rank fails the op with the header check's words, and the
    # next op is exact
    m = 4096 if rank == 0 else 8192
    w = dist.reduce_scatter_tensor(torch.empty(m, device=d), torch.ones(world * m, device=d), async_op=True)
    fails_with(w, "a two-level reduce_scatter that the ranks disagree about", "expects", "rank")
    z = torch.empty(5000, device=d)
    dist.reduce_scatter_tensor(z, torch.full((world * 5000,), float(rank), device=d))
    same(z, torch.full_like(z, float(sum(range(world)))), "two-level reduce_scatter after a disagreement")
