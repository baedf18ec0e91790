"""Collective cases run by test_collectives.py inside real process groups.

Every case computes, on every rank, the expected result from the inputs that each rank
is known to contribute (`inp(rank, ...)`), and compares exactly (or within a dtype's
rounding where the reduction divides)."""

import torch
import torch.distributed as dist

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
COMPLEX = [torch.complex64, torch.complex128]
ALL_DTYPES = FLOATS + INTS + [torch.bool] + COMPLEX
SIZES = [0, 1, 1000, 70000]  # 70000 float32 > the 64 KiB small-allreduce threshold

R = dist.ReduceOp


def inp(rank, n, dtype, small=False):
    """Rank `rank`'s input: small exact values so every reduction is exact in every dtype."""
    base = torch.arange(n, dtype=torch.int64)
    if dtype == torch.bool:
        return ((base + rank) % 3 == 0)
    if small:  # for PRODUCT: values in {1, 2}
        vals = (base + rank) % 2 + 1
    else:
        vals = (base * 7 + rank * 3) % 11 + 1
    if dtype.is_complex:
        return torch.complex(vals.double(), (vals % 3).double()).to(dtype)
    return vals.to(dtype)


def ops_for(dtype):
    if dtype == torch.bool:
        return [R.BAND, R.BOR, R.BXOR, R.MIN, R.MAX]
    if dtype.is_complex:
        return [R.SUM, R.AVG]  # torch views complex as real; it rejects the others
    if dtype.is_floating_point:
        return [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX]
    return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]


def reference(op, tensors, dtype):
    """The reduction of `tensors`, computed locally in a wide type, cast back to dtype."""
    if dtype == torch.bool:
        st = torch.stack(tensors)
        if op in (R.BAND, R.MIN):
            return st.all(0)
        if op in (R.BOR, R.MAX):
            return st.any(0)
        return (st.to(torch.int64).sum(0) % 2).bool()
    wide = torch.complex128 if dtype.is_complex else (torch.float64 if dtype.is_floating_point else torch.int64)
    st = torch.stack([t.to(wide) for t in tensors])
    if op == R.SUM:
        out = st.sum(0)
    elif op == R.AVG:
        out = st.sum(0) / len(tensors)
    elif op == R.PRODUCT:
        out = st.prod(0)
    elif op == R.MIN:
        out = st.min(0).values
    elif op == R.MAX:
        out = st.max(0).values
    else:
        acc = st[0].clone()
        for t in st[1:]:
            acc = acc & t if op == R.BAND else acc | t if op == R.BOR else acc ^ t
        out = acc
    return out.to(dtype)


def assert_close(got, want, dtype, what):
    if dtype in (torch.float16, torch.bfloat16):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2, msg=what)
    elif dtype.is_floating_point or dtype.is_complex:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=what)
    else:
        assert torch.equal(got, want), f"{what}: {got[:8]} != {want[:8]}"


def allreduce_every_dtype_and_op(rank, world):
    for dtype in ALL_DTYPES:
        for op in ops_for(dtype):
            for n in SIZES:
                small = op == R.PRODUCT
                x = inp(rank, n, dtype, small)
                dist.all_reduce(x, op=op)
                want = reference(op, [inp(r, n, dtype, small) for r in range(world)], dtype)
                assert_close(x, want, dtype, f"all_reduce {dtype} {op} n={n}")


def allreduce_large_dtypes_and_ops(rank, world):
    """Sizes that take the bandwidth routes (over tcp: the pipelined ring from 4 MiB), uneven
    against the group and the chunk size, several dtypes and ops."""
    for dtype, op in ((torch.float32, R.SUM), (torch.float32, R.AVG), (torch.float64, R.MAX), (torch.int64, R.SUM),
                      (torch.int32, R.BXOR), (torch.bfloat16, R.SUM), (torch.bool, R.BOR), (torch.uint8, R.MIN)):
        n = (5 << 20) // max(1, torch.empty(0, dtype=dtype).element_size()) + 13
        x = inp(rank, n, dtype)
        dist.all_reduce(x, op=op)
        want = reference(op, [inp(r, n, dtype) for r in range(world)], dtype)
        assert_close(x, want, dtype, f"all_reduce {dtype} {op} n={n}")


