"""Group lifetime: destroy_process_group releases the threads, sockets and shared memory
that backend "ep" took; several groups coexist; the package refuses a module built for
another torch, naming how to rebuild."""

import glob
import os
import subprocess
import sys

import torch
import torch.distributed as dist

from harness import run_group

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _shm_prefix():
    """moelink's /dev/shm names start with moelink.<pid namespace inode>.<pid>."""
    return f"moelink.{os.stat('/proc/self/ns/pid').st_ino}."


def _counts():
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def create_use_destroy(rank, world):
    # The harness created WORLD; measure around extra groups and a full re-init.
    base = _counts()
    names = lambda: set(glob.glob(f"/dev/shm/{_shm_prefix()}{os.getpid()}.*"))  # noqa: E731
    base_names = names()  # WORLD's (a group keeps its names while it lives, for replacement processes)
    groups = [dist.new_group(list(range(world))) for _ in range(3)]
    for i, g in enumerate(groups):
        x = torch.full((100,), float(i))
        dist.all_reduce(x, group=g)
        assert torch.all(x == i * world)
    assert _counts()[0] >= base[0] + 3, "each group runs its own worker thread"
    for g in groups:
        dist.destroy_process_group(g)
    after = _counts()
    assert after[0] == base[0], f"threads: {base[0]} before, {after[0]} after destroy"
    assert after[1] <= base[1], f"file descriptors: {base[1]} before, {after[1]} after destroy"
    assert names() == base_names, "shared memory of destroyed groups left behind"
    dist.destroy_process_group()
    assert not names(), "shared memory left behind"

    return after[0]


def test_destroy_releases_everything():
    run_group(3, create_use_destroy, timeout=300)


def drop_right_after_ops(rank, world):
    """A group dropped right after its ops return: the worker may still be releasing an op's
    tensors (which takes the GIL) while Python tears the backend down; the teardown must not
    hold the GIL while it waits for the worker."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    for i in range(60):
        g = dist.new_group(list(range(world)))
        x = torch.ones(4)
        dist.all_reduce(x, group=g)
        assert torch.all(x == world), (i, x)
        if i % 2:
            dist.destroy_process_group(g)
        else:
            abort(g) if abort is not None else g.abort()
        del g  # the last reference: the backend goes now
    x = torch.ones(4)
    dist.all_reduce(x)
    assert torch.all(x == world), x


def test_drop_right_after_ops_does_not_hang():
    run_group(3, drop_right_after_ops, timeout=120, pg_timeout=30)


def test_module_built_for_other_torch_is_refused():
    code = (
        "import sys, types\n"
        "sys.modules['moelink._build_info'] = types.SimpleNamespace(TORCH_VERSION='0.0.1')\n"
        "import moelink\n"
    )
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "integration"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0
    assert "built against torch 0.0.1" in r.stderr and "Rebuild" in r.stderr, r.stderr


def test_backend_registered_with_devices():
    import moelink

    assert "EP" in dist.Backend._plugins
    assert moelink.BACKEND_NAME == "ep"
    assert dist.Backend.backend_capability["ep"] == ["cpu", "cuda"]


def test_names_of_dead_processes_are_reclaimed():
    """A process that died before unlinking its shared memory (killed during group creation)
    leaves names behind; the next group created on the host removes them."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = f"/dev/shm/{_shm_prefix()}{dead.pid}.0.1.0.deadbeef"
    with open(orphan, "wb") as f:
        f.write(b"\0" * 64)
    try:
        run_group(2, _noop, timeout=120)
        assert not os.path.exists(orphan), "a dead process's shared memory was not reclaimed"
    finally:
        if os.path.exists(orphan):
            os.unlink(orphan)


def _noop(rank, world):
    return rank
