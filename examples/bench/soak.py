"""Soak: N random collectives on backend "ep", every result checked.

    python examples/bench/soak.py [--nproc 4] [--ops 100000] [--transport shm,tcp] [--max-bytes 16777216]

Every rank draws the same sequence of ops from one seed: the op (all_reduce, reduce, broadcast,
all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single with random splits, gather,
scatter, barrier), the dtype, the size (log-uniform from 0 to --max-bytes), the root and whether
it runs async. Each rank's input is a function of (op, rank, index) that every rank can compute,
so each rank checks its output exactly against its own reference (small integers: exact in
every dtype). Prints ops/s, corruptions (wrong outputs), errors (exceptions) and hangs (a
transport's run that did not finish within --timeout) per transport; exits non-zero on any.
"""

import argparse
import math
import os
import random
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "integration"))
sys.path.insert(0, HERE)

OPS = ["all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter",
       "barrier"]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64, torch.uint8]


def plan(seed, k, world, max_bytes):
    """Op k of the sequence (the same on every rank)."""
    r = random.Random(seed * 1_000_003 + k)
    op = r.choice(OPS)
    dtype = r.choice(DTYPES)
    es = torch.tensor([], dtype=dtype).element_size()
    nbytes = 0 if r.random() < 0.03 else int(math.exp(r.uniform(0, math.log(max_bytes))))
    n = nbytes // es
    splits = [[r.randint(0, max(1, n // world)) for _ in range(world)] for _ in range(world)]
    return op, dtype, n, r.randrange(world), r.random() < 0.3, splits


def period(k, rank, offset=0):
    """The five values that rank's input for op k repeats, starting at element `offset`."""
    i = torch.arange(offset, offset + 5, dtype=torch.int64)
    return (i * 7 + rank * 3 + k) % 5 + 1  # 1..5: sums of 4 ranks are exact in bf16 and uint8


def tile(values, n, dtype):
    return values.to(dtype).repeat((n + 4) // 5)[:n]


def data(k, rank, n, dtype, offset=0):
    return tile(period(k, rank, offset), n, dtype)


def summed(k, world, n, dtype, offset=0):
    return tile(sum(period(k, q, offset) for q in range(world)), n, dtype)


def run_one(k, rank, world, spec):
    """Runs op k; returns the number of wrong output elements."""
    op, dtype, n, root, async_op, splits = spec
    wait = (lambda w: w.wait()) if async_op else (lambda w: None)
    if op == "barrier":
        wait(dist.barrier(async_op=async_op))
        return 0
    if op in ("all_reduce", "reduce"):
        x = data(k, rank, n, dtype)
        ref = summed(k, world, n, dtype)
        if op == "all_reduce":
            wait(dist.all_reduce(x, async_op=async_op))
            return int((x != ref).sum())
        wait(dist.reduce(x, dst=root, async_op=async_op))
        return int((x != ref).sum()) if rank == root else 0
    if op == "broadcast":
        x = data(k, rank, n, dtype)
        wait(dist.broadcast(x, src=root, async_op=async_op))
        return int((x != data(k, root, n, dtype)).sum())
    if op == "all_gather":
        out = torch.empty(world * n, dtype=dtype)
        wait(dist.all_gather_into_tensor(out, data(k, rank, n, dtype), async_op=async_op))
        return int((out != torch.cat([data(k, q, n, dtype) for q in range(world)])).sum())
    if op == "reduce_scatter":
        out = torch.empty(n, dtype=dtype)
        wait(dist.reduce_scatter_tensor(out, data(k, rank, world * n, dtype), async_op=async_op))
        ref = summed(k, world, n, dtype, offset=rank * n)
        return int((out != ref).sum())
    if op == "all_to_all":
        send = splits[rank]  # rows rank sends to each q
        recv = [splits[q][rank] for q in range(world)]
        inp = torch.cat([data(k, rank, send[q], dtype, offset=1000 * q) for q in range(world)])
        out = torch.empty(sum(recv), dtype=dtype)
        wait(dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send, async_op=async_op))
        ref = torch.cat([data(k, q, recv[q], dtype, offset=1000 * rank) for q in range(world)])
        return int((out != ref).sum())
    if op == "gather":
        outs = [torch.empty(n, dtype=dtype) for _ in range(world)] if rank == root else None
        wait(dist.gather(data(k, rank, n, dtype), gather_list=outs, dst=root, async_op=async_op))
        return sum(int((outs[q] != data(k, q, n, dtype)).sum()) for q in range(world)) if rank == root else 0
    if op == "scatter":
        ins = [data(k, q, n, dtype) for q in range(world)] if rank == root else None
        out = torch.empty(n, dtype=dtype)
        wait(dist.scatter(out, scatter_list=ins, src=root, async_op=async_op))
        return int((out != data(k, rank, n, dtype)).sum())
    raise ValueError(op)


def worker(rank, world, port, transport, ops, seed, max_bytes, q):
    os.environ["MOELINK_TRANSPORT"] = transport
    import moelink  # noqa: F401

    dist.init_process_group("ep", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    wrong = errors = 0
    first = ""
    t0 = time.perf_counter()
    for k in range(ops):
        spec = plan(seed, k, world, max_bytes)
        try:
            bad = run_one(k, rank, world, spec)
        except Exception as e:  # noqa: BLE001  counted and reported
            errors += 1
            first = first or f"op {k} {spec[0]} {spec[1]} n={spec[2]}: {e}"
            continue
        if bad:
            wrong += 1
            first = first or f"op {k} {spec[0]} {spec[1]} n={spec[2]}: {bad} wrong elements"
    elapsed = time.perf_counter() - t0
    q.put((rank, wrong, errors, elapsed, first))
    dist.destroy_process_group()


def soak(transport, nproc, ops, seed, max_bytes, timeout):
    """Returns (ops/s, corruptions, errors, hung, first problem)."""
    import torch.multiprocessing as mp

    from moelink._ports import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, nproc, port, transport, ops, seed, max_bytes, q))
             for r in range(nproc)]
    for p in procs:
        p.start()
    results, deadline = [], time.monotonic() + timeout
    while len(results) < nproc and time.monotonic() < deadline:
        try:
            results.append(q.get(timeout=1))
        except Exception:  # noqa: BLE001  queue.Empty: keep waiting until the deadline
            if not any(p.is_alive() for p in procs) and q.empty():
                break
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    hung = nproc - len(results)
    wrong = sum(r[1] for r in results)
    errors = sum(r[2] for r in results)
    elapsed = max((r[3] for r in results), default=float("nan"))
    first = next((r[4] for r in results if r[4]), "")
    return ops / elapsed, wrong, errors, hung, first


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--ops", type=int, default=100_000)
    ap.add_argument("--transport", default="shm,tcp")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-bytes", type=int, default=16 << 20)
    ap.add_argument("--timeout", type=float, default=7200, help="seconds per transport before counting a hang")
    args = ap.parse_args()
    print(f"# soak: {args.nproc} ranks, {args.ops} random ops, sizes 0..{args.max_bytes} bytes, seed {args.seed}, "
          f"torch {torch.__version__}")
    print(f"{'transport':<10}{'ops/s':>10}{'corrupt':>9}{'errors':>8}{'hung':>6}")
    bad = False
    for transport in args.transport.split(","):
        rate, wrong, errors, hung, first = soak(transport, args.nproc, args.ops, args.seed, args.max_bytes,
                                                args.timeout)
        print(f"{transport:<10}{rate:10.1f}{wrong:9d}{errors:8d}{hung:6d}")
        if first:
            print(f"  first problem: {first}")
        bad |= bool(wrong or errors or hung)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
