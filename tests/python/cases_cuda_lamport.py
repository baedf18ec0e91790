"""The two-shot Lamport all_reduce on CUDA tensors (cases_cuda.py names them in CASES): values
around both of its thresholds, in a graph, and ranks whose settings pick different kernels."""

import torch
import torch.distributed as dist

import moelink

from cuda_support import all_reduce_view, dev, fails_with, graph_all_reduces, reduce_ref, same, setting, valid, value


def lamport_two_shot(rank, world):
    """all_reduce above the one-shot Lamport exchange and up to the two-shot Lamport kernel's limit
    (groups of more than 2; `cuda_tuning(world)["lamport_two_shot_bytes"]`): one element either side
    of both thresholds, a size whose blocks differ in length, dtypes of 1, 2, 4 and 8 bytes and every
    reduce op a dtype takes, back to back with the staged two-shot above; in place and into a CUDA
    graph replayed with new inputs."""
    tuning = moelink.cuda_tuning(world)
    one, two = tuning["lamport_bytes"], tuning["lamport_two_shot_bytes"]
    if world <= 2 or not two:
        assert not two, tuning  # 2 ranks: one exchange moves as many bytes
        return
    d = dev(rank)
    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.bool, torch.complex64):
        es = torch.empty(0, dtype=dtype).element_size()
        sizes = [one // es + 1, (one + two) // (2 * es) + 3, two // es, two // es + 1]
        for n in sizes:
            for op in ("SUM", "MAX", "MIN", "AVG", "PRODUCT"):
                if not valid(dtype, op) or (dtype.is_complex and op not in ("SUM", "AVG")):
                    continue
                if dtype != torch.float32 and op not in ("SUM", "MAX") and n != sizes[1]:
                    continue  # every op at the middle size; the thresholds with SUM and MAX
                xs = [value(r, n, dtype, d, salt=11) for r in range(world)]
                x = xs[rank].clone()
                dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
                same(x, reduce_ref(xs, op, world), f"all_reduce {dtype} {op} n={n}")
    all_reduce_view(rank, world, one // 4 + 1001, 32, salt=13)  # only the view's elements change
    # in a graph, replayed with new inputs (and the op numbers of the replays)
    graph_all_reduces(rank, world, [two // 4, one // 4 + 1], [(0, "SUM"), (1, "MAX")], "two-shot Lamport all_reduce")


def two_shot_disagreement(rank, world):
    """Ranks with different MOELINK_CUDA_LAMPORT_TWO_SHOT_BYTES run one all_reduce on different
    kernels (the two-shot Lamport one, the staged one): it fails on every rank with the header
    check's words, and the group is usable after."""
    if world <= 2:
        return
    d = dev(rank)
    with setting("MOELINK_CUDA_LAMPORT_TWO_SHOT_BYTES", "0" if rank == 0 else str(2 << 20)):
        g = dist.new_group()
        x = torch.ones((1 << 20) // 4, device=d)
        dist.all_reduce(torch.ones(16, device=d), group=g)
        if moelink.get_backend(g).cuda_path() != "nvlink":  # the host route: one plan on every rank
            dist.destroy_process_group(g)
            return
        w = dist.all_reduce(x, group=g, async_op=True)
        fails_with(w, "an all_reduce that the ranks run on different kernels",
                   "two-shot Lamport step", "MOELINK_CUDA_LAMPORT_TWO_SHOT_BYTES")
        y = torch.ones(16, device=d)
        dist.all_reduce(y, group=g)
        same(y, torch.full_like(y, float(world)), "all_reduce after the disagreement")
        dist.destroy_process_group(g)
