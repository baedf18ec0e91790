"""Peers' bytes are untrusted input (README, "Trust model").

- A foreign process that holds the group's secret writes a forged point-to-point message into a
  rank's mailbox, over the rank's tcp listener or through its shared memory: the recv it lands
  on fails with an error naming the peer and the field, no byte outside the recv's buffer
  changes, and the group's collectives go on.
- A process that claims a rank a live process holds (a second job on the same store address) is
  refused at init, naming the holder, and the group it tried to join goes on untouched.
- Ranks started with different world sizes fail at once, naming the difference.
- MOELINK_HOST_IP that is not an address of this host is refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from harness import free_port, run_group

CHUNK = 65536  # MOELINK_CHUNK_BYTES of these groups (the forger computes the mailbox layout)
DEPTH = 4
P2P_SEGMENT = 2
KIND_SEND, FIRST, LAST = 10, 1, 2
HERE = os.path.dirname(os.path.abspath(__file__))

FORGER = textwrap.dedent("""
    # Writes one message into rank 0's point-to-point mailbox as if rank `src` sent it.
    import mmap, socket, struct, sys
    how, where, secret, src, world, chunk, depth, nbytes, pair = sys.argv[1:10]
    secret, src, world, chunk, depth, nbytes, pair = map(int, (secret, src, world, chunk, depth, nbytes, pair))
    ring = depth + 1
    lines = lambda b: (b + 63) // 64 * 64
    slots = lines(world * ring * 8) + lines(world * 8) + lines(world * ring * 8) + lines(world * 8)
    slot_bytes = 64 + chunk
    at = slots + (src * ring + 1) * slot_bytes          # message 1 from src: slot 1
    sig = (src * ring + 1) * 8
    # MsgHeader: kind dtype redop flags root op_seq op_bytes pair_bytes bytes tag sender epoch pull_addr
    header = struct.pack("<BBBBiQQQQiiQQ", 10, 0, 0, 1 | 2, -1, 1, 0, pair, nbytes, 0, src, 0, 0)
    payload = b"\\xab" * min(nbytes, chunk)
    writes = [(at + 64, payload), (at, header), (sig, struct.pack("<Q", 1))]
    if how == "tcp":
        host, port = where.rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(struct.pack("<QQiiQ", 0x6D6F656C696E6B32, secret, src, 0, 0x5EED))  # wire::Hello, lane 0
        assert struct.unpack("<Q", s.recv(8))[0] == 0x6D6F656C696E6B32, "handshake refused"
        for i, (off, data) in enumerate(writes):
            flags = 1 if i == len(writes) - 1 else 0  # ring the doorbell with the signal
            s.sendall(struct.pack("<IIQIIQQ", 1, 0, 1 + i, 2, flags, off, len(data)) + data)  # requests 1, 2, 3
        ack = b""
        while len(ack) < 40 * len(writes):  # every write acknowledged: applied
            part = s.recv(4096)
            assert part, "connection closed"
            ack += part
        assert all(struct.unpack_from("<I", ack, 40 * i + 4)[0] == 0 for i in range(len(writes))), "write rejected"
    else:
        with open("/dev/shm" + where, "r+b") as f:
            m = mmap.mmap(f.fileno(), 0)
            for off, data in writes:
                m[off:off + len(data)] = data
            m.close()
""")


def _forge(how, where, secret, nbytes, pair):
    subprocess.run([sys.executable, "-c", FORGER, how, where, str(secret), "1", "2", str(CHUNK), str(DEPTH),
                    str(nbytes), str(pair)], check=True, timeout=60)


def forged_p2p_message(rank, world, how, nbytes):
    import moelink

    backend = moelink.get_backend()
    guard = 4096
    if rank == 0:
        secret = int(backend.store.get("engine/secret").decode())
        if how == "tcp":
            where = backend.tcp_address()
        else:
            inc = int(backend.store.add("engine/incarnation/0", 0))
            where = backend.store.get(f"engine/seg/0.{inc}/{P2P_SEGMENT}").decode().split()[3]
        buf = torch.zeros(16 + guard)
        work = dist.irecv(buf[:16], src=1)
        _forge(how, where, secret, nbytes, 64)
        with pytest.raises(RuntimeError) as e:
            work.wait()
        msg = str(e.value)
        assert "recv from rank 1 (tag 0): rank 1 sent a malformed message" in msg, msg
        field = "larger than a mailbox slot" if nbytes > CHUNK else f"a {nbytes}-byte piece after 0 of 64 bytes"
        assert field in msg, msg
        assert torch.count_nonzero(buf) == 0, "bytes of the forged message were written"
    dist.barrier()
    # The collectives go on, exact; the pair's real point-to-point stream is out of step now
    # (rank 0 took the forged message as rank 1's first), which rank 1's next send reports.
    for i in range(3):
        x = torch.full((1000,), float(rank + i))
        dist.all_reduce(x)
        assert torch.all(x == sum(r + i for r in range(world)))
    if rank == 1:
        with pytest.raises(RuntimeError, match="acknowledged 1 messages of this rank, which sent it 0"):
            dist.send(torch.ones(4), dst=0)
    dist.barrier()
    return True


@pytest.mark.parametrize("how", ["tcp", "shm"])
@pytest.mark.parametrize("nbytes", [4096, 1 << 40], ids=["past-the-recv", "2^40"])
def test_forged_p2p_message_fails_the_recv_cleanly(how, nbytes):
    env = {"MOELINK_TRANSPORT": how, "MOELINK_CHUNK_BYTES": str(CHUNK), "MOELINK_MAILBOX_DEPTH": str(DEPTH)}
    assert run_group(2, forged_p2p_message, kwargs={"how": how, "nbytes": nbytes}, env=env, timeout=180) == [True] * 2


INTRUDER = textwrap.dedent("""
    # A second job's "rank 1", pointed at the first job's store.
    import sys, time
    from datetime import timedelta
    import torch.distributed as dist
    import moelink  # noqa: F401
    t = time.monotonic()
    try:
        dist.init_process_group("ep", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=1, world_size=2,
                                timeout=timedelta(seconds=30))
        print("JOINED")
    except Exception as e:  # noqa: BLE001
        print("REFUSED", round(time.monotonic() - t, 1), str(e).replace("\\n", " "))
