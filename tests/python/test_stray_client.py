"""A stray client on a live group's tcp port: garbage, a truncated handshake, a wrong secret, and,
with the right secret, frames aimed outside the registered segments, of unknown types, or cut
off mid-payload. No rank may crash, and the group's next ops must be exact."""

from __future__ import annotations

import socket
import struct
import time

import pytest
import torch
import torch.distributed as dist

from harness import run_group

MAGIC = 0x6D6F656C696E6B32  # wire::kHelloMagic ("moelink2")


def _hello(secret, rank=0, lane=0, session=0x5EED):
    return struct.pack("<QQiiQ", MAGIC, secret, rank, lane, session)


def _frame(ftype, segment, offset, length, request_id=1, flags=0):
    return struct.pack("<IIQIIQQ", ftype, 0, request_id, segment, flags, offset, length)


def _attack(address, secret):
    host, port = address.rsplit(":", 1)
    sends = [
        bytes(range(256)) * 16,                                      # garbage
        _hello(secret)[:8],                                          # truncated handshake
        _hello(secret ^ 0x5A5A) + _frame(1, 1, 0, 8) + b"x" * 8,     # wrong secret, then a write
        _hello(secret) + _frame(1, 999, 0, 8) + b"y" * 8,            # write to an unknown segment
        _hello(secret) + _frame(1, 1, 1 << 40, 8) + b"z" * 8,        # write far outside a segment
        _hello(secret) + _frame(1, 1, (1 << 64) - 4, 8) + b"w" * 8,  # offset + length overflows
        _hello(secret) + _frame(2, 1, 1 << 40, 64),                  # read outside a segment
        _hello(secret) + _frame(77, 1, 0, 16) + b"q" * 16,           # unknown frame type
        _hello(secret) + _frame(1, 1, 0, 1 << 40) + b"v" * 100,      # huge write cut off mid-payload
        _hello(secret) + _frame(1, 1, 0, 8)[:20],                    # header cut off
    ]
    for payload in sends:
        with socket.create_connection((host, int(port)), timeout=5) as s:
            try:
                s.sendall(payload)
                time.sleep(0.05)
            except OSError:
                pass  # the rank may close first: that is a fine answer


def stray_client(rank, world):
    import moelink

    backend = moelink.get_backend()
    addresses = [None] * world
    dist.all_gather_object(addresses, backend.tcp_address())
    secret = int(backend.store.get("engine/secret").decode())
    for i in range(3):
        x = torch.full((100000,), float(rank + i))
        dist.all_reduce(x)
        assert torch.all(x == sum(r + i for r in range(world)))
    dist.barrier()
    if rank == 0:
        for target in range(1, world):
            _attack(addresses[target], secret)
    dist.barrier()
    for i in range(10):  # exact after the attack, small and chunked sizes
        n = 10 if i % 2 else 300000
        x = torch.full((n,), float(rank * 3 + i))
        dist.all_reduce(x)
        assert torch.all(x == sum(r * 3 + i for r in range(world))), f"all_reduce {i} wrong after the attack"
        outs = [torch.empty(n) for _ in range(world)]
        dist.all_gather(outs, torch.full((n,), float(rank + i)))
        assert all(torch.all(outs[r] == r + i) for r in range(world)), f"all_gather {i} wrong after the attack"
    return True


def test_stray_client_on_the_tcp_port():
    assert run_group(3, stray_client, env={"MOELINK_TRANSPORT": "tcp"}, timeout=300) == [True] * 3


def _listener_address(rank, world):
    import moelink

    return moelink.get_backend().tcp_address()


def test_shm_group_listens_on_loopback_only():
    """A group held to shared memory has nothing on the network to talk to: its tcp listener
    binds the loopback address only."""
    addresses = run_group(2, _listener_address, env={"MOELINK_TRANSPORT": "shm"})
    assert all(a.startswith("127.0.0.1:") for a in addresses), addresses


def test_local_launch_listens_on_loopback_only():
    """Automatic transport, every rank reaching the store at 127.0.0.1 (a local launch): the
    group is on this host, and its listener binds the loopback address only."""
    addresses = run_group(2, _listener_address)
    assert all(a.startswith("127.0.0.1:") for a in addresses), addresses


def _interface_ip():
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: picks the outgoing interface
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def test_store_on_an_interface_listens_there():
    """A store reached at the host's address may have ranks on other hosts: the listener binds
    that interface (the first non-loopback one), as peers there need."""
    ip = _interface_ip()
    if ip is None:
        pytest.skip("no non-loopback IPv4 interface")
    addresses = run_group(2, _listener_address, store_host=ip)
    assert all(not a.startswith("127.") for a in addresses), addresses