def allreduce_results_identical_across_ranks(rank, world):
    x = torch.randn(100000, generator=torch.Generator().manual_seed(rank))
    dist.all_reduce(x)
    outs = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(outs, x)
    for r in range(world):
        assert torch.equal(outs[r], x), "ranks disagree bit-wise on an allreduce result"


def allreduce_coalesced(rank, world):
    ts = [inp(rank, n, torch.float32) for n in (3, 0, 5000, 17)]
    with dist._coalescing_manager():
        for t in ts:
            dist.all_reduce(t)
    for n, t in zip((3, 0, 5000, 17), ts):
        assert torch.equal(t, reference(R.SUM, [inp(r, n, torch.float32) for r in range(world)], torch.float32))
    ts = [inp(rank, 10, torch.int64), inp(rank, 20, torch.int64)]
    dist.all_reduce_coalesced(ts, op=R.MAX)
    for n, t in zip((10, 20), ts):
        assert torch.equal(t, reference(R.MAX, [inp(r, n, torch.int64) for r in range(world)], torch.int64))


def broadcast_every_dtype_and_root(rank, world):
    for dtype in ALL_DTYPES:
        for root in range(world):
            for n in (0, 1, 5000):
                x = inp(rank, n, dtype) if rank == root else torch.zeros(n, dtype=dtype)
                dist.broadcast(x, src=root)
                assert torch.equal(x, inp(root, n, dtype)), f"broadcast {dtype} root={root} n={n}"


def reduce_every_root(rank, world):
    for root in range(world):
        for op in (R.SUM, R.MAX, R.PRODUCT):
            for dtype in (torch.float32, torch.int32, torch.bfloat16):
                x = inp(rank, 3000, dtype, small=True)
                dist.reduce(x, dst=root, op=op)
                if rank == root:
                    want = reference(op, [inp(r, 3000, dtype, small=True) for r in range(world)], dtype)
                    assert_close(x, want, dtype, f"reduce root={root} {op} {dtype}")


def all_gather_variants(rank, world):
    for dtype in (torch.float32, torch.int8, torch.bool, torch.complex64):
        for n in (0, 1, 3000):
            outs = [torch.empty(n, dtype=dtype) for _ in range(world)]
            dist.all_gather(outs, inp(rank, n, dtype))
            for r in range(world):
                assert torch.equal(outs[r], inp(r, n, dtype)), f"all_gather {dtype} n={n} from {r}"
            out = torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(out, inp(rank, n, dtype))
            assert torch.equal(out, torch.cat([inp(r, n, dtype) for r in range(world)]))
    # 2-D input, stacked output
    x = inp(rank, 12, torch.float32).view(3, 4)
    out = torch.empty(world, 3, 4)
    dist.all_gather_into_tensor(out, x)
    for r in range(world):
        assert torch.equal(out[r], inp(r, 12, torch.float32).view(3, 4))


def all_gather_into_tensor_coalesced(rank, world):
    sizes = (5, 0, 1000)
    outs = [torch.empty(world * n) for n in sizes]
    with dist._coalescing_manager():
        for o, n in zip(outs, sizes):
            dist.all_gather_into_tensor(o, inp(rank, n, torch.float32))
    for o, n in zip(outs, sizes):
        assert torch.equal(o, torch.cat([inp(r, n, torch.float32) for r in range(world)]))


def gather_scatter_every_root(rank, world):
    for root in range(world):
        for n in (0, 7, 4000):
            outs = [torch.empty(n, dtype=torch.int64) for _ in range(world)] if rank == root else None
            dist.gather(inp(rank, n, torch.int64), gather_list=outs, dst=root)
            if rank == root:
                for r in range(world):
                    assert torch.equal(outs[r], inp(r, n, torch.int64)), f"gather root={root} from {r}"
            out = torch.empty(n, dtype=torch.float64)
            ins = [inp(100 + r, n, torch.float64) for r in range(world)] if rank == root else None
            dist.scatter(out, scatter_list=ins, src=root)
            assert torch.equal(out, inp(100 + rank, n, torch.float64)), f"scatter root={root}"


