"""An SGLang-style elastic MoE serving loop written against Mooncake's API, run on moelink.

    python examples/mooncake_migration.py                 # 4 ranks on CPU tensors
    python examples/mooncake_migration.py --world 2       # a GPU per rank when there are enough

The loop is Mooncake code: `pg.MooncakeBackendOptions(active_ranks)` for the groups (one for the
model's CUDA tensors, one for CPU-side scheduling, as SGLang has), an `active_ranks` tensor given to
every dispatch and combine, `pg.get_peer_state` / `pg.recover_ranks` / `pg.join_group` /
`Buffer.update_ep_member` to take a restarted rank back. The only lines that differ from running it
on Mooncake are the three marked MIGRATION below (imports and backend name).

A rank is killed (SIGKILL) mid-loop; the survivors keep serving: their EP rounds skip the dead
rank's experts and their active_ranks tensor shows it out. The launcher restarts the rank; the
survivors readmit it and every rank serves the full model again. Every step checks the served
result against a local computation; rank 0 prints a line per phase. Exit status 0 when every
step of every rank was right.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))

# MIGRATION: Mooncake: `from mooncake import pg` and
# `from mooncake.mooncake_ep_buffer import Buffer`; the backend names "mooncake" / "mooncake-cpu".
from moelink.compat.mooncake import pg  # noqa: E402
from moelink.compat.mooncake.mooncake_ep_buffer import Buffer  # noqa: E402
BACKEND, CPU_BACKEND = "ep", "ep"  # MIGRATION

HIDDEN, TOPK, MAX_TOKENS = 512, 4, 64


def expert(y: torch.Tensor, e: int) -> torch.Tensor:
    """Expert e of the toy model: a scale by (e + 1) / 8, in float32, rounded to bf16."""
    return (y.float() * (0.125 * (e + 1))).to(torch.bfloat16)


def served(x, idx, w, live_experts) -> torch.Tensor:
    """What the MoE layer must return, computed locally over the experts still served."""
    want = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for k in range(idx.shape[1]):
        e = idx[:, k]
        on = (e >= 0) & live_experts[e.clamp(min=0)]
        scaled = (x.float() * (0.125 * (e.clamp(min=0) + 1)).unsqueeze(1)).to(torch.bfloat16).float()
        want += scaled * (w[:, k] * on).unsqueeze(1)
    return want


def moe_step(buf, active_ranks, rank, world, step, experts, device):
    """One MoE layer through the EP buffer; returns the max error against the local result."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    tokens = int(torch.randint(1, MAX_TOKENS + 1, (1,), generator=g))
    x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16).to(device)
    idx = torch.rand(tokens, experts, generator=g).topk(TOPK, dim=1).indices.to(device)
    w = torch.rand(tokens, TOPK, generator=g).to(device)
    recv, count, handle, _, _ = buf.dispatch(x, idx, active_ranks, MAX_TOKENS, experts, 2_000_000, use_fp8=False)
    nle = experts // world
    y = torch.stack([expert(recv[le], rank * nle + le) for le in range(nle)])
    out, _, _ = buf.combine(y, idx, w, active_ranks, 2_000_000, handle)
    mask = active_ranks.cpu() if active_ranks.numel() == world else torch.ones(world, dtype=torch.int32)
    live = mask.repeat_interleave(nle).bool().to(device)
    want = served(x, idx, w, live)
    return ((out.float() - want).abs().max() / (want.abs().max() + 1)).item()


