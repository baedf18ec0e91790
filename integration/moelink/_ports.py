"""A TCP port for a local group's rendezvous store (the tests' and benchmarks' launchers).

Binding port 0 and closing the socket hands out a port of the kernel's ephemeral range, which
every other socket that binds port 0 (moelink's listeners, NCCL's, the store's clients) is served
from too: one of them can take it before the store binds it (EADDRINUSE). `free_port()` picks a
port below (or above) that range instead, where none of them can land.
"""

import os
import random
import socket
import time

_HANDED_OUT: set = set()


def _ephemeral_range() -> tuple:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port that binds now, outside the kernel's ephemeral range, never one this process has
    handed out before (an ephemeral one if 200 candidates were all busy)."""
    lo, hi = _ephemeral_range()
    span = (max(lo - 12000, 10000), lo) if lo > 12000 else (hi + 1, 65536)
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        port = rng.randrange(*span)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