def reduce_scatter_variants(rank, world):
    for op in (R.SUM, R.MIN, R.AVG):
        for n in (0, 1, 2000, 40000):
            dtype = torch.float32
            full = [inp(r, n * world, dtype) for r in range(world)]
            want = reference(op, full, dtype).chunk(world)[rank] if n else torch.empty(0)
            out = torch.empty(n)
            dist.reduce_scatter_tensor(out, full[rank], op=op)
            assert_close(out, want, dtype, f"reduce_scatter_tensor {op} n={n}")
            out2 = torch.empty(n)
            dist.reduce_scatter(out2, list(full[rank].chunk(world)) if n else [torch.empty(0)] * world, op=op)
            assert_close(out2, want, dtype, f"reduce_scatter {op} n={n}")


def reduce_scatter_tensor_coalesced(rank, world):
    sizes = (3, 100)
    ins = [inp(rank, n * world, torch.int32) for n in sizes]
    outs = [torch.empty(n, dtype=torch.int32) for n in sizes]
    with dist._coalescing_manager():
        for o, i in zip(outs, ins):
            dist.reduce_scatter_tensor(o, i)
    for o, n in zip(outs, sizes):
        want = reference(R.SUM, [inp(r, n * world, torch.int32) for r in range(world)], torch.int32)
        assert torch.equal(o, want.chunk(world)[rank])


def all_to_all_even_and_uneven(rank, world):
    # even split, 2-D rows
    x = torch.stack([inp(rank * world + d, 6, torch.float32) for d in range(world)]).view(world, 2, 3)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x)
    for s in range(world):
        assert torch.equal(out[s].reshape(-1), inp(s * world + rank, 6, torch.float32))
    # uneven: rank s sends (s + d) % 3 rows (some zero) of 5 elements to rank d
    send = [(rank + d) % 3 for d in range(world)]
    recv = [(s + rank) % 3 for s in range(world)]
    x = torch.cat([torch.full(((rank + d) % 3, 5), float(rank * 10 + d)) for d in range(world)])
    out = torch.empty(sum(recv), 5)
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send)
    want = torch.cat([torch.full(((s + rank) % 3, 5), float(s * 10 + rank)) for s in range(world)])
    assert torch.equal(out, want)
    # list form with different sizes per peer
    ins = [torch.full((rank + d + 1,), rank * 100 + d, dtype=torch.int16) for d in range(world)]
    outs = [torch.empty(s + rank + 1, dtype=torch.int16) for s in range(world)]
    dist.all_to_all(outs, ins)
    for s in range(world):
        assert torch.equal(outs[s], torch.full((s + rank + 1,), s * 100 + rank, dtype=torch.int16))


def all_to_all_in_place(rank, world):
    """Input and output are one tensor (small and large, even and uneven): exact."""
    for n in (1000, 1 << 19):
        x = torch.cat([torch.full((n,), float(rank * 10 + d)) for d in range(world)])
        dist.all_to_all_single(x, x)
        assert torch.equal(x, torch.cat([torch.full((n,), float(s * 10 + rank)) for s in range(world)])), n
    sizes = [(rank + d + 1) * 3000 for d in range(world)]  # rank r sends (r + d + 1) * 3000 to d
    total = sum(sizes)
    recv = [(s + rank + 1) * 3000 for s in range(world)]
    if total == sum(recv):  # one tensor serves both only when the totals agree
        x = torch.cat([torch.full((sizes[d],), float(rank * 10 + d)) for d in range(world)])
        dist.all_to_all_single(x, x, recv, sizes)
        assert torch.equal(x, torch.cat([torch.full((recv[s],), float(s * 10 + rank)) for s in range(world)]))
    # Pairs laid out differently in the output than in the input (from 3 ranks): rank r sends
    # ((d - r) % world + 1) units to d, so rows that arrive land where rows still to be sent lie.
    for unit in (7, 200003):
        sizes = [((d - rank) % world + 1) * unit for d in range(world)]
        recv = [((rank - s) % world + 1) * unit for s in range(world)]
        x = torch.cat([torch.arange(sizes[d], dtype=torch.float64) + 1e7 * (rank * world + d) for d in range(world)])
        dist.all_to_all_single(x, x, recv, sizes)
        ref = torch.cat([torch.arange(recv[s], dtype=torch.float64) + 1e7 * (s * world + rank) for s in range(world)])
        assert torch.equal(x, ref), unit


