"""Broadcast on CUDA tensors above the one-shot size (cases_cuda.py names them in CASES): the
forwarding exchange's values around its boundaries, and ranks whose settings pick different plans."""

import torch
import torch.distributed as dist

import moelink

from cuda_support import dev, fails_with, same, setting, value


def broadcast_forwarded(rank, world):
    """Broadcast above the one-shot size (groups of more than 2: the root sends each rank its
    block, which that rank passes on to the others in the stores that place it, in one launch) from
    every root: at the one-shot boundary +-1 element, odd sizes (a last block shorter than the
    others, bytes that are no multiple of 16), blocks of more than one staging round (+-1 element
    around it) and of three rounds and a little (a round that reuses the first one's staging half),
    and with MOELINK_CUDA_SPLIT=0."""
    d = dev(rank)
    tuning = moelink.cuda_tuning(world)
    one_shot = tuning["one_shot_bytes"] or 1 << 20  # None: one exchange at every size (2 ranks: always)
    rounds = tuning["round_bytes"] * max(world - 1, 1)  # every block one full round
    cases = [(torch.float32, one_shot // 4 + k) for k in (-1, 0, 1)]
    cases += [(torch.uint8, one_shot + 20), (torch.float32, (4 << 20) // 4 + 3), (torch.bfloat16, 3 * one_shot + 7)]
    cases += [(torch.float32, rounds // 4 + k) for k in (-1, 1)] + [(torch.float32, 3 * rounds // 4 + 5)]
    for dtype, n in cases:
        for root in range(world):
            xs = [value(r, n, dtype, d, salt=root) for r in range(world)]
            x = xs[rank].clone()
            dist.broadcast(x, src=root)
            same(x, xs[root], f"broadcast {dtype} n={n} from {root}")
            del xs, x
    with setting("MOELINK_CUDA_SPLIT", "0"):
        g = dist.new_group()
        for n in (one_shot // 4 + 5, (5 << 20) // 4):
            xs = [value(r, n, torch.float32, d, salt=7) for r in range(world)]
            x = xs[rank].clone()
            dist.broadcast(x, src=world - 1, group=g)
            same(x, xs[world - 1], f"broadcast n={n} with MOELINK_CUDA_SPLIT=0")
            del xs, x
        dist.destroy_process_group(g)


def broadcast_disagreement(rank, world):
    """Ranks with different MOELINK_CUDA_ONESHOT_BYTES run one broadcast as different plans (one
    exchange, the forwarding one): it fails on every rank with the header check's words, and the
    group is usable after."""
    if world <= 2:
        return
    d = dev(rank)
    with setting("MOELINK_CUDA_ONESHOT_BYTES", str(4 << 20) if rank == 0 else str(1 << 20)):
        g = dist.new_group()
        dist.broadcast(torch.ones(16, device=d), src=0, group=g)
        if moelink.get_backend(g).cuda_path() != "nvlink":  # the host route: one plan on every rank
            dist.destroy_process_group(g)
            return
        x = torch.full(((2 << 20) // 4,), float(rank), device=d)
        w = dist.broadcast(x, src=world - 1, group=g, async_op=True)
        fails_with(w, "a broadcast that the ranks plan differently",
                   "forwarding broadcast step", "MOELINK_CUDA_ONESHOT_BYTES")
        y = torch.full((1000,), float(rank), device=d)
        dist.broadcast(y, src=1, group=g)
        same(y, torch.full_like(y, 1.0), "broadcast after the disagreement")
        dist.destroy_process_group(g)
