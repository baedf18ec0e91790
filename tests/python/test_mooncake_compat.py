"""moelink.compat.mooncake: Mooncake's pg API over backend "ep", in Mooncake's own elastic flows
(cases_mooncake_compat.py) over real processes on shm and tcp, a rank SIGKILLed where the flow
kills one; and the API surface that needs no group."""

from __future__ import annotations

import pytest
import torch

import cases_mooncake_compat as cases
from harness import run_elastic

ENV = {"MOELINK_FAILURE_PROBE_MS": "2000"}


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_recovery_flow(transport):
    res = run_elastic(4, cases.recovery, kwargs=dict(victim=1), replacement=1,
                      env={**ENV, "MOELINK_TRANSPORT": transport})
    assert set(res) == {"old0", "old2", "old3", "new1"}, res
    for r in (0, 2, 3):
        before, after = res[f"old{r}"]["epochs"]
        assert after >= before + 2, res[f"old{r}"]  # one change for the loss, one for the readmission


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_recovery_of_a_death_no_op_found(transport):
    res = run_elastic(3, cases.undetected, kwargs=dict(victim=1), replacement=1,
                      env={**ENV, "MOELINK_TRANSPORT": transport})
    assert set(res) == {"old0", "old2", "new1"}, res


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_extension_flow(transport):
    res = run_elastic(3, cases.extension, env={**ENV, "MOELINK_TRANSPORT": transport})
    # moelink's group has its largest size from the start (the README's "Coming from Mooncake")
    assert [res[f"old{r}"].get("world_size_before") for r in range(2)] == [3, 3]
    assert all(res[f"old{r}"]["world_size_after"] == 3 for r in range(3))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_graceful_leave_then_replacement(transport):
    res = run_elastic(3, cases.graceful_leave, kwargs=dict(leaver=2, linger_s=10), replacement=2,
                      env={**ENV, "MOELINK_TRANSPORT": transport})
    assert "shut down" in res["old2"]["after_leave"], res["old2"]
    # its process lingers 10 s after leaving: the others' next op does not wait for it
    assert all(res[f"old{r}"]["first_op_s"] < 5 for r in (0, 1)), res
    assert set(res) == {"old0", "old1", "old2", "new2"}


def test_manual_flow():
    run_elastic(4, cases.manual, kwargs=dict(victim=3), replacement=3, env=ENV)


def test_refusals_leave_the_group_usable():
    res = run_elastic(3, cases.refusals, env=ENV)
    assert all(res[f"old{r}"]["synced"] == 3 for r in range(3))


def test_options_surface():
    from moelink.compat.mooncake import pg

    o = pg.MooncakeBackendOptions(4)
    assert (o.max_group_size, o.is_extension, o.auto_deactivate_on_failure, o.auto_sync_on_failure) == (4, False, True, True)
    o = pg.MooncakeBackendOptions(4, True, False, False)
    assert (o.is_extension, o.auto_deactivate_on_failure, o.auto_sync_on_failure) == (True, False, False)
    o = pg.MooncakeBackendOptions(max_group_size=8, is_extension=True)
    assert (o.max_group_size, o.is_extension) == (8, True)
    mask = torch.zeros(4, dtype=torch.int32)
    o = pg.MooncakeBackendOptions(mask, True, 4)
    assert o.active_ranks is mask and o.max_group_size == 4 and o.is_extension
    o = pg.MooncakeBackendOptions(active_ranks=mask)
    assert o.max_group_size == -1 and not o.is_extension
    with pytest.raises(TypeError):
        pg.MooncakeBackendOptions(4, True, True, True, True)
    with pytest.raises(TypeError):
        pg.MooncakeBackendOptions(4, bogus=1)
    with pytest.raises(TypeError):
        pg.MooncakeBackendOptions()
    assert pg.ViewUpdateStatus is pg.ProposalStatus
    assert [s.name for s in pg.ProposalStatus] == ["Rejected", "Applied", "AppliedWithDroppedRanks"]
    assert [s.name for s in pg.SyncAfterFailureStatus] == ["Reconciled", "NoPending", "Rejected"]


