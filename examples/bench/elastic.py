"""Elastic membership: kill a rank, measure how fast the survivors go on without it and how fast a
replacement is back, over and over.

    python examples/bench/elastic.py [--nproc 4] [--cycles 10] [--transport shm,tcp] [--plot docs/elastic.png]

The parent hosts the group's TCPStore (as torchrun's agent does), so any rank may die. The
survivors run all_reduce after all_reduce, checking each sum against the active-rank mask they
report; rank `--victim` (default 1) SIGKILLs itself, the survivors agree on the new mask and go
on; the parent starts a replacement (EpOptions(is_extension=True)); the survivors poll
get_peer_state and recover_ranks it; the replacement runs --ops ops with them and kills itself,
and so on for --cycles cycles. Per cycle:

- detection: the victim's kill -> the survivors' first op completed over the new mask;
- readmission: the replacement's init_process_group call -> its first op completed;
- recovery: the replacement process's start -> its first op completed (includes importing torch);
- op time before the kill and after the mask changed (median all_reduce, 4 KiB).

The survivors also count their open fds, threads and moelink /dev/shm names (of every process:
run it alone) once the first replacement has run its ops and once the last has (a leak shows
as growth). Prints a table (medians per transport), writes a PNG
plot, exits non-zero on a wrong sum, a disagreement or a process that did not finish.
"""

from __future__ import annotations

import argparse
import glob
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "integration"))

from moelink._ports import free_port  # noqa: E402


def _counts():
    shm = len(glob.glob("/dev/shm/moelink.*"))
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task")), "shm": shm}


def _op(rank, world, i, times=None):
    import torch
    import torch.distributed as dist

    import moelink

    x = torch.full((1024,), float(rank + 1 + i), dtype=torch.float32)
    t0 = time.perf_counter()
    dist.all_reduce(x)
    if times is not None:
        times.append(time.perf_counter() - t0)
    mask = moelink.get_active_ranks().tolist()
    want = sum(r + 1 + i for r in range(world) if mask[r])
    if not bool((x == want).all()):
        raise AssertionError(f"op {i}: all_reduce gave {x[0].item()}, the sum over mask {mask} is {want}")
    return mask


