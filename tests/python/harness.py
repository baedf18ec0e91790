"""Runs functions in real multi-process groups over backend "ep".

`run_group(world, target, ...)` spawns `world` fresh interpreters (start method "spawn",
as torch.multiprocessing does), each of which imports moelink, joins a TCPStore-backed
group and calls `target(rank, world, **kwargs)`. Each rank's return value (or the
traceback it raised) comes back through a file. A group that does not finish within
`timeout` is killed and reported, so no test can hang.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import tempfile
import traceback
from datetime import timedelta


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world, port, target_mod, target_name, kwargs, out_dir, env, backend, pg_timeout,
           store_host="127.0.0.1"):
    os.environ.update(env)
    result = {"rank": rank}
    try:
        import importlib

        import torch.distributed as dist

        import moelink  # noqa: F401  registers "ep" in this spawned child

        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{store_host}:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=pg_timeout),
        )
        fn = getattr(importlib.import_module(target_mod), target_name)
        result["value"] = fn(rank, world, **kwargs)
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001  reported to the parent
        result["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def run_group(world, target, *, kwargs=None, env=None, timeout=300, backend="ep", pg_timeout=60, killed=(),
              store_host="127.0.0.1", rank_env=None):
    """Returns the per-rank results; raises AssertionError naming failing ranks. Ranks in
    `killed` are expected to die (their result is None). The group's store listens at
    `store_host` (rank 0 hosts it). `rank_env` ({rank: {name: value}}) adds to `env` for
    single ranks."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            ctx.Process(
                target=_child,
                args=(r, world, port, target.__module__, target.__name__, kwargs or {}, out_dir,
                      {**(env or {}), **((rank_env or {}).get(r, {}))}, backend, pg_timeout, store_host),
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results = []
        for r in range(world):
            path = os.path.join(out_dir, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    results.append(json.load(f))
            else:
                code = procs[r].exitcode
                results.append({"rank": r, "error": f"rank {r} produced no result (exit code {code})"})
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout} s")
    errors = [f"--- rank {res['rank']} ---\n{res['error']}" for res in results
              if "error" in res and res["rank"] not in killed]
    assert not errors, "\n".join(errors)
    return [res.get("value") for res in results]


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