def send_recv_and_any_source(rank, world):
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    x = inp(rank, 5000, torch.float32)
    got = torch.empty(5000)
    reqs = [dist.isend(x, nxt), dist.irecv(got, prv)]
    for r in reqs:
        r.wait()
    assert torch.equal(got, inp(prv, 5000, torch.float32))
    # 2 MiB messages cross several mailbox slots
    big = inp(rank, 1 << 19, torch.float32)
    got = torch.empty(1 << 19)
    reqs = [dist.irecv(got, prv), dist.isend(big, nxt)]
    for r in reqs:
        r.wait()
    assert torch.equal(got, inp(prv, 1 << 19, torch.float32))
    # rank 0 receives from any source, once from every other rank
    if rank == 0:
        seen = set()
        for _ in range(world - 1):
            buf = torch.empty(10, dtype=torch.int64)
            src = dist.recv(buf)
            assert torch.equal(buf, torch.full((10,), src, dtype=torch.int64))
            seen.add(src)
        assert seen == set(range(1, world))
    else:
        dist.send(torch.full((10,), rank, dtype=torch.int64), 0)
    # tags
    if world >= 2 and rank in (0, 1):
        other = 1 - rank
        t = torch.tensor([rank + 0.5])
        if rank == 0:
            dist.send(t, other, tag=7)
        else:
            r = torch.empty(1)
            dist.recv(r, other, tag=7)
            assert r.item() == 0.5


def tags_out_of_order(rank, world):
    """isend(tag=2); isend(tag=1) against irecv(tag=1); irecv(tag=2): matched by (source, tag)."""
    if rank == 0:
        works = [dist.isend(torch.full((1000,), 2.0), 1, tag=2), dist.isend(torch.full((1000,), 1.0), 1, tag=1)]
    elif rank == 1:
        one, two = torch.empty(1000), torch.empty(1000)
        works = [dist.irecv(one, 0, tag=1), dist.irecv(two, 0, tag=2)]
    else:
        works = []
    for w in works:
        w.wait()
    if rank == 1:
        assert torch.all(one == 1.0) and torch.all(two == 2.0)


