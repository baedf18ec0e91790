"""Runs functions in real multi-process groups over backend "ep".

- `run_group(world, target, ...)` spawns `world` fresh interpreters (start method "spawn", as
  torch.multiprocessing does), each of which imports moelink, joins a TCPStore-backed group
  (rank 0 hosts the store) and calls `target(rank, world, **kwargs)`.
- `run_elastic(world, target, ...)` is for groups whose ranks may die, rank 0 included: the
  parent hosts the store, each process calls `target(rank, world, port, **kwargs)` and joins the
  group itself (with the options it needs), and a replacement process can be started for a rank
  once its process has ended (`target(..., replacement=True)`).
- `run_cases` runs named cases of a module in one group; `case_failures` / `assert_case_passed`
  read its results.

Each process's return value (or the traceback it raised) comes back through a file. Processes
that do not finish within `timeout` are killed and reported with the Python stacks of their
threads at that moment (faulthandler, on SIGUSR1), so no test can hang and a hang says where.
"""

from __future__ import annotations

import faulthandler
import json
import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback
from datetime import timedelta


def free_port() -> int:
    """A free port for a test group's TCPStore, outside the kernel's ephemeral range (moelink's
    `_ports.free_port`: the listeners the tests start bind port 0, so none of them can take it)."""
    from moelink._ports import free_port as pick

    return pick()


def _reported(out_path, fn, args, kwargs, env):
    """A process's body: runs fn and writes {"value": ...} or {"error": traceback} to out_path.
    SIGUSR1 writes the Python stacks of all its threads to out_path + ".stacks" (the parent asks
    for them before it kills a process that did not finish)."""
    os.environ.update(env)
    stacks = open(out_path + ".stacks", "w")  # noqa: SIM115  open while the process lives
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    result = {}
    try:
        result["value"] = fn(*args, **kwargs)
    except BaseException:  # noqa: BLE001  reported to the parent
        result["error"] = traceback.format_exc()
    with open(out_path, "w") as f:
        json.dump(result, f)


