"""The collectives benchmark (examples/bench/collectives.py) as a user runs it: on CPU tensors,
2 ranks beside gloo, every op at sizes on both sides of the tcp transport's striping threshold;
on CUDA tensors (2 GPUs, or one shared), with --graph, on the in-host and the host route.
Each op and size is checked against a local reference before it is timed (check_op), so the run
fails on a wrong result; the test asserts the run passed and printed a row per op and size (no
speed is asserted)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"]


def test_benchmark_checks_and_times_every_op(tmp_path):
    out = tmp_path / "collectives.png"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "integration"))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "bench", "collectives.py"), "--nproc", "2",
                        "--transport", "tcp", "--iters", "2", "--min-bytes", "4096", "--max-bytes", "1048576",
                        "--out", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    for op in OPS:
        rows = re.findall(rf"^{op}\s+(\S+ \S+)\s+[\d.]+\s+[\d.]+", r.stdout, re.M)
        assert rows == ["4 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB"], (op, rows, r.stdout)


def _gpus():
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


GPUS = _gpus()
SHARED = GPUS == 1 and os.environ.get("MOELINK_TEST_SHARE_GPU") in ("1", "4")


@pytest.mark.skipif(GPUS < 2 and not SHARED, reason="needs 2 GPUs (or MOELINK_TEST_SHARE_GPU=1 and one)")
@pytest.mark.parametrize("route", ["nvlink", "host"])
def test_benchmark_checks_graph_replays(tmp_path, route):
    """CUDA tensors with --graph: each op and size is checked eagerly and once more as a replay in
    a CUDA graph (check_graph, the result tensor overwritten before the replay) on the in-host
    route and on the host route (each rank a virtual host of its own), before it is timed."""
    out = tmp_path / "collectives.png"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "integration"))
    env.pop("MOELINK_RANKS_PER_HOST", None)
    if route == "host":
        env["MOELINK_RANKS_PER_HOST"] = "1"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "bench", "collectives.py"), "--device", "cuda",
                        "--gpus", "2", "--graph", "--no-anchor", "--transport", "auto", "--iters", "2",
                        "--min-bytes", "8192", "--max-bytes", "2097152", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    graph_table = r.stdout.split("replayed in a CUDA graph", 1)
    assert len(graph_table) == 2, r.stdout
    for op in OPS:
        rows = re.findall(rf"^{op}\s+(\S+ \S+)\s+[\d.]+", graph_table[1], re.M)
        assert rows == ["8 KiB", "32 KiB", "128 KiB", "512 KiB", "2 MiB"], (op, rows, r.stdout)