def sizes_up_to_64mib(rank, world):
    n = (16 << 20) // world * world  # about 64 MiB of float32, divisible by the group
    x = torch.full((n,), float(rank + 1))
    dist.all_reduce(x)
    assert torch.all(x == world * (world + 1) / 2)
    y = torch.full((n,), float(rank)) if rank == 0 else torch.empty(n)
    dist.broadcast(y, 0)
    assert torch.all(y == 0)
    per = n // world
    out = torch.empty(per * world)
    dist.all_gather_into_tensor(out, torch.full((per,), float(rank)))
    assert torch.equal(out, torch.arange(world, dtype=torch.float32).repeat_interleave(per))
    a2a = torch.empty(n)
    dist.all_to_all_single(a2a, torch.full((n,), float(rank)))
    assert torch.equal(a2a, torch.arange(world, dtype=torch.float32).repeat_interleave(n // world))


def async_ops_interleaved(rank, world):
    a = inp(rank, 50000, torch.float32)
    b = inp(rank, 10, torch.int64) if rank == 0 else torch.zeros(10, dtype=torch.int64)
    outs = [torch.empty(300) for _ in range(world)]
    c = inp(rank, 300, torch.float32)
    w1 = dist.all_reduce(a, async_op=True)
    w2 = dist.broadcast(b, 0, async_op=True)
    w3 = dist.all_gather(outs, c, async_op=True)
    fut = dist.all_reduce(torch.ones(4), async_op=True).get_future()
    w3.wait()
    w1.wait()
    w2.wait()
    assert torch.equal(a, reference(R.SUM, [inp(r, 50000, torch.float32) for r in range(world)], torch.float32))
    assert torch.equal(b, inp(0, 10, torch.int64))
    for r in range(world):
        assert torch.equal(outs[r], inp(r, 300, torch.float32))
    assert torch.equal(fut.wait()[0], torch.full((4,), float(world)))
    assert w1.is_completed()


def non_contiguous_tensors(rank, world):
    base = inp(rank, 600, torch.float32).view(20, 30)
    x = base.t()  # non-contiguous view, updated in place
    assert not x.is_contiguous()
    dist.all_reduce(x)
    want = reference(R.SUM, [inp(r, 600, torch.float32) for r in range(world)], torch.float32).view(20, 30)
    assert torch.equal(base, want)
    big = torch.zeros(world, 10, 2)
    outs = [big[r, :, 0] for r in range(world)]  # strided outputs
    dist.all_gather(outs, inp(rank, 20, torch.float32)[::2])
    for r in range(world):
        assert torch.equal(big[r, :, 0], inp(r, 20, torch.float32)[::2])
        assert torch.all(big[r, :, 1] == 0)
    y = torch.zeros(8, 2)[:, 0]
    if rank == 0:
        y.copy_(torch.arange(8.0))
    dist.broadcast(y, 0)
    assert torch.equal(y, torch.arange(8.0))


def subgroups(rank, world):
    evens = list(range(0, world, 2))
    g = dist.new_group(evens)
    x = torch.tensor([float(rank)])
    if rank in evens:
        dist.all_reduce(x, group=g)
        assert x.item() == sum(evens)
    h = dist.new_group([world - 1, 0] if world > 1 else [0])
    if rank in (0, world - 1):
        y = torch.tensor([rank + 1])
        dist.broadcast(y, src=world - 1, group=h)
        assert y.item() == world
    # the default group still works beside them
    z = torch.ones(3)
    dist.all_reduce(z)
    assert torch.equal(z, torch.full((3,), float(world)))
    dist.destroy_process_group(g)
    dist.destroy_process_group(h)


def sparse_all_reduce(rank, world):
    """all_reduce of sparse COO tensors sums them, as gloo does (SUM only): repeated indices,
    a rank with no entries, dense dimensions, integer values, async; checked against the dense
    sum of every rank's known input."""
    import pytest

    def sparse_input(r, dtype, dense):
        n = 0 if r == 1 else 3 + r
        idx = torch.tensor([[(5 * r + 3 * i) % 7 for i in range(n)], [(r + i) % 4 for i in range(n)]])
        shape = (n,) + ((3,) if dense else ())
        val = (torch.arange(n * (3 if dense else 1)).reshape(shape) + 10 * r + 1).to(dtype)
        return torch.sparse_coo_tensor(idx, val, (7, 4) + ((3,) if dense else ()), check_invariants=True)

    for dtype, dense in ((torch.float32, False), (torch.float64, True), (torch.int64, False), (torch.float16, True)):
        x = sparse_input(rank, dtype, dense)
        want = sum(sparse_input(r, dtype, dense).to_dense() for r in range(world))
        dist.all_reduce(x)
        assert x.is_sparse
        assert torch.equal(x.to_dense(), want), (dtype, dense, x.to_dense(), want)
    x = sparse_input(rank, torch.float32, False)
    w = dist.all_reduce(x, async_op=True)
    w.wait()
    assert torch.equal(x.to_dense(), sum(sparse_input(r, torch.float32, False).to_dense() for r in range(world)))
    empty = torch.sparse_coo_tensor(torch.zeros(2, 0, dtype=torch.long), torch.zeros(0), (7, 4), check_invariants=True)
    dist.all_reduce(empty)  # no rank has an entry
    assert empty.is_sparse and empty._nnz() == 0 and empty.shape == (7, 4)
    with pytest.raises(ValueError, match="only be summed"):
        dist.all_reduce(sparse_input(rank, torch.float32, False), op=dist.ReduceOp.MAX)
    # ranks that disagree on the shape all raise, naming the rank, and the group goes on
    bad = torch.sparse_coo_tensor(torch.zeros(2, 1, dtype=torch.long), torch.ones(1), (7, 4 + (rank == 0)),
                                  check_invariants=True)
    with pytest.raises(ValueError, match="differs from this rank's"):
        dist.all_reduce(bad)
    z = torch.ones(3)
    dist.all_reduce(z)
    assert torch.equal(z, torch.full((3,), float(world)))


CASES = [
    name for name, fn in list(globals().items())
    if callable(fn) and getattr(fn, "__module__", None) == __name__ and not name.startswith("_")
    and name not in ("inp", "ops_for", "reference", "assert_close")
]
