"""Elastic membership over real processes (harness.run_elastic: the store in the parent, so any
rank may die): a rank is SIGKILLed mid-loop, the survivors agree on the mask and keep producing
exact results over it, a replacement rejoins; a slow rank is never evicted;
on_peer_failure="raise"; two hosts in network namespaces with the link cut."""

from __future__ import annotations

import json
import os
import tempfile
import time

import pytest

import cases_elastic
from harness import run_elastic


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("victim", [2, 0])
def test_kill_mask_and_rejoin(transport, victim):
    world, kill_iter, rejoin_iter, end_iter = 4, 10, 16, 24
    probe_ms = 2000
    res = run_elastic(world, cases_elastic.member,
                      kwargs=dict(victim=victim, kill_iter=kill_iter, rejoin_iter=rejoin_iter, end_iter=end_iter),
                      env={"MOELINK_TRANSPORT": transport, "MOELINK_FAILURE_PROBE_MS": str(probe_ms)},
                      replacement=victim)
    survivors = [r for r in range(world) if r != victim]
    logs = {r: res[f"old{r}"]["log"] for r in survivors}
    # Every survivor ran every iteration and reports the same masks at each.
    for r in survivors:
        assert [e["i"] for e in logs[r]] == list(range(end_iter)), r
    for i in range(end_iter):
        masks = {tuple(logs[r][i]["mask"]) for r in survivors}
        assert len(masks) == 1, f"iteration {i}: survivors disagree on the mask: {masks}"
        mask = masks.pop()
        if i < kill_iter or i >= rejoin_iter:
            assert all(mask), f"iteration {i}: mask {mask}"
        else:
            assert not mask[victim] and sum(mask) == world - 1, f"iteration {i}: mask {mask}"
    # The op in flight at the kill finished within the probe time + a few seconds.
    first = max(logs[r][kill_iter]["allreduce_s"] for r in survivors)
    assert first < probe_ms / 1000 + 5, f"the first op after the kill took {first:.1f} s"
    # The replacement ran the iterations after its readmission, with full sums.
    new = res[f"new{victim}"]["log"]
    assert [e["i"] for e in new] == list(range(rejoin_iter, end_iter))
    assert all(all(e["mask"]) for e in new)


def test_slow_rank_is_not_evicted():
    res = run_elastic(4, cases_elastic.staller, kwargs=dict(stall_rank=1, stall_s=8, iters=6),
                      env={"MOELINK_FAILURE_PROBE_MS": "2000"})
    for r in range(4):
        assert all(all(m) for m in res[f"old{r}"]["masks"]), res[f"old{r}"]["masks"]
        assert res[f"old{r}"]["epoch"] == 0


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_raise_policy(transport):
    res = run_elastic(3, cases_elastic.raiser, kwargs=dict(victim=2), env={"MOELINK_TRANSPORT": transport})
    for r in (0, 1):
        out = res[f"old{r}"]
        assert "rank(s) 2 left the group" in out["first"], out["first"]
        assert out["first_s"] < 10, out["first_s"]
        assert out["second"] == [2.0] * 4
        assert out["mask"] == [1, 1, 0]
        assert "rank 2" in out["send"] and "not active" in out["send"], out["send"]


