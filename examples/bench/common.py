"""Scaffolding shared by the benchmark scripts: run one process per rank, collect rank 0's
rows, save a plot."""

import queue
import socket
import time

import torch.multiprocessing as mp


def run_ranks(worker, nprocs, args, timeout):
    """Spawns worker(rank, nprocs, port, *args, queue) for every rank and returns what rank 0
    puts on the queue."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, nprocs, port, *args, q)) for r in range(nprocs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    while True:  # rank 0's rows, or an error as soon as a rank has died without them
        try:
            rows = q.get(timeout=5)
            break
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise SystemExit(f"benchmark ranks {dead} failed (exit codes "
                                 f"{[procs[r].exitcode for r in dead]})" if dead else f"no result in {timeout} s")
    for p in procs:
        p.join()
    return rows


def save_plot(draw, out):
    """Calls draw(plt) and writes the figure to `out` as PNG (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig = draw(plt)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot written to {out}")


def fmt_bytes(b):
    """A byte count as the tables print it: 4 KiB, 1 MiB, ..."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024:
            return f"{b:g} {unit}"
        b /= 1024
    return f"{b:g} TiB"
