"""The collectives benchmark (examples/bench/collectives.py) as a user runs it, on CPU tensors:
2 ranks beside gloo, every op at sizes on both sides of the tcp transport's striping threshold.
Each op and size is checked against a local reference before it is timed (check_op), so the run
fails on a wrong result; the test asserts the run passed and printed a row per op and size (no
speed is asserted)."""

import os
import re
import subprocess
import sys

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