""")


def second_job_takes_a_live_rank(rank, world):
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    x = torch.full((8,), float(rank + 1))
    dist.all_reduce(x)
    dist.barrier()
    if rank == 0:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        out = subprocess.run([sys.executable, "-c", INTRUDER, str(store.port)], env=env, capture_output=True,
                             text=True, timeout=120).stdout
        line = [l for l in out.splitlines() if l.startswith(("REFUSED", "JOINED"))]
        assert line and line[0].startswith("REFUSED"), out
        assert "rank 1 of this group is held by pid " in line[0] and "on host" in line[0], line[0]
        assert float(line[0].split()[1]) < 20, line[0]
    dist.barrier()
    for i in range(5):  # the group is untouched
        x = torch.full((1000,), float(rank + i))
        dist.all_reduce(x)
        assert torch.all(x == sum(r + i for r in range(world)))
    return os.getpid()


def test_a_live_rank_cannot_be_taken():
    pids = run_group(2, second_job_takes_a_live_rank, timeout=180)
    assert len(set(pids)) == 2


WORLD = textwrap.dedent("""
    import sys, time
    from datetime import timedelta
    import torch.distributed as dist
    import moelink  # noqa: F401
    rank, world, port = map(int, sys.argv[1:4])
    t = time.monotonic()
    try:
        dist.init_process_group("ep", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        print("JOINED")
    except Exception as e:  # noqa: BLE001
        print("FAILED", round(time.monotonic() - t, 1), str(e).replace("\\n", " "))
""")


def _spawn(script, *args, env=None):
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(HERE, "..", "..", "integration"), env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


def _verdict(proc):
    out, _ = proc.communicate(timeout=120)
    lines = [l for l in out.splitlines() if l.startswith(("FAILED", "JOINED"))]
    assert lines, out
    return lines[0]


def test_different_world_sizes_are_named_at_once():
    port = free_port()
    zero = _spawn(WORLD, 0, 2, port)
    time.sleep(0.5)
    one = _spawn(WORLD, 1, 3, port)
    for line in (_verdict(zero), _verdict(one)):
        assert line.startswith("FAILED"), line
        assert "rank 1 was started with world size 3, rank 0 with 2" in line, line
        assert float(line.split()[1]) < 30, line  # not the group's 60 s timeout


@pytest.mark.parametrize("ip,words", [("192.0.2.123", "it is not an address of this host"),
                                      ("not-an-address", "not an IPv4 address")])
def test_host_ip_that_is_not_this_hosts_is_refused(ip, words):
    line = _verdict(_spawn(WORLD, 0, 1, free_port(), env={"MOELINK_HOST_IP": ip}))
    assert line.startswith("FAILED") and words in line, line
    assert "Operation now in progress" not in line, line


def meta_tensor(rank, world):
    import moelink

    backend = moelink.get_backend()
    with pytest.raises(ValueError, match="got a tensor on meta"):
        backend.allreduce([torch.ones(4, device="meta")], dist.AllreduceOptions()).wait()
    x = torch.ones(4)
    dist.all_reduce(x)
    assert torch.all(x == world)
    return True


def test_meta_tensor_reaching_the_backend_raises():
    """torch.distributed routes ops on meta tensors to its own fake kernels for every backend
    (torch/distributed/_meta_registrations.py: meta-device model init relies on it), so the
    backend sees one only when called directly: then it raises as for any other device."""
    assert run_group(2, meta_tensor) == [True] * 2