def test_fifty_kill_rejoin_cycles_leak_nothing(tmp_path):
    """50 times: a rank is SIGKILLed, the survivors go on, a replacement is readmitted. The
    survivors' open fds, threads and moelink /dev/shm names do not grow (examples/bench/elastic.py
    exits non-zero on growth, a wrong sum or a hang)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, os.path.join(root, "examples", "bench", "elastic.py"), "--nproc", "3",
                        "--cycles", "50", "--transport", "shm", "--plot", str(tmp_path / "elastic.png"),
                        "--timeout", "1200"], capture_output=True, text=True, timeout=1500)
    table = "\n".join(line for line in r.stdout.splitlines() if not line.startswith(("W", "I")))
    assert r.returncode == 0, f"{table}\n{r.stderr[-3000:]}"
    assert "shm " in table


def _sh(*cmd):
    import subprocess

    return subprocess.run(list(cmd), capture_output=True, text=True)


def _netns_available():
    import shutil

    if not shutil.which("ip"):
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    name = f"mlprobe{os.getpid()}"
    r = _sh("ip", "netns", "add", name)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip() or r.stdout.strip()}"
    _sh("ip", "netns", "del", name)
    return ""


def test_two_hosts_partition_and_rejoin():
    """Two hosts as network namespaces joined by a veth pair, two ranks each: the link is cut,
    the side with rank 0 evicts the other by agreement and goes on, the other side finds itself
    out; the link is restored and the cut side rejoins."""
    import subprocess
    import sys

    why = _netns_available()
    if why:
        pytest.skip(why)
    tag = os.getpid() % 100000
    a, b, va, vb = f"mlA{tag}", f"mlB{tag}", f"mlva{tag}", f"mlvb{tag}"
    ip_a, ip_b = "10.213.7.1", "10.213.7.2"
    here = os.path.dirname(os.path.abspath(__file__))
    procs = []
    try:
        for cmd in (["ip", "netns", "add", a], ["ip", "netns", "add", b],
                    ["ip", "link", "add", va, "type", "veth", "peer", "name", vb],
                    ["ip", "link", "set", va, "netns", a], ["ip", "link", "set", vb, "netns", b],
                    ["ip", "-n", a, "addr", "add", f"{ip_a}/24", "dev", va],
                    ["ip", "-n", b, "addr", "add", f"{ip_b}/24", "dev", vb],
                    ["ip", "-n", a, "link", "set", "lo", "up"], ["ip", "-n", b, "link", "set", "lo", "up"],
                    ["ip", "-n", a, "link", "set", va, "up"], ["ip", "-n", b, "link", "set", vb, "up"]):
            r = _sh(*cmd)
            if r.returncode != 0:
                pytest.skip(f"{' '.join(cmd)}: {r.stderr.strip()}")
        port = 29000 + tag % 1000
        store = subprocess.Popen(
            ["ip", "netns", "exec", a, sys.executable, "-c",
             "import time, datetime, torch.distributed as d; "
             f"s = d.TCPStore('{ip_a}', {port}, 4, is_master=True, wait_for_workers=False, "
             "timeout=datetime.timedelta(seconds=300)); time.sleep(600)"])
        procs.append(store)
        with tempfile.TemporaryDirectory() as out:
            for rank in range(4):
                ns, ip, host = (a, ip_a, "hostA") if rank < 2 else (b, ip_b, "hostB")
                env = dict(os.environ, PYTHONFAULTHANDLER="1", MOELINK_HOST_IP=ip, MOELINK_HOST_ID=host, MOELINK_FAILURE_PROBE_MS="1000")
                procs.append(subprocess.Popen(["ip", "netns", "exec", ns, sys.executable,
                                               os.path.join(here, "netns_member.py"), str(rank), "4", ip_a, str(port),
                                               out], env=env))

            def wait_for(name, ranks, limit):
                deadline = time.monotonic() + limit
                while not all(os.path.exists(os.path.join(out, f"{name}.{r}")) for r in ranks):
                    assert time.monotonic() < deadline, f"no '{name}' from ranks {ranks} within {limit} s"
                    if any(p.poll() is not None for p in procs[1:]):
                        found = {}
                        for f in os.listdir(out):
                            if f.startswith("result."):
                                found[f] = open(os.path.join(out, f)).read()
                        raise AssertionError(f"a rank exited early: {found}")
                    time.sleep(0.05)

            wait_for("running", range(4), 120)
            assert _sh("ip", "-n", a, "link", "set", va, "down").returncode == 0
            cut = time.time()
            wait_for("evicted", (0, 1), 30)
            wait_for("out", (2, 3), 30)
            assert _sh("ip", "-n", a, "link", "set", va, "up").returncode == 0
            for p in procs[1:]:
                p.wait(timeout=180)
            results = {}
            for r in range(4):
                with open(os.path.join(out, f"result.{r}.json")) as f:
                    results[r] = json.load(f)
            detect = max(float(open(os.path.join(out, f"evicted.{r}")).read()) for r in (0, 1)) - cut
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        _sh("ip", "netns", "del", a)
        _sh("ip", "netns", "del", b)
    errors = {r: v["error"] for r, v in results.items() if "error" in v}
    assert not errors, errors
    for r in (0, 1):
        assert results[r]["mask_after_cut"] == [1, 1, 0, 0], results[r]
    for r in (2, 3):
        assert "out of the group" in results[r]["out_error"], results[r]["out_error"]
    for r in range(4):
        assert all(all(m) for m in results[r]["final_masks"]), results[r]
    assert detect < 1.0 + 1.0 + 5, f"the cut was acted on after {detect:.1f} s"


def test_gpu_survivor_and_rejoin():
    """2 GPUs: rank 1 is killed; rank 0's CUDA all_reduce and EP buffer go on over the mask
    (the op in flight on the in-host kernels either finished or raises naming the loss), a
    replacement rejoins, the EP buffer follows (update_members), and CUDA all_reduce sums over
    both again on the in-host kernels."""
    import torch

    shared = os.environ.get("MOELINK_TEST_SHARE_GPU") == "1"  # both ranks on one GPU (time-sliced)
    if not torch.cuda.is_available() or (torch.cuda.device_count() < 2 and not shared):
        pytest.skip("needs 2 GPUs (or MOELINK_TEST_SHARE_GPU=1 and one)")
    res = run_elastic(2, cases_elastic.gpu_member, env={"MOELINK_EP_TIMEOUT_US": "5000000"}, replacement=1, timeout=300)
    old, new = res["old0"], res["new1"]
    assert old["inflight"] == "completed" or "left the group" in old["inflight"], old["inflight"]
    assert old["detect_s"] < 2 + 5, old["detect_s"]
    assert all(m == [1, 0] for m in old["masks_after"]), old["masks_after"]
    assert old["path_after"] == "nvlink" and old["ep_after"] == "ok"  # the in-host kernels over the survivor
    assert old["stale_graph_s"] < 5 and old["after_stale_graph"] == [1, 0], old
    # Readmitted: masked out of the EP buffer (and the normal mode on the group route) until
    # update_members; then exact round trips over both ranks, the normal mode on its kernels.
    assert old["ep_active_before_update"] == [1, 0] and old["normal_path_before_update"] == "group"
    for r in (old, new):
        assert r["ep_active"] == [1, 1] and r["ep_rejoined"] == "ok" and r["normal_path"] == "nvlink", r
    assert old["transports"] == ["local", "nvlink"] and new["transports"] == ["nvlink", "local"]
    assert all(m == [1, 1] for m in old["masks"]) and all(m == [1, 1] for m in new["masks"])
    # The CUDA collectives set up new staging areas with the replacement: in-host kernels again.
    assert old["path"] == new["path"] == "nvlink", (old["path"], new["path"])


def test_gpu_three_ranks_kill_in_flight():
    """3 GPU ranks with async CUDA ops in flight when rank 1 dies: the survivors agree op by
    op (the same values, or both failed), every op after the change is over the two of them on
    the in-host kernels, and after a replacement is readmitted the group is whole and in-host."""
    import torch

    shared = os.environ.get("MOELINK_TEST_SHARE_GPU") == "1"
    if not torch.cuda.is_available() or (torch.cuda.device_count() < 3 and not shared):
        pytest.skip("needs 3 GPUs (or MOELINK_TEST_SHARE_GPU=1 and one)")
    res = run_elastic(3, cases_elastic.gpu_trio, replacement=1, timeout=300)
    a, b, new = res["old0"], res["old2"], res["new1"]
    assert a["outcomes"].keys() == b["outcomes"].keys()
    full = lambda i: float(sum(r + 1 + i for r in range(3)))  # noqa: E731
    two = lambda i: float(1 + i + 3 + i)  # noqa: E731
    survivors_only = []
    for i, oa in a["outcomes"].items():
        ob = b["outcomes"][i]
        i = int(i)
        assert ("error" in oa) == ("error" in ob), (i, oa, ob)
        if "error" in oa:
            continue
        assert oa == ob, (i, oa, ob)
        assert oa["sum"] in ([full(i)], [two(i)]), (i, oa)
        over_two = oa["sum"] == [two(i)]
        want_slots = [[100.0 + i], [0.0] if over_two else [200.0 + i], [300.0 + i]]
        assert oa["slots"] == want_slots, (i, oa)
        survivors_only.append(over_two)
    # Ops fail only around the kill; from some op on, every op runs over the two survivors.
    last = [int(i) for i, o in a["outcomes"].items() if "error" in o]
    assert not last or max(last) < 12 + 8, a["outcomes"]
    assert all(survivors_only[-15:]) and len(survivors_only) >= 25, survivors_only
    assert a["mask"] == b["mask"] == [1, 0, 1]
    assert a["path_after"] == b["path_after"] == "nvlink"
    for r in (a, b, new):
        assert all(r["full"]) and r["path"] == "nvlink", r


def test_group_grows_with_extension_ranks():
    """Ranks 0 and 1 create a group of 4 with EpOptions(initial_world_size=2); ranks 2 and 3 join
    later with is_extension=True and extend_group_size_to(4) readmits them."""
    res = run_elastic(4, cases_elastic.grower, kwargs=dict(initial=2))
    for r in (0, 1):
        assert res[f"old{r}"]["mask_before"] == [1, 1, 0, 0]
        assert res[f"old{r}"]["sum_before"] == 3.0
        assert res[f"old{r}"]["gather_before"] == [0.0, 1.0, 0.0, 0.0]
    for r in range(4):
        assert res[f"old{r}"]["sum_after"] == 10.0 and res[f"old{r}"]["mask_after"] == [1, 1, 1, 1]


def test_gpu_two_level_kill_and_rejoin():
    """4 GPU ranks as 2 virtual hosts of 2 (MOELINK_RANKS_PER_HOST=2), CUDA all_reduce in two levels
    (route host+nvlink), when rank 3 dies with an op in flight: every op a survivor completes holds
    the full sum (before the change) or the survivors' (after it), never anything else; the ops
    after the change run with every rank on the wire (route host) and succeed; after a replacement
    is readmitted the group is whole again and back on two levels, over areas set up afresh
    (eager ops and a newly captured graph)."""
    import torch

    share = os.environ.get("MOELINK_TEST_SHARE_GPU") in ("1", "4")
    if not torch.cuda.is_available() or (torch.cuda.device_count() < 4 and not share):
        pytest.skip("needs 4 GPUs (or MOELINK_TEST_SHARE_GPU=1 and fewer)")
    res = run_elastic(4, cases_elastic.gpu_two_level, env={"MOELINK_RANKS_PER_HOST": "2"}, replacement=3,
                      timeout=300)
    survivors = [res[f"old{r}"] for r in range(3)]
    full = lambda i: float(sum(r + 1 + i for r in range(4)))  # noqa: E731
    three = lambda i: float(sum(r + 1 + i for r in range(3)))  # noqa: E731
    for s in survivors:
        assert s["path_before"] == "host+nvlink", s["path_before"]
        last = max(int(i) for i in s["outcomes"])
        assert s["outcomes"]["0"] == {"sum": [full(0)]}, s["outcomes"]["0"]
        for i, o in s["outcomes"].items():
            i = int(i)
            if i < 4 and "sum" in o:  # ops that the victim finished: whole
                assert o["sum"] == [full(i)], (s["rank"], i, o)
            elif "sum" in o:
                assert o["sum"] in ([full(i)], [three(i)]), (s["rank"], i, o)
        assert s["outcomes"][str(last)] == {"sum": [three(last)]}, (s["rank"], s["outcomes"])
        assert s["mask"] == [1, 1, 1, 0] and s["path_after"] == "host", (s["mask"], s["path_after"])
    for r in survivors + [res["new3"]]:
        assert r["full"] == [True] * 3 and r["path"] == "host+nvlink", r
        assert r["graph"] == [True] * 3, r


@pytest.mark.parametrize("path,world,victim,transport",
                         [("proxy", 4, 3, "shm"), ("proxy", 4, 0, "tcp"), ("ibgda", 2, 0, "shm"), ("ibgda", 4, 0, "shm")])
def test_gpu_cross_host_rejoin(path, world, victim, transport):
    """GPU ranks on 2 virtual hosts: a rank dies, the survivors' EP round trips go on without
    it, and its replacement is reconnected in place over the CPU proxy (its engine over shared
    memory or tcp) / IBGDA (the emulated NIC) by update_members on every rank: exact round trips
    over all ranks again."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    shared = gpus >= 1 and os.environ.get("MOELINK_TEST_SHARE_GPU") == "1"
    if gpus < world and not shared:
        pytest.skip(f"needs {world} GPUs (or MOELINK_TEST_SHARE_GPU=1 and one)")
    rph = world // 2
    env = {"MOELINK_EP_RANKS_PER_HOST": str(rph), "MOELINK_EP_IBGDA": "emulate" if path == "ibgda" else "off",
           "MOELINK_TRANSPORT": transport}
    res = run_elastic(world, cases_elastic.gpu_cross_host_member, kwargs=dict(victim=victim), env=env,
                      replacement=victim, timeout=400)
    paths = lambda q: ["local" if p == q else ("nvlink" if p // rph == q // rph else path)  # noqa: E731
                       for p in range(world)]
    for q in range(world):
        if q == victim:
            continue
        old = res[f"old{q}"]
        assert old["transports_before"] == paths(q), old
        assert all(m == [1] * world for m in old["masks_before"]), old["masks_before"]
        alone = [0 if r == victim else 1 for r in range(world)]
        assert all(m == alone for m in old["masks_after"]), old["masks_after"]
    for name, r in res.items():
        q = r["rank"]
        assert r["rejoined"] == "ok" and r["ep_active"] == [1] * world, (name, r)
        assert r["transports"] == paths(q), (name, r["transports"])
        assert r["engine"] == [transport if t == "proxy" else "" for t in paths(q)], (name, r["engine"])
        assert all(m == [1] * world for m in r["masks"]), (name, r["masks"])