def test_process_wide_settings(monkeypatch):
    """set_host_ip / set_collective_timeout_us become moelink's settings for groups created
    afterwards (what the library reads, moelink.settings.value)."""
    import moelink.settings
    from moelink.compat.mooncake import pg

    # setenv records what was there, so that teardown restores it after the functions' writes
    monkeypatch.setenv("MOELINK_HOST_IP", "")
    monkeypatch.setenv("MOELINK_FAILURE_PROBE_MS", "2000")
    pg.set_host_ip("10.1.2.3")
    pg.set_collective_timeout_us(1_500_000)
    assert moelink.settings.value("MOELINK_HOST_IP") == "10.1.2.3"
    assert moelink.settings.value("MOELINK_FAILURE_PROBE_MS") == 1500
    with pytest.raises(ValueError):
        pg.set_collective_timeout_us(0)


def test_invalid_options_raise_at_init():
    """Mooncake's checks at group creation (RuntimeError), here also ValueError; nothing hangs."""
    import torch.distributed as dist

    from moelink.compat.mooncake import pg

    bad = [(pg.MooncakeBackendOptions(4, False, False, True), "auto_sync_on_failure requires"),
           (pg.MooncakeBackendOptions(torch.zeros(4, dtype=torch.int64)), "int32"),
           (pg.MooncakeBackendOptions(torch.zeros(1, dtype=torch.int32), False, 2), "smaller than max_group_size")]
    for opts, words in bad:
        store = dist.HashStore()
        with pytest.raises(RuntimeError, match=words):
            dist.init_process_group("ep", store=store, rank=0, world_size=1, pg_options=opts)
        assert not dist.is_initialized()


def test_not_served_imports_name_the_reason():
    import moelink.compat.mooncake as mc

    for name, words in (("store", "KV-cache store"), ("engine", "TransferEngine")):
        with pytest.raises(ImportError, match=words):
            getattr(mc, name)
    with pytest.raises(ImportError, match="KV-cache"):
        exec("from moelink.compat.mooncake import store", {})


@pytest.mark.parametrize("world", [2, 4])
def test_ep_buffer_rounds_cpu(world):
    from harness import run_group

    res = run_group(world, cases.ep_rounds, timeout=600)
    assert all(r["transports"][r_i] == "local" for r_i, r in enumerate(res)), res


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_ep_buffer_elastic_cpu(transport):
    res = run_elastic(3, cases.ep_elastic, kwargs=dict(victim=2), replacement=2,
                      env={**ENV, "MOELINK_TRANSPORT": transport})
    assert all(res[k]["mirror"] == [1, 1, 1] for k in ("old0", "old1", "new2")), res


def _gpus():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("world", [2, 4])
def test_ep_buffer_rounds_gpu(world):
    """Mooncake's Buffer on a GPU per rank (NVLink kernels), checked like the CPU rounds."""
    from harness import run_group

    if _gpus() < world:
        pytest.skip(f"needs {world} GPUs, found {_gpus()}")
    res = run_group(world, cases.ep_rounds, kwargs=dict(device="cuda"), timeout=600)
    for r, out in enumerate(res):
        assert out["transports"] == ["local" if p == r else "nvlink" for p in range(world)], out


@pytest.mark.parametrize("world", [2, 4])
def test_ep_buffer_elastic_gpu(world):
    """SGLang's loop on GPUs: the last rank is killed, the survivors' kernels time it out and the
    CUDA active_ranks tensor shows it, a replacement is reconnected by update_ep_member."""
    if _gpus() < world:
        pytest.skip(f"needs {world} GPUs, found {_gpus()}")
    res = run_elastic(world, cases.ep_elastic, kwargs=dict(victim=world - 1, device="cuda"), replacement=world - 1,
                      env=ENV, timeout=300)
    assert all(v["mirror"] == [1] * world for v in res.values()), res


def test_migration_example():
    """examples/mooncake_migration.py (Mooncake's API, imports changed) end to end: 3 ranks on
    CPU tensors, one killed and restarted; its exit status says every step was right."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(here, "..", "..", "examples", "mooncake_migration.py")
    out = subprocess.run([sys.executable, script, "--world", "3", "--steps", "15", "--cpu"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "restarted rank 2 served steps" in out.stdout, out.stdout
