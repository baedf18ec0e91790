"""The MOELINK_* settings table (src/common/settings.cpp): the README's tables are generated from
it, every value is parsed there with an error naming the variable, and a variable that is not a
setting is reported."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from moelink import settings

HERE = os.path.dirname(os.path.abspath(__file__))
README = os.path.join(HERE, "..", "..", "README.md")


def _readme_table(first_name: str) -> str:
    text = open(README).read()
    at = text.index(f"| `{first_name}` |")
    start = text.rindex("| variable | default | meaning |", 0, at)
    rows = []
    for line in text[start:].splitlines():
        if not line.startswith("|"):
            break
        rows.append(line)
    return "\n".join(rows)


@pytest.mark.parametrize("area", settings.AREAS)
def test_readme_tables_are_the_settings_table(area):
    first = next(s["name"] for s in settings.table() if s["area"] == area)
    assert _readme_table(first) == settings.markdown(area), (
        f"README's {area} table differs from src/common/settings.cpp: regenerate it with "
        f"`python3 -m moelink.settings --area {area}`")


def test_every_setting_the_library_reads_is_declared():
    """Names read anywhere in the sources are in the table (and nothing is read around it)."""
    root = os.path.join(HERE, "..", "..")
    declared = {s["name"] for s in settings.table()}
    read = set()
    for folder in ("src", "include", "integration/moelink"):
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            for f in files:
                if f.endswith((".cpp", ".h", ".cu", ".cuh", ".py")) and f != "settings.cpp":
                    text = open(os.path.join(dirpath, f), errors="replace").read()
                    read |= set(re.findall(r'"(MOELINK_[A-Z0-9_]+)"', text))
    assert read <= declared, f"read but not declared: {sorted(read - declared)}"
    for dirpath, _, files in os.walk(os.path.join(root, "src")):
        for f in files:
            if f.endswith((".cpp", ".cu")) and f != "settings.cpp":
                text = open(os.path.join(dirpath, f)).read()
                assert not re.search(r'getenv\("MOELINK_', text), f"{f} reads a MOELINK_ variable around the table"


@pytest.mark.parametrize("name,value,words", [
    ("MOELINK_MAILBOX_DEPTH", "0", "MOELINK_MAILBOX_DEPTH must be 1..64, got 0"),
    ("MOELINK_CHUNK_BYTES", "4k", "MOELINK_CHUNK_BYTES must be a number, got '4k'"),
    ("MOELINK_SHM_PULL", "off", "MOELINK_SHM_PULL must be 0 or 1, got 'off'"),
    ("MOELINK_TRANSPORT", "rdma", "MOELINK_TRANSPORT must be one of auto|tcp|shm, got 'rdma'"),
    ("MOELINK_EP_IBGDA", "yes", "MOELINK_EP_IBGDA must be one of auto|off|emulate"),
    ("MOELINK_CUDA_BLOCKS", "65", "MOELINK_CUDA_BLOCKS must be 1..64"),
])
def test_a_bad_value_names_the_variable(monkeypatch, name, value, words):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(words)):
        settings.value(name)


def test_values_and_defaults(monkeypatch):
    monkeypatch.delenv("MOELINK_MAILBOX_DEPTH", raising=False)
    monkeypatch.delenv("MOELINK_WORKER_SPIN", raising=False)
    assert settings.value("MOELINK_MAILBOX_DEPTH") == 4
    assert settings.value("MOELINK_WORKER_SPIN") is None  # its default depends on the host
    monkeypatch.setenv("MOELINK_EP_TWO_HOP", "0")
    assert settings.value("MOELINK_EP_TWO_HOP") is False
    monkeypatch.setenv("MOELINK_TRANSPORT", "tcp")
    assert settings.value("MOELINK_TRANSPORT") == "tcp"


def test_cuda_tuning_by_group_size(monkeypatch):
    """The in-host CUDA path's tuning: the group size's row of defaults, a setting where set, a
    clear error for a bad setting or size."""
    import moelink

    for name in ("MOELINK_CUDA_LAMPORT_BYTES", "MOELINK_CUDA_LAMPORT_TWO_SHOT_BYTES", "MOELINK_CUDA_ONESHOT_BYTES",
                 "MOELINK_CUDA_BLOCKS", "MOELINK_CUDA_ROUND_BYTES", "MOELINK_CUDA_SPLIT"):
        monkeypatch.delenv(name, raising=False)
        assert settings.value(name) in (None, True)  # unset: the group's row decides (split: a flag)
    two, four, eight = (moelink.cuda_tuning(n) for n in (2, 4, 8))
    assert two == {"lamport_bytes": 262144, "lamport_two_shot_bytes": 0, "one_shot_bytes": 4 << 20, "blocks": 64, "round_bytes": 16 << 20,
                   "split": True, "lamport_narrow_bytes": 65536,
                   "lamport_threads": 512, "defaults_measured_on": two["defaults_measured_on"]}
    assert "H200" in two["defaults_measured_on"] and "H200" in four["defaults_measured_on"]
    assert four["one_shot_bytes"] == 1 << 20 and four["lamport_bytes"] == 262144
    assert four["lamport_two_shot_bytes"] == 2 << 20 and eight["lamport_two_shot_bytes"] == 2 << 20
    assert eight["lamport_bytes"] == 65536 and eight["defaults_measured_on"] is None
    assert four["lamport_threads"] == 512 and eight["lamport_threads"] == 256
    monkeypatch.setenv("MOELINK_CUDA_LAMPORT_BYTES", "4096")
    monkeypatch.setenv("MOELINK_CUDA_BLOCKS", "16")
    assert moelink.cuda_tuning(8)["lamport_bytes"] == 4096 and moelink.cuda_tuning(8)["blocks"] == 16
    monkeypatch.setenv("MOELINK_CUDA_LAMPORT_TWO_SHOT_BYTES", str(1 << 20))
    assert moelink.cuda_tuning(4)["lamport_two_shot_bytes"] == 1 << 20 and moelink.cuda_tuning(2)["lamport_two_shot_bytes"] == 0
    monkeypatch.setenv("MOELINK_CUDA_LAMPORT_TWO_SHOT_BYTES", str((4 << 20) + 1))
    with pytest.raises(ValueError, match="MOELINK_CUDA_LAMPORT_TWO_SHOT_BYTES"):
        moelink.cuda_tuning(4)
    monkeypatch.delenv("MOELINK_CUDA_LAMPORT_TWO_SHOT_BYTES")
    monkeypatch.setenv("MOELINK_CUDA_ROUND_BYTES", str(1 << 20))
    assert moelink.cuda_tuning(4)["round_bytes"] == 1 << 20
    monkeypatch.setenv("MOELINK_CUDA_ROUND_BYTES", "1000")
    with pytest.raises(ValueError, match="MOELINK_CUDA_ROUND_BYTES must be"):
        moelink.cuda_tuning(4)
    for bad in (0, 9):
        with pytest.raises(ValueError, match="hold 1..8 ranks"):
            moelink.cuda_tuning(bad)


def test_cuda_sms_follow_the_plan(monkeypatch):
    """The SMs the in-host kernels hold, from the plan and tuning of each op: a few blocks for
    small ops (the Lamport kernel: one per 4 KiB of the longest pair up to 64 KiB, per 8 KiB above,
    plus its header block), up
    to 64 per role, pushing and consuming roles from the second round on (never in a forwarded
    broadcast: its root pushes, the others consume)."""
    import moelink

    for name in ("MOELINK_CUDA_LAMPORT_BYTES", "MOELINK_CUDA_LAMPORT_TWO_SHOT_BYTES", "MOELINK_CUDA_BLOCKS",
                 "MOELINK_CUDA_ROUND_BYTES", "MOELINK_CUDA_SPLIT"):
        monkeypatch.delenv(name, raising=False)
    assert moelink.cuda_sms("all_reduce", 4, 8 << 10) == 3
    assert moelink.cuda_sms("all_reduce", 4, 256 << 10) == 33
    assert moelink.cuda_sms("all_gather", 4, 256 << 10) == 17
    assert moelink.cuda_sms("all_reduce", 4, 2 << 20) == 65  # the two-shot Lamport kernel
    assert moelink.cuda_sms("all_reduce", 4, 4 << 20) == 64  # the two-shot staged exchange, one round
    assert moelink.cuda_sms("all_reduce", 4, 32 << 20) == 128  # two rounds of 4 MiB blocks
    assert moelink.cuda_sms("all_to_all", 8, 1 << 30) == 128
    assert moelink.cuda_sms("broadcast", 4, 1 << 30) == 64
    monkeypatch.setenv("MOELINK_CUDA_BLOCKS", "16")
    assert moelink.cuda_sms("broadcast", 4, 1 << 30) == 16
    assert moelink.cuda_sms("all_reduce", 4, 1 << 30) == 32
    monkeypatch.setenv("MOELINK_CUDA_SPLIT", "0")
    assert moelink.cuda_sms("all_reduce", 4, 1 << 30) == 16
    with pytest.raises(ValueError, match="op must be"):
        moelink.cuda_sms("gather", 4, 1 << 20)
    with pytest.raises(ValueError, match="hold 1..8 ranks"):
        moelink.cuda_sms("all_reduce", 16, 1 << 20)


SCRIPT = textwrap.dedent("""
    import torch.distributed as dist
    import moelink  # noqa: F401
    try:
        dist.init_process_group("ep", init_method="tcp://127.0.0.1:" + __import__("sys").argv[1], rank=0,
                                world_size=1)
        print("INIT OK")
    except Exception as e:  # noqa: BLE001
        print("INIT FAILED", str(e).replace("\\n", " "))
""")


def _init_once(env):
    from harness import free_port

    full = dict(os.environ, **env)
    full["PYTHONPATH"] = os.pathsep.join([os.path.join(HERE, "..", "..", "integration"), full.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(free_port())], env=full, capture_output=True, text=True,
                       timeout=120)
    return p.stdout + p.stderr


def test_a_group_with_a_bad_setting_fails_at_init_naming_it():
    out = _init_once({"MOELINK_CHUNK_BYTES": "lots"})
    assert "INIT FAILED" in out and "MOELINK_CHUNK_BYTES must be a number, got 'lots'" in out, out


def test_a_variable_that_is_no_setting_is_reported():
    out = _init_once({"MOELINK_CHUNK_BYTE": "65536"})
    assert "INIT OK" in out, out
    assert "MOELINK_CHUNK_BYTE is set but is not a moelink setting" in out, out
