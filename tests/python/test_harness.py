"""The multi-process harness itself: a rank that never returns is stopped at the timeout, and the
failure says where it was stuck (every thread's Python frames), so that a hang in a GPU or
multi-rank test is diagnosable from the test's own report."""

import time

import pytest

import harness


def stuck_forever(rank, world):
    while rank == 1:
        time.sleep(0.05)
    return rank


def test_a_hung_rank_is_reported_with_its_stacks():
    with pytest.raises(AssertionError) as e:
        harness.run_group(2, stuck_forever, timeout=15)
    msg = str(e.value)
    assert "'rank1'" in msg.splitlines()[0] and "did not finish within 15 s" in msg
    stacks = msg[msg.index("--- rank1: stacks when stopped ---"):]
    assert "in stuck_forever" in stacks and "test_harness.py" in stacks, msg


def test_store_ports_are_outside_the_ephemeral_range():
    """The launchers' store port (moelink._ports.free_port): bindable, never one the kernel hands
    to a socket that binds port 0, never the same twice in a process."""
    import socket

    from moelink._ports import _ephemeral_range, free_port

    lo, hi = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    for p in ports:
        assert not lo <= p <= hi, (p, lo, hi)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))
