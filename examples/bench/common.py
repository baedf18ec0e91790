"""Scaffolding shared by the benchmark scripts: run one process per rank, collect rank 0's
rows, save a plot."""

import os
import queue
import socket
import subprocess
import time

import torch.multiprocessing as mp


# NCCL on its socket transport over loopback, tuned as its users tune it (4 threads x 4 sockets):
# the anchor across (virtual) hosts.
NCCL_SOCKET = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket",
               "NCCL_SOCKET_IFNAME": "lo", "NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"}


def virtual_host(rank, ranks_per_host):
    """Makes this process's rank part of virtual host rank // ranks_per_host: its own
    MOELINK_HOST_ID, so that moelink talks tcp between such hosts as between real ones."""
    os.environ["MOELINK_HOST_ID"] = f"{socket.gethostname()}-vhost{rank // ranks_per_host}"


def run_built(build, name, args):
    """Runs the project's benchmark executable `name` from the build directory with `args` and
    returns its output lines; a missing executable or a failed run ends the script, saying why."""
    exe = os.path.join(build, name)
    if not os.path.exists(exe):
        raise SystemExit(f"{exe} not found: build the project first (scripts/install.sh or cmake)")
    out = subprocess.run([exe, *map(str, args)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{name} failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout.splitlines()


def run_ranks(worker, nprocs, args, timeout):
    """Spawns worker(rank, nprocs, port, *args, queue) for every rank and returns what rank 0
    puts on the queue."""
    from moelink._ports import free_port  # the scripts put integration/ on sys.path

    port = free_port()
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