def member(rank, world, port, victim, kill_step, steps, use_cuda, replacement=False):
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=120))
    # SGLang keeps the mask in a tensor of its own that the group fills (CUDA for the model's group).
    active_ranks = torch.ones(world, dtype=torch.int32, device=device)
    active_ranks_cpu = torch.ones(world, dtype=torch.int32)
    dist.init_process_group(BACKEND, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60),
                            pg_options=pg.MooncakeBackendOptions(active_ranks, replacement, world))
    cpu_group = dist.new_group(backend=CPU_BACKEND, pg_options=pg.MooncakeBackendOptions(active_ranks_cpu, replacement,
                                                                                         world))
    experts = 4 * world
    log = []
    if replacement:
        pg.join_group(dist.group.WORLD)
        pg.join_group(cpu_group)
        buf = Buffer(dist.group.WORLD, Buffer.get_ep_buffer_size_hint(MAX_TOKENS, HIDDEN, world, experts))
        where = torch.zeros(2, dtype=torch.int64)
        dist.broadcast(where, 0, group=cpu_group)  # the survivors' step, and the last one
        step, end = where.tolist()
    else:
        buf = Buffer(dist.group.WORLD, Buffer.get_ep_buffer_size_hint(MAX_TOKENS, HIDDEN, world, experts))
        step, end = 0, steps
    recovered = replacement
    deadline = time.monotonic() + 120
    # The survivors serve on without the killed rank until it is back, then `steps - kill_step`
    # more steps with it (a real server serves on regardless).
    while step < end or not recovered:
        assert time.monotonic() < deadline, f"rank {rank}: the restarted rank did not come back"
        if rank == victim and step == kill_step and not replacement:
            os.kill(os.getpid(), signal.SIGKILL)
        err = moe_step(buf, active_ranks, rank, world, step, experts, device)
        # CPU-side scheduling state over the CPU group: how many ranks serve this step.
        serving = torch.ones(1, dtype=torch.int32)
        dist.all_reduce(serving, group=cpu_group)
        log.append((step, active_ranks.tolist(), int(serving.item()), err))
        assert err < 0.02, f"rank {rank} step {step}: served result off by {err:.3g}"
        assert int(serving.item()) == sum(active_ranks_cpu.tolist()), (serving, active_ranks_cpu)
        step += 1
        if not recovered and step > kill_step and not active_ranks_cpu[victim]:
            # Readmit the restarted rank once every survivor sees it (agreed over the CPU group).
            seen = torch.tensor([int(pg.get_peer_state(dist.group.WORLD, [victim])[0])], dtype=torch.int32)
            dist.all_reduce(seen, op=dist.ReduceOp.MIN, group=cpu_group)
            if seen.item():
                assert pg.recover_ranks(dist.group.WORLD, [victim]).status == pg.ProposalStatus.Applied
                while pg.recover_ranks(cpu_group, [victim]).status != pg.ProposalStatus.Applied:
                    time.sleep(0.05)  # its CPU group is made once the model's group took it back
                buf.update_ep_member()
                end = step + steps - kill_step
                dist.broadcast(torch.tensor([step, end], dtype=torch.int64), 0, group=cpu_group)
                recovered = True
    dist.destroy_process_group()
    return log


def _run(name, out, *args, **kwargs):
    try:
        out.put((name, "ok", member(*args, **kwargs)))
    except BaseException as e:  # noqa: BLE001  reported to the launcher
        out.put((name, "error", repr(e)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30, help="steps before the kill and after the restart, in all")
    ap.add_argument("--cpu", action="store_true", help="CPU tensors even where GPUs are present")
    args = ap.parse_args()
    world, victim, kill_step = args.world, args.world - 1, args.steps // 3
    use_cuda = not args.cpu and torch.cuda.is_available() and torch.cuda.device_count() >= world
    os.environ.setdefault("MOELINK_FAILURE_PROBE_MS", "2000")
    os.environ.setdefault("GLOG_minloglevel", "2")  # moelink's per-rank membership log lines: errors only
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = {f"rank{r}": ctx.Process(target=_run, args=(f"rank{r}", out, r, world, store.port, victim, kill_step,
                                                          args.steps, use_cuda)) for r in range(world)}
    for p in procs.values():
        p.start()
    procs[f"rank{victim}"].join(300)
    print(f"rank {victim} killed at step {kill_step}; restarting it")
    procs["restarted"] = ctx.Process(target=_run, args=("restarted", out, victim, world, store.port, victim, kill_step,
                                                        args.steps, use_cuda), kwargs=dict(replacement=True))
    procs["restarted"].start()
    results = {}
    deadline = time.monotonic() + 300
    while len(results) < world and time.monotonic() < deadline:
        try:
            name, status, value = out.get(timeout=5)
            results[name] = (status, value)
        except Exception:  # noqa: BLE001  queue.Empty: keep waiting until the deadline
            pass
    for p in procs.values():
        p.join(5)
        if p.is_alive():
            p.kill()
    failed = {k: v for k, (s, v) in results.items() if s != "ok"}
    missing = [k for k in procs if k not in results and k != f"rank{victim}"]
    if failed or missing:
        print(f"FAILED: {failed or ''} {('no result from ' + ', '.join(missing)) if missing else ''}")
        return 1
    print(f"{world} ranks on {'GPUs' if use_cuda else 'CPU tensors'}, backend {BACKEND!r} through Mooncake's API")
    print(f"{'steps':>9}  {'active_ranks (rank 0)':<22} {'serving':>7}  {'max error':>9}")
    phases = []
    for step, mask, serving, err in results["rank0"][1]:
        if phases and phases[-1][1] == mask:
            phases[-1][0][1] = step
            phases[-1][3] = max(phases[-1][3], err)
        else:
            phases.append([[step, step], mask, serving, err])
    for (a, b), mask, serving, err in phases:
        print(f"{a:>4}-{b:<4}  {str(mask):<22} {serving:>7}  {err:>9.2e}")
    if [p[1] for p in phases] != [[1] * world, [int(r != victim) for r in range(world)], [1] * world]:
        print("FAILED: the masks were not whole, then without the killed rank, then whole again")
        return 1
    print(f"restarted rank {victim} served steps {results['restarted'][1][0][0]}-{results['restarted'][1][-1][0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