def _run_processes(starts, timeout, replacement=None):
    """Starts one process per (name, fn, args, kwargs, env) of `starts` and waits up to `timeout`
    s for all; `replacement` (name of a process, (name, fn, args, kwargs, env)) is started once
    that process has ended. Returns {name: result dict} ({"killed": True} for a process that a
    SIGKILL ended before it wrote its result, {"error": ...} for one that ended otherwise
    without one) and the names that did not finish in time (killed here)."""
    ctx = mp.get_context("spawn")
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory() as out_dir:
        procs = {}
        for name, fn, args, kwargs, env in starts:
            procs[name] = ctx.Process(target=_reported,
                                      args=(os.path.join(out_dir, f"{name}.json"), fn, args, kwargs, env))
            procs[name].start()
        if replacement is not None:
            after, (name, fn, args, kwargs, env) = replacement
            procs[after].join(max(1, deadline - time.monotonic()))
            procs[name] = ctx.Process(target=_reported,
                                      args=(os.path.join(out_dir, f"{name}.json"), fn, args, kwargs, env))
            procs[name].start()
        for p in procs.values():
            p.join(max(1, deadline - time.monotonic()))
        hung = [name for name, p in procs.items() if p.is_alive()]
        for name in hung:  # where they are stuck, before they go
            try:
                os.kill(procs[name].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        if hung:
            time.sleep(1)
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join()
        results = {}
        for name, p in procs.items():
            path = os.path.join(out_dir, f"{name}.json")
            if os.path.exists(path):
                with open(path) as f:
                    results[name] = json.load(f)
            elif p.exitcode == -signal.SIGKILL and name not in hung:
                results[name] = {"killed": True}
            else:
                results[name] = {"error": f"{name} produced no result (exit code {p.exitcode})"}
            if name in hung and os.path.exists(path + ".stacks"):
                with open(path + ".stacks") as f:
                    results[name]["stacks"] = f.read()
    return results, hung


def _hung_message(hung, results, timeout):
    """What a test prints for processes that did not finish: their names and, for each, the
    last Python frames of every thread when it was stopped."""
    parts = [f"{hung} did not finish within {timeout} s"]
    for name in hung:
        lines = results.get(name, {}).get("stacks", "").strip().splitlines()
        parts.append(f"--- {name}: stacks when stopped ---\n" + ("\n".join(lines[-60:]) or "(none written)"))
    return "\n".join(parts)


def _member(rank, world, port, target_mod, target_name, kwargs, backend, pg_timeout, store_host):
    import importlib

    import torch.distributed as dist

    import moelink  # noqa: F401  registers "ep" in this spawned child

    dist.init_process_group(backend=backend, init_method=f"tcp://{store_host}:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=pg_timeout))
    value = getattr(importlib.import_module(target_mod), target_name)(rank, world, **kwargs)
    if dist.is_initialized():
        dist.destroy_process_group()
    return value


def run_group(world, target, *, kwargs=None, env=None, timeout=300, backend="ep", pg_timeout=60, killed=(),
              store_host="127.0.0.1", rank_env=None):
    """Returns the per-rank results; raises AssertionError naming failing ranks. Ranks in
    `killed` are expected to die (their result is None). The group's store listens at
    `store_host` (rank 0 hosts it). `rank_env` ({rank: {name: value}}) adds to `env` for
    single ranks."""
    port = free_port()
    starts = [(f"rank{r}", _member,
               (r, world, port, target.__module__, target.__name__, kwargs or {}, backend, pg_timeout, store_host), {},
               {**(env or {}), **((rank_env or {}).get(r, {}))}) for r in range(world)]
    results, hung = _run_processes(starts, timeout)
    if hung:
        raise AssertionError(_hung_message(hung, results, timeout))
    errors = [f"--- rank {r} ---\n{results[f'rank{r}']['error']}" for r in range(world)
              if "error" in results[f"rank{r}"] and r not in killed]
    assert not errors, "\n".join(errors)
    return [results[f"rank{r}"].get("value") for r in range(world)]


def run_elastic(world, target, *, kwargs=None, env=None, replacement=None, timeout=240):
    """Processes `target(rank, world, port, **kwargs)` of a group whose store the parent hosts;
    with `replacement=r`, `target(r, world, port, replacement=True, **kwargs)` starts once rank r's
    process has ended. Returns {"old<r>": value, "new<r>": value}; raises AssertionError for a
    process that raised or did not finish."""
    import torch.distributed as dist

    for attempt in range(3):  # a port found free can be taken before the store binds it
        port = free_port()
        try:
            store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=120))
            break
        except dist.DistNetworkError:
            if attempt == 2:
                raise
    kwargs = kwargs or {}
    starts = [(f"old{r}", target, (r, world, port), kwargs, env or {}) for r in range(world)]
    extra = None
    if replacement is not None:
        extra = (f"old{replacement}", (f"new{replacement}", target, (replacement, world, port),
                                       dict(kwargs, replacement=True), env or {}))
    results, hung = _run_processes(starts, timeout, extra)
    del store
    assert not hung, _hung_message(hung, results, timeout)
    errors = {k: v["error"] for k, v in results.items() if "error" in v}
    assert not errors, "\n".join(f"--- {k} ---\n{v}" for k, v in errors.items())
    return {k: v["value"] for k, v in results.items() if "value" in v}


def run_cases(rank, world, cases_mod, names):
    """Runs each named case in turn in one group; returns {name: None or traceback}."""
    import importlib

    import torch.distributed as dist

    mod = importlib.import_module(cases_mod)
    out = {}
    for name in names:
        try:
            getattr(mod, name)(rank, world)
            out[name] = None
        except BaseException:  # noqa: BLE001
            out[name] = traceback.format_exc()
        # Keep the ranks in step between cases. After a failed case the first barrier may
        # itself fail (its messages meet the ranks' different views); the next one agrees.
        for _ in range(2):
            try:
                dist.barrier()
                break
            except RuntimeError:
                continue
    return out


def case_failures(results, case):
    """The ranks' tracebacks of `case` in run_cases results (one {name: traceback} per rank)."""
    return [f"rank {r}:\n{res[case]}" for r, res in enumerate(results) if res[case]]


def assert_case_passed(results, case):
    failures = case_failures(results, case)
    assert not failures, "\n".join(failures)
