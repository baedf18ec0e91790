"""A short soak: 2,000 random collectives (op, dtype, size up to 16 MiB, root, async) on 4 ranks,
over shared memory and over tcp, every result checked by each rank against its own reference
(examples/bench/soak.py; 10^5-op runs are recorded in docs/PERF.md)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_soak_2000_ops(transport):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "bench", "soak.py"), "--ops", "2000",
                        "--transport", transport, "--timeout", "600", "--seed", "7"],
                       capture_output=True, text=True, timeout=900)
    table = "\n".join(line for line in r.stdout.splitlines() if not line.startswith("W"))
    assert r.returncode == 0, f"{table}\n{r.stderr[-3000:]}"
    assert f"{transport} " in table
