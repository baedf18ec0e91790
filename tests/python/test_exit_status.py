"""A script that leaves without destroy_process_group exits with its own status, every time.

Each rank issues async collectives whose futures carry Python callbacks, drops others unwaited,
and leaves through sys.exit (or an uncaught exception) while ops may still be completing. Before
moelink's atexit hook a worker thread could complete such an op during interpreter teardown and
abort the process ("terminate called without an active exception", exit 134)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from harness import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = 30  # per transport (each run: 2 ranks, one of three ways to leave)
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
SHARED = GPUS == 1 and os.environ.get("MOELINK_TEST_SHARE_GPU") == "1"

SCRIPT = textwrap.dedent("""
    import sys
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    import moelink  # noqa: F401
    rank, port, variant, device = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("ep", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    keep = []
    for i in range(20):
        w = dist.all_reduce(torch.full((1000,), float(rank), device=device), async_op=True)
        keep.append((w, w.get_future().then(lambda f: f.value()[0].sum())))
    for i in range(5):
        dist.all_reduce(torch.ones(100, device=device), async_op=True)  # dropped at once
    if variant == 1 and rank == 0:
        keep[0][0].wait()
    if variant == 2 and rank == 1:
        raise RuntimeError("leaving through an exception")
    sys.exit(3 + rank)
""")


def _run_group(transport, variant, device):
    port = free_port()
    env = dict(os.environ, MOELINK_TRANSPORT=transport)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(HERE, "..", "..", "integration"), env.get("PYTHONPATH", "")])
    return [subprocess.Popen([sys.executable, "-c", SCRIPT, str(r), str(port), str(variant), device], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in range(2)]


def _exits(transport, device, runs):
    failures = []
    for start in range(0, runs, 2):  # two groups at a time
        groups = [(run, _run_group(transport, run % 3, device)) for run in range(start, min(start + 2, runs))]
        for run, procs in groups:
            for rank, p in enumerate(procs):
                try:
                    _, err = p.communicate(timeout=120)
                except subprocess.TimeoutExpired:
                    p.kill()
                    _, err = p.communicate()
                want = 1 if (run % 3 == 2 and rank == 1) else 3 + rank
                if p.returncode != want:
                    tail = "\n".join(err.strip().splitlines()[-3:])
                    failures.append(f"run {run} rank {rank}: exit {p.returncode}, expected {want}: {tail}")
    assert not failures, f"{len(failures)} of {2 * runs} exits were not the script's own:\n" + "\n".join(failures[:10])


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_early_exit_keeps_the_scripts_status(transport):
    _exits(transport, "cpu", RUNS)


@pytest.mark.skipif(GPUS < 2 and not SHARED, reason="needs 2 GPUs (or MOELINK_TEST_SHARE_GPU=1 with one)")
def test_early_exit_with_cuda_ops_in_flight_keeps_the_scripts_status():
    _exits("auto", "cuda", 20)
