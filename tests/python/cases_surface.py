"""A walk over the public torch.distributed surface on backend "ep" (CPU tensors), run in every
rank of a group: each call either works with the right values or raises a Python exception,
and the process and the group survive either way (a plain all_reduce after every call)."""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist


def _expect(cond, what):
    if not cond:
        raise AssertionError(what)


def _sum_of_ranks(world):
    return float(sum(range(1, world + 1)))


def calls(rank, world):
    """(name, fn) pairs; fn runs the call and checks its values (it may also raise)."""
    r1 = float(rank + 1)
    out = []

    def add(name):
        def deco(fn):
            out.append((name, fn))
            return fn
        return deco

    @add("all_reduce ops")
    def _():
        for op, want in ((dist.ReduceOp.SUM, _sum_of_ranks(world)), (dist.ReduceOp.MAX, float(world)),
                         (dist.ReduceOp.MIN, 1.0), (dist.ReduceOp.AVG, _sum_of_ranks(world) / world)):
            t = torch.full((5,), r1)
            dist.all_reduce(t, op=op)
            _expect(torch.allclose(t, torch.full((5,), want)), f"{op}: {t}")
        t = torch.full((3,), r1)
        dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
        want = 1.0
        for r in range(world):
            want *= r + 1
        _expect(torch.allclose(t, torch.full((3,), want)), f"product: {t}")
        b = torch.tensor([rank + 1], dtype=torch.int64)
        dist.all_reduce(b, op=dist.ReduceOp.BOR)
        v = 0
        for r in range(world):
            v |= r + 1
        _expect(int(b) == v, f"bor: {b}")

    @add("premul_sum")
    def _():
        t = torch.full((4,), r1)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))
        _expect(torch.allclose(t, torch.full((4,), 2 * _sum_of_ranks(world))), f"premul: {t}")
        t = torch.full((4,), r1, dtype=torch.float64)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(torch.tensor([0.5], dtype=torch.float64)))
        _expect(torch.allclose(t, torch.full((4,), 0.5 * _sum_of_ranks(world), dtype=torch.float64)), f"premul t: {t}")
        x = torch.full((world * 2,), r1)
        out = torch.empty(2)
        dist.reduce_scatter_tensor(out, x, op=dist._make_nccl_premul_sum(3.0))
        _expect(torch.allclose(out, torch.full((2,), 3 * _sum_of_ranks(world))), f"premul reduce_scatter: {out}")
        t = torch.full((3,), r1)
        dist.reduce(t, dst=0, op=dist._make_nccl_premul_sum(2.0))
        want = 2 * _sum_of_ranks(world) if rank == 0 else r1  # the others' tensors are left alone
        _expect(torch.allclose(t, torch.full((3,), float(want))), f"premul reduce: {t}")

    @add("broadcast / reduce")
    def _():
        t = torch.full((6,), r1)
        dist.broadcast(t, src=world - 1)
        _expect(torch.all(t == world), f"broadcast: {t}")
        t = torch.full((6,), r1)
        dist.reduce(t, dst=0)
        if rank == 0:
            _expect(torch.all(t == _sum_of_ranks(world)), f"reduce: {t}")

    @add("all_gather family")
    def _():
        outs = [torch.empty(3) for _ in range(world)]
        dist.all_gather(outs, torch.full((3,), r1))
        _expect(all(torch.all(o == r + 1) for r, o in enumerate(outs)), "all_gather")
        flat = torch.empty(world * 3)
        dist.all_gather_into_tensor(flat, torch.full((3,), r1))
        _expect(torch.equal(flat, torch.arange(1, world + 1).float().repeat_interleave(3)), "all_gather_into_tensor")
        outs = [[torch.empty(2), torch.empty(1)] for _ in range(world)]  # [rank][input]
        dist.all_gather_coalesced(outs, [torch.full((2,), r1), torch.full((1,), -r1)])
        _expect(all(torch.all(outs[r][0] == r + 1) and torch.all(outs[r][1] == -(r + 1)) for r in range(world)),
                "all_gather_coalesced")

    @add("single-tensor forms")
    def _():
        # torch >= 2.14 names; skipped where this torch has none of them
        if hasattr(dist, "all_gather_single"):
            flat = torch.empty(world * 2)
            dist.all_gather_single(flat, torch.full((2,), r1))
            _expect(torch.equal(flat, torch.arange(1, world + 1).float().repeat_interleave(2)), "all_gather_single")
        if hasattr(dist, "reduce_scatter_single"):
            o = torch.empty(2)
            dist.reduce_scatter_single(o, torch.full((2 * world,), r1))
            _expect(torch.all(o == _sum_of_ranks(world)), f"reduce_scatter_single: {o}")
        for name in ("gather_single", "gather_into_tensor"):
            if hasattr(dist, name):
                g = torch.empty(world * 2) if rank == 0 else None
                getattr(dist, name)(torch.full((2,), r1), g, dst=0)  # (input, gather_tensor)
                if rank == 0:
                    _expect(torch.equal(g, torch.arange(1, world + 1).float().repeat_interleave(2)), name)

    @add("gather / scatter")
    def _():
        g = [torch.empty(2) for _ in range(world)] if rank == 0 else None
        dist.gather(torch.full((2,), r1), g, dst=0)
        if rank == 0:
            _expect(all(torch.all(g[r] == r + 1) for r in range(world)), "gather")
        s = [torch.full((2,), float(r * 10)) for r in range(world)] if rank == 0 else None
        o = torch.empty(2)
        dist.scatter(o, s, src=0)
        _expect(torch.all(o == rank * 10), f"scatter: {o}")

    @add("reduce_scatter")
    def _():
        o = torch.empty(2)
        dist.reduce_scatter(o, [torch.full((2,), r1) for _ in range(world)])
        _expect(torch.all(o == _sum_of_ranks(world)), f"reduce_scatter: {o}")
        o = torch.empty(2)
        dist.reduce_scatter_tensor(o, torch.full((2 * world,), r1))
        _expect(torch.all(o == _sum_of_ranks(world)), f"reduce_scatter_tensor: {o}")

    @add("all_to_all")
    def _():
        o = torch.empty(world)
        dist.all_to_all_single(o, torch.full((world,), r1))
        _expect(torch.equal(o, torch.arange(1, world + 1).float()), f"all_to_all_single: {o}")
        outs = [torch.empty(1) for _ in range(world)]
        dist.all_to_all(outs, [torch.full((1,), r1 * 10 + r) for r in range(world)])
        _expect(all(float(outs[r]) == (r + 1) * 10 + rank for r in range(world)), "all_to_all")

    @add("barriers")
    def _():
        dist.barrier()
        dist.monitored_barrier(wait_all_ranks=True)

    @add("barrier(device_ids)")
    def _():
        dist.barrier(device_ids=[0])

    @add("p2p")
    def _():
        peer = (rank + 1) % world
        src = (rank - 1) % world
        if world > 1:
            reqs = [dist.isend(torch.full((3,), r1), peer), dist.irecv(t := torch.empty(3), src)]
            for q in reqs:
                q.wait()
            _expect(torch.all(t == src + 1), "isend/irecv")
            t2 = torch.empty(2)
            ops = [dist.P2POp(dist.isend, torch.full((2,), r1), peer), dist.P2POp(dist.irecv, t2, src)]
            for q in dist.batch_isend_irecv(ops):
                q.wait()
            _expect(torch.all(t2 == src + 1), "batch_isend_irecv")

    @add("object collectives")
    def _():
        objs = [None] * world
        dist.all_gather_object(objs, {"rank": rank})
        _expect(objs == [{"rank": r} for r in range(world)], f"all_gather_object: {objs}")
        lst = [rank, "x"] if rank == 0 else [None, None]
        dist.broadcast_object_list(lst, src=0)
        _expect(lst == [0, "x"], f"broadcast_object_list: {lst}")
        g = [None] * world if rank == 0 else None
        dist.gather_object(rank * 2, g, dst=0)
        if rank == 0:
            _expect(g == [r * 2 for r in range(world)], f"gather_object: {g}")
        o = [None]
        dist.scatter_object_list(o, [f"s{r}" for r in range(world)] if rank == 0 else None, src=0)
        _expect(o == [f"s{rank}"], f"scatter_object_list: {o}")
        if world > 1:
            if rank == 0:
                dist.send_object_list([{"a": 1}], dst=1)
            elif rank == 1:
                got = [None]
                dist.recv_object_list(got, src=0)
                _expect(got == [{"a": 1}], f"recv_object_list: {got}")

    @add("coalescing manager")
    def _():
        a, b = torch.full((2,), r1), torch.full((3,), r1)
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.all_reduce(a)
            dist.all_reduce(b)
        cm.wait()
        _expect(torch.all(a == _sum_of_ranks(world)) and torch.all(b == _sum_of_ranks(world)), "coalesced all_reduce")

    @add("new_group / subgroups")
    def _():
        g = dist.new_group(list(range(world)))
        t = torch.ones(2)
        dist.all_reduce(t, group=g)
        _expect(torch.all(t == world), "new_group")
        sub, subs = dist.new_subgroups(group_size=1)
        t = torch.full((2,), r1)
        dist.all_reduce(t, group=sub)
        _expect(torch.all(t == r1), "new_subgroups(group_size=1)")
        if world % 2 == 0:
            sub, _ = dist.new_subgroups(group_size=2)
            t = torch.full((2,), r1)
            dist.all_reduce(t, group=sub)
            base = rank - rank % 2
            _expect(torch.all(t == (base + 1) + (base + 2)), f"new_subgroups(2): {t}")
        sub, _ = dist.new_subgroups_by_enumeration([[r] for r in range(world)])
        dist.barrier(group=sub)

    @add("abort a subgroup")
    def _():
        g = dist.new_group(list(range(world)))
        t = torch.ones(2)
        dist.all_reduce(t, group=g)
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            abort(g)
        else:
            g.abort()

    @add("split_group")
    def _():
        if world % 2:
            return
        halves = [list(range(0, world // 2)), list(range(world // 2, world))]
        g = dist.split_group(split_ranks=halves)
        t = torch.full((2,), r1)
        dist.all_reduce(t, group=g)
        mine = halves[0] if rank < world // 2 else halves[1]
        _expect(torch.all(t == sum(r + 1 for r in mine)), f"split_group: {t}")

    @add("DeviceMesh")
    def _():
        from torch.distributed.device_mesh import init_device_mesh

        if world % 2:
            mesh = init_device_mesh("cpu", (world,))
            t = torch.full((2,), r1)
            dist.all_reduce(t, group=mesh.get_group())
            _expect(torch.all(t == _sum_of_ranks(world)), "mesh 1-D")
            return
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        t = torch.full((2,), r1)
        dist.all_reduce(t, group=mesh.get_group("tp"))
        tp = [r for r in range(world) if r // (world // 2) == rank // (world // 2)]
        _expect(torch.all(t == sum(r + 1 for r in tp)), f"mesh tp: {t}")
        t = torch.full((2,), r1)
        dist.all_reduce(t, group=mesh.get_group("dp"))
        dp = [r for r in range(world) if r % (world // 2) == rank % (world // 2)]
        _expect(torch.all(t == sum(r + 1 for r in dp)), f"mesh dp: {t}")

    @add("introspection")
    def _():
        _expect(dist.get_rank() == rank and dist.get_world_size() == world, "rank/size")
        _expect(dist.get_backend() == "ep", dist.get_backend())
        _expect(dist.get_process_group_ranks(dist.group.WORLD) == list(range(world)), "group ranks")

    @add("sequence numbers")
    def _():
        seq = dist.group.WORLD._get_backend(torch.device("cpu"))._get_sequence_number_for_group()
        every = [None] * world
        dist.all_gather_object(every, seq)
        _expect(len(set(every)) == 1 and seq > 0, f"sequence numbers: {every}")
        dist.all_reduce(torch.ones(1))
        after = dist.group.WORLD._get_backend(torch.device("cpu"))._get_sequence_number_for_group()
        _expect(after > seq, f"sequence number {seq} -> {after}")

    return out


# Calls that may raise (cleanly) instead of working, and why.
MAY_RAISE = {
    "split_group": "torch splits only groups bound to an accelerator whose backend supports splitting",
}


def walk(rank, world):
    """Returns {call: 'ok' | 'raised <type>: <message>'}; raises if a call left the group unusable
    or returned wrong values."""
    results = {}
    for name, fn in calls(rank, world):
        try:
            fn()
            results[name] = "ok"
        except AssertionError:
            raise
        except Exception as e:  # noqa: BLE001  a clean Python exception is an accepted outcome
            results[name] = f"raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            results[name + " (trace)"] = traceback.format_exc()[-800:]
        # The group is still usable, and in step.
        for _ in range(2):
            try:
                t = torch.ones(1)
                dist.all_reduce(t)
                break
            except RuntimeError:
                continue
        _expect(float(t) == world, f"after {name}: the group's all_reduce gave {float(t)}")
    return results
