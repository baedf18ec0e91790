"""A job leaves /dev/shm as it found it once its processes are gone: after a script that ends
without destroy_process_group, and when a rank is SIGKILLed (its survivors reclaim its names
when they mask it out, and leave nothing themselves)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import torch
import torch.distributed as dist

from harness import free_port, run_group

HERE = os.path.dirname(os.path.abspath(__file__))


def names_of(pids) -> list:
    """moelink's names in /dev/shm that carry one of `pids` (moelink.<pid ns>.<pid>.<...>)."""
    out = []
    for name in os.listdir("/dev/shm"):
        parts = name.split(".")
        if len(parts) > 3 and parts[0] == "moelink" and parts[2] in {str(p) for p in pids}:
            out.append(name)
    return out


SCRIPT = textwrap.dedent("""
    import os, sys
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    import moelink  # noqa: F401
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("ep", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    x = torch.ones(1 << 16)
    dist.all_reduce(x)
    mine = [n for n in os.listdir("/dev/shm") if f".{os.getpid()}." in n]
    print("PID", os.getpid(), "NAMES", len(mine), flush=True)
    sys.exit(0)  # no destroy_process_group
""")


def test_exit_without_destroy_leaves_no_names():
    port = free_port()
    env = dict(os.environ, MOELINK_TRANSPORT="shm")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(HERE, "..", "..", "integration"), env.get("PYTHONPATH", "")])
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(r), str(port)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for r in range(2)]
    pids = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
        line = next(l for l in out.splitlines() if l.startswith("PID"))
        pids.append(int(line.split()[1]))
        assert int(line.split()[3]) >= 4, line  # the process had its names while it ran
    assert names_of(pids) == [], names_of(pids)


def killed_rank(rank, world):
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    x = torch.ones(1000)
    dist.all_reduce(x)  # the survivors find the rank gone and go on without it
    assert torch.all(x == world - 1)
    left = names_of([pids[-1]])
    assert left == [], f"the killed rank's names are still there: {left}"
    return pids


def test_killed_rank_names_are_reclaimed_by_the_survivors():
    results = run_group(3, killed_rank, env={"MOELINK_TRANSPORT": "shm"}, killed=(2,), timeout=180)
    pids = results[0]
    assert names_of(pids) == [], names_of(pids)
