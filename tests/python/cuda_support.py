"""What the CUDA collective cases share: the devices, known inputs, reference reductions and the
comparison (cases_cuda.py, cases_cuda_host.py)."""

import contextlib
import os

import torch

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool]
SIZES = [0, 1, 1000, 1 << 18, (1 << 24) + 3]
REDUCE_OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def dev(rank):
    d = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(d)
    return d


def value(rank, n, dtype, device, salt=0):
    """Rank `rank`'s input: small values, exact in every dtype."""
    i = torch.arange(n, device=device, dtype=torch.int64)
    v = (i * 7 + rank * 13 + salt) % 5 + 1  # 1..5
    if dtype == torch.bool:
        return ((i + rank + salt) % 3) == 0
    if dtype == torch.uint8 or dtype == torch.int8:
        return v.to(dtype)
    return v.to(dtype)


def reduce_ref(xs, op, world):
    acc = xs[0].clone()
    for x in xs[1:]:
        if op in ("SUM", "AVG"):
            acc = (acc | x) if acc.dtype == torch.bool else acc + x
        elif op == "PRODUCT":
            acc = (acc & x) if acc.dtype == torch.bool else acc * x
        elif op == "MIN":
            acc = (acc & x) if acc.dtype == torch.bool else torch.minimum(acc, x)
        elif op == "MAX":
            acc = (acc | x) if acc.dtype == torch.bool else torch.maximum(acc, x)
        elif op == "BAND":
            acc = acc & x
        elif op == "BOR":
            acc = acc | x
        elif op == "BXOR":
            acc = acc ^ x
    if op == "AVG":
        acc = acc / world
    return acc


def valid(dtype, op):
    floating = dtype.is_floating_point
    if op in ("BAND", "BOR", "BXOR") and floating:
        return False
    if op == "AVG" and not floating:
        return False
    return True


def same(a, b, what):
    if a.dtype in (torch.float16, torch.bfloat16):
        ok = torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2)
    elif a.dtype.is_floating_point:
        ok = torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    else:
        ok = torch.equal(a, b)
    assert ok, f"{what}: got {a.flatten()[:8].tolist()}..., expected {b.flatten()[:8].tolist()}..."


def fails_with(work, what, *words):
    """The async op `work` fails: its future raises, naming every one of `words`."""
    try:
        work.get_future().wait()
    except RuntimeError as e:
        assert all(w in str(e) for w in words), e
        return
    raise AssertionError(f"{what} passed")


def capture(ops):
    """A CUDA graph of `ops()`, captured on a side stream that follows the current one (the
    group's first op must have run outside it); the current stream waits for the capture."""
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph, stream=s):
            ops()
    torch.cuda.current_stream().wait_stream(s)
    return graph


@contextlib.contextmanager
def setting(name, value):
    """`name` set to `value` in this process (read by the groups made meanwhile), then as it was."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def all_reduce_view(rank, world, n, offset, salt):
    """all_reduce (SUM) of an n-element float32 view `offset` elements into a larger buffer: the
    view holds the sum, the elements around it keep their value."""
    import torch.distributed as dist

    d = dev(rank)
    buf = torch.full((n + offset + 32,), -1.0, device=d)
    view = buf[offset:offset + n]
    view.copy_(value(rank, n, torch.float32, d, salt=salt))
    dist.all_reduce(view)
    same(view, reduce_ref([value(r, n, torch.float32, d, salt=salt) for r in range(world)], "SUM", world),
         f"all_reduce of a view at {offset}")
    same(buf[:offset], torch.full((offset,), -1.0, device=d), "before the view")
    same(buf[offset + n:], torch.full((32,), -1.0, device=d), "after the view")


def graph_all_reduces(rank, world, numels, ops, what, replays=3):
    """float32 tensors of `numels` elements, the all_reduces `ops` ((tensor index, op name), in
    order) captured in one CUDA graph and replayed with new inputs, each replay checked against
    the same ops applied to every rank's inputs here."""
    import torch.distributed as dist

    d = dev(rank)
    xs = [torch.zeros(n, device=d) for n in numels]
    dist.all_reduce(xs[0])  # the group's first op runs outside the capture
    graph = capture(lambda: [dist.all_reduce(xs[i], op=getattr(dist.ReduceOp, op)) for i, op in ops])
    for it in range(replays):
        want = [[value(r, n, torch.float32, d, salt=10 * it + i) for r in range(world)] for i, n in enumerate(numels)]
        for i, x in enumerate(xs):
            x.copy_(want[i][rank])
        graph.replay()
        torch.cuda.synchronize()
        for i, op in ops:
            want[i] = [reduce_ref(want[i], op, world)] * world
        for i, x in enumerate(xs):
            same(x, want[i][0], f"{what}: replay {it}, tensor {i}")
