"""all_reduce on CUDA tensors above the one-shot sizes, on the staged kernel's two-shot exchange
(cases_cuda.py names them in CASES): values around its boundaries and its rounds, every dtype and
reduce op, in a graph, and ranks whose settings pick different plans."""

import torch
import torch.distributed as dist

import moelink

from cuda_support import all_reduce_view, dev, fails_with, graph_all_reduces, reduce_ref, same, setting, valid, value

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.bool, torch.complex64, torch.complex128)


def _check(rank, world, n, dtype, op, group=None, salt=0, what=""):
    d = dev(rank)
    xs = [value(r, n, dtype, d, salt=salt) for r in range(world)]
    x = xs[rank].clone()
    dist.all_reduce(x, op=getattr(dist.ReduceOp, op), group=group)
    same(x, reduce_ref(xs, op, world), f"all_reduce {dtype} {op} n={n} {what}")


def two_shot_staged(rank, world):
    """all_reduce above both one-shot sizes (each rank reduces its block of the buffer and sends
    each piece on to every peer as it is reduced, in one launch of the staged kernel): one element
    above the one-shot size and the two-shot Lamport limit, blocks of exactly one round (half a staging round) and one element more (two
    rounds, separate pushing and consuming blocks), blocks of two rounds and one element (a third, short round that reuses the first one's staging half),
    every dtype and reduce op, a view at an offset of 4 bytes (no 16-byte vectors), a CUDA graph
    replayed with new inputs, many short rounds (MOELINK_CUDA_ROUND_BYTES=65536), blocks that do
    both roles (MOELINK_CUDA_SPLIT=0), and the staged two-shot from the one-shot size up
    (MOELINK_CUDA_LAMPORT_TWO_SHOT_BYTES=0)."""
    tuning = moelink.cuda_tuning(world)
    lamport_two = tuning["lamport_two_shot_bytes"]
    half = tuning["round_bytes"] // 32 * 16  # bytes per pair and round of the two-shot exchange
    # float32 elements: blocks of one round, then one element more (the blocks are 16-byte aligned)
    one_round, two_rounds = world * half // 4, 2 * world * half // 4
    for n in (max(lamport_two, tuning["one_shot_bytes"]) // 4 + 1, one_round, one_round + 1, two_rounds + 1):
        for op in ("SUM", "MAX"):
            _check(rank, world, n, torch.float32, op, salt=n % 7)
    n = (3 << 20) // 4 + 5  # 3 MiB and a little: uneven blocks, the last one shorter
    for dtype in DTYPES:
        es = torch.empty(0, dtype=dtype).element_size()
        for op in ("SUM", "MAX", "MIN", "AVG", "PRODUCT", "BAND", "BOR", "BXOR"):
            if not valid(dtype, op) or (dtype.is_complex and op not in ("SUM", "AVG")):
                continue
            _check(rank, world, n * 4 // es, dtype, op, salt=3)
    all_reduce_view(rank, world, (4 << 20) // 4 + 3, 1, salt=13)  # 4 bytes in: no 16-byte vectors
    # in a graph beside a Lamport op, replayed with new inputs (and the op numbers of the replays)
    graph_all_reduces(rank, world, [one_round + 1, 1000], [(0, "SUM"), (1, "MAX"), (0, "MAX")],
                      "two-shot staged all_reduce")
    for name, val, sizes in (("MOELINK_CUDA_ROUND_BYTES", "65536", ((4 << 20) // 4 + 1, (3 << 20) // 4 + 77)),
                             ("MOELINK_CUDA_SPLIT", "0", (two_rounds + 1, one_round + 1)),
                             ("MOELINK_CUDA_LAMPORT_TWO_SHOT_BYTES", "0",
                              (tuning["one_shot_bytes"] // 4 + 1, lamport_two // 4 + 1))):
        with setting(name, val):
            g = dist.new_group()
            for k, n in enumerate(sizes):
                for op in ("SUM", "MIN"):
                    _check(rank, world, n, torch.float32, op, group=g, salt=k, what=f"{name}={val}")
            _check(rank, world, 2 * sizes[0], torch.bfloat16, "AVG", group=g, what=f"{name}={val}")
            dist.destroy_process_group(g)


def two_shot_staged_disagreement(rank, world):
    """Ranks with different MOELINK_CUDA_ONESHOT_BYTES run one all_reduce as different plans (one
    exchange, the two-shot staged one): it fails on every rank with the header check's words, and
    the group is usable after."""
    d = dev(rank)
    with setting("MOELINK_CUDA_ONESHOT_BYTES", str(64 << 20) if rank == 0 else str(1 << 20)):
        g = dist.new_group()
        dist.all_reduce(torch.ones(16, device=d), group=g)
        if moelink.get_backend(g).cuda_path() != "nvlink":  # the host route: one plan on every rank
            dist.destroy_process_group(g)
            return
        x = torch.ones((8 << 20) // 4, device=d)
        w = dist.all_reduce(x, group=g, async_op=True)
        fails_with(w, "an all_reduce that the ranks run as different plans",
                   "two-shot staged step", "MOELINK_CUDA_ONESHOT_BYTES")
        y = torch.full((1000,), float(rank), device=d)  # one plan on every rank at this size
        dist.all_reduce(y, group=g, op=dist.ReduceOp.MAX)
        same(y, torch.full_like(y, float(world - 1)), "all_reduce after the disagreement")
        dist.destroy_process_group(g)