def process(rank, world, port, out, victim, cycles, ops, cycle, started):
    """One process of the group: a survivor (rank != victim), or the victim of cycle `cycle`."""
    import torch.distributed as dist

    import moelink

    result = {"rank": rank, "cycle": cycle}
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=120))
        t_init = time.time()
        dist.init_process_group("ep", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60),
                                pg_options=moelink.EpOptions(is_extension=cycle > 0))
        i = 0
        if rank == victim:
            for k in range(ops):
                _op(rank, world, 10**6 + k)
                if k == 0:
                    result["first_op"] = time.time()
            result.update(init=t_init, started=started)
            if cycle < cycles:
                with open(os.path.join(out, f"r{rank}.c{cycle}.json"), "w") as f:
                    json.dump(result, f)
                with open(os.path.join(out, f"kill{cycle}.txt"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
        else:
            detections, before, after, counts = [], [], [], []
            for c in range(cycles):
                for k in range(ops):  # with the victim, the same ops as its process runs
                    _op(rank, world, 10**6 + k, before if c else None)
                if c == 1:
                    counts.append(_counts())
                while True:  # until the victim is gone
                    mask = _op(rank, world, i)
                    i += 1
                    if not mask[victim]:
                        detections.append(time.time())
                        break
                for _ in range(20):
                    _op(rank, world, i, after)
                    i += 1
                while not moelink.get_peer_state([victim])[0]:
                    _op(rank, world, i)
                    i += 1
                    time.sleep(0.01)
                moelink.recover_ranks([victim])
            for k in range(ops):
                _op(rank, world, 10**6 + k)
            counts.append(_counts())
            result.update(detections=detections, before=before, after=after, counts=counts)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        result["error"] = traceback.format_exc()
    with open(os.path.join(out, f"r{rank}.c{cycle}.json"), "w") as f:
        json.dump(result, f)


def run(world, cycles, transport, victim=1, ops=5, timeout=900):
    """Runs the cycles; returns {"detect": [...], "readmit": [...], "recover": [...], ...}."""
    import torch.distributed as dist

    os.environ["MOELINK_TRANSPORT"] = transport
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory() as out:
        procs = [ctx.Process(target=process, args=(r, world, port, out, victim, cycles, ops, 0, time.time()))
                 for r in range(world)]
        for p in procs:
            p.start()
        current = procs[victim]
        for c in range(1, cycles + 1):
            current.join(max(1, deadline - time.monotonic()))
            if current.is_alive():
                break
            current = ctx.Process(target=process, args=(victim, world, port, out, victim, cycles, ops, c, time.time()))
            current.start()
            procs.append(current)
        for p in procs:
            p.join(max(1, deadline - time.monotonic()))
        hung = [p.pid for p in procs if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results = {}
        for name in os.listdir(out):
            if name.endswith(".json"):
                with open(os.path.join(out, name)) as f:
                    results[name[:-5]] = json.load(f)
        kills = {}
        for name in os.listdir(out):
            if name.startswith("kill"):
                with open(os.path.join(out, name)) as f:
                    kills[int(name[4:-4])] = float(f.read())
    del store
    errors = [f"--- {k} ---\n{v['error']}" for k, v in results.items() if "error" in v]
    if hung or errors:
        raise RuntimeError(f"processes {hung} did not finish\n" + "\n".join(errors))
    survivors = [r for r in range(world) if r != victim]
    detect = []
    for c in range(cycles):
        first = max(results[f"r{r}.c0"]["detections"][c] for r in survivors)
        detect.append(first - kills[c])
    readmit = [results[f"r{victim}.c{c}"]["first_op"] - results[f"r{victim}.c{c}"]["init"] for c in range(1, cycles + 1)]
    recover = [results[f"r{victim}.c{c}"]["first_op"] - results[f"r{victim}.c{c}"]["started"] for c in range(1, cycles + 1)]
    s = results[f"r{survivors[0]}.c0"]
    return {"detect": detect, "readmit": readmit, "recover": recover,
            "op_before_us": statistics.median(s["before"]) * 1e6 if s["before"] else float("nan"),
            "op_after_us": statistics.median(s["after"]) * 1e6,
            "counts": {r: results[f"r{r}.c0"]["counts"] for r in survivors}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--cycles", type=int, default=10)
    ap.add_argument("--transport", default="shm,tcp")
    ap.add_argument("--victim", type=int, default=1)
    ap.add_argument("--plot", default="elastic.png")
    ap.add_argument("--timeout", type=int, default=900)
    args = ap.parse_args()
    probe = os.environ.get("MOELINK_FAILURE_PROBE_MS", "2000")
    print(f"{args.nproc} ranks, {args.cycles} kill/rejoin cycles of rank {args.victim}, "
          f"MOELINK_FAILURE_PROBE_MS={probe}")
    print(f"{'transport':>9} {'detect ms':>10} {'readmit ms':>11} {'recover s':>10} {'op before us':>13} "
          f"{'op after us':>12}  fds/threads/shm first -> last (rank {0 if args.victim else 1})")
    rows, bad = {}, False
    for t in args.transport.split(","):
        r = run(args.nproc, args.cycles, t, args.victim, timeout=args.timeout)
        rows[t] = r
        counts = r["counts"][0 if args.victim else 1]
        first, last = counts[0], counts[-1]
        print(f"{t:>9} {statistics.median(r['detect']) * 1e3:>10.1f} {statistics.median(r['readmit']) * 1e3:>11.1f} "
              f"{statistics.median(r['recover']):>10.2f} {r['op_before_us']:>13.1f} {r['op_after_us']:>12.1f}  "
              f"{first['fds']}/{first['threads']}/{first['shm']} -> {last['fds']}/{last['threads']}/{last['shm']}")
        for rank, cs in r["counts"].items():
            if any(cs[-1][k] > cs[0][k] for k in ("fds", "threads", "shm")):
                print(f"  rank {rank}: growth {cs[0]} -> {cs[-1]}")
                bad = True
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        for t, r in rows.items():
            ax[0].plot(range(1, len(r["detect"]) + 1), [d * 1e3 for d in r["detect"]], "o-", label=t)
            ax[1].plot(range(1, len(r["readmit"]) + 1), [d * 1e3 for d in r["readmit"]], "o-", label=t)
        ax[0].axhline(float(probe), color="gray", ls="--", label="MOELINK_FAILURE_PROBE_MS")
        ax[0].set(title="kill -> survivors' first op (ms)", xlabel="cycle", yscale="log")
        ax[1].set(title="replacement init -> its first op (ms)", xlabel="cycle")
        for a in ax:
            a.legend()
        fig.suptitle(f"moelink elastic membership, {args.nproc} ranks")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")
    except ImportError:
        print("matplotlib not installed: no plot")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
