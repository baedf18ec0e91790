"""Processes of the Mooncake-compatibility tests (test_mooncake_compat.py): the flows of Mooncake's
own elastic tests, written against Mooncake's names (``pg.*`` with the group first,
``MooncakeBackendOptions``, ``ProposalStatus``) with only the imports and the backend name
changed. Each checks its results against a local computation over the ranks it expects active."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta


def _init(rank, world, port, options, timeout=60):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=timeout))
    dist.init_process_group("ep", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout),
                            pg_options=options)


def _wait_until(predicate, what, timeout_s=60.0, poll_s=0.05):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)


def _sum_of(ranks):
    return sum(r + 1 for r in ranks)


def _all_reduce(rank):
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + 1], dtype=torch.int32)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    return int(t.item()), work


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _rejoin(rank, world, port, **options):
    """A replacement process's whole part in Mooncake's flows: init with
    MooncakeBackendOptions(world, True, ...), join_group, then one all_reduce over every rank."""
    import torch.distributed as dist

    from moelink.compat.mooncake import pg

    _init(rank, world, port, pg.MooncakeBackendOptions(world, True, **options))
    pg.join_group(dist.group.WORLD)
    value, work = _all_reduce(rank)
    assert value == _sum_of(range(world)), value
    assert pg.get_local_success(work)
    assert pg.get_active_ranks(dist.group.WORLD).tolist() == [1] * world
    dist.destroy_process_group()
    return {"rank": rank}


def recovery(rank, world, port, victim, replacement=False):
    """Mooncake's replacement flow: a rank dies, the survivors go on, a replacement inits with
    MooncakeBackendOptions(n, True) and calls join_group, the survivors poll get_peer_state and
    recover_ranks returns ProposalStatus.Applied."""
    import torch.distributed as dist

    from moelink.compat.mooncake import pg

    if replacement:
        return _rejoin(rank, world, port)
    res = {"rank": rank}
    import torch

    mirror = torch.zeros(world, dtype=torch.int32)  # SGLang's way: the group keeps this tensor up to date
    _init(rank, world, port, pg.MooncakeBackendOptions(mirror))
    backend = dist.group.WORLD
    value, work = _all_reduce(rank)
    assert value == _sum_of(range(world)) and pg.get_local_success(work)
    assert pg.get_failed_ranks_hint(work).tolist() == [0] * world
    assert mirror.tolist() == [1] * world
    epoch0 = pg.get_current_epoch(backend)
    if rank == victim:
        _die()
    value, work = _all_reduce(rank)  # the op that finds the victim gone
    survivors = [r for r in range(world) if r != victim]
    assert value == _sum_of(survivors), value
    assert mirror.tolist() == [int(r != victim) for r in range(world)], mirror  # no pg call in between
    hint = [0] * world
    hint[victim] = 1
    assert pg.get_failed_ranks_hint(work).tolist() == hint, pg.get_failed_ranks_hint(work)
    assert not pg.get_local_success(work)
    mask = [1] * world
    mask[victim] = 0
    assert pg.get_active_ranks(backend).tolist() == mask
    assert pg.get_current_epoch(backend) > epoch0
    value, work = _all_reduce(rank)
    assert value == _sum_of(survivors) and pg.get_local_success(work)
    _wait_until(lambda: pg.get_peer_state(backend, [victim])[0], "the replacement")
    resp = pg.recover_ranks(backend, [victim])
    assert resp.status == pg.ProposalStatus.Applied, resp
    value, work = _all_reduce(rank)
    assert value == _sum_of(range(world)), value
    assert pg.get_active_ranks(backend).tolist() == [1] * world and mirror.tolist() == [1] * world
    res["epochs"] = [epoch0, pg.get_current_epoch(backend)]
    dist.destroy_process_group()
    return res


def undetected(rank, world, port, victim, replacement=False):
    """A rank dies while the group runs no op (as in EP-only serving, where the kernels, not the
    group, see it go): get_peer_state turns False for it and True once its replacement waits,
    and recover_ranks (which agrees the dead process out on the way) readmits the replacement."""
    import torch.distributed as dist

    from moelink.compat.mooncake import pg

    if replacement:
        return _rejoin(rank, world, port)
    _init(rank, world, port, pg.MooncakeBackendOptions(world))
    value, _ = _all_reduce(rank)
    assert value == _sum_of(range(world))
    if rank == victim:
        _die()
    backend = dist.group.WORLD
    assert pg.get_active_ranks(backend)[victim] == 1  # nothing found it gone yet
    # The first poll may still see the victim itself alive, the first recover_ranks agree it
    # out before its replacement waits: a Rejected answer is agreed by every rank, so the
    # loop stays in step.
    deadline = time.monotonic() + 60
    while True:
        _wait_until(lambda: pg.get_peer_state(backend, [victim])[0], "the replacement")
        resp = pg.recover_ranks(backend, [victim])
        if resp.status == pg.ProposalStatus.Applied:
            break
        assert time.monotonic() < deadline and "no replacement process waiting" in resp.reject_reason, resp
        time.sleep(0.1)
    assert pg.get_active_ranks(backend).tolist() == [1] * world
    value, _ = _all_reduce(rank)
    assert value == _sum_of(range(world)), value
    dist.destroy_process_group()
    return {"rank": rank}


def extension(rank, world, port, replacement=False):
    """Mooncake's extension flow: ranks [0, world-1) create the group with world_size=world-1 and
    MooncakeBackendOptions(world); the last rank inits with world_size=world,
    MooncakeBackendOptions(world, True) and join_group; recover_ranks readmits it. Then p2p both
    ways with the joiner, all_gather_into_tensor and reduce_scatter_tensor over the whole group,
    and a subgroup created the same way (the primaries name its first ranks, the joiner all)."""
    import torch
    import torch.distributed as dist

    from moelink.compat.mooncake import pg

    joiner = world - 1
    res = {"rank": rank}
    if rank < joiner:
        _init(rank, joiner, port, pg.MooncakeBackendOptions(world))
        sub = dist.new_group(ranks=list(range(joiner)), backend="ep", pg_options=pg.MooncakeBackendOptions(world))
        res["world_size_before"] = dist.get_world_size()
        value, _ = _all_reduce(rank)
        assert value == _sum_of(range(joiner)), value
        assert pg.get_active_ranks(dist.group.WORLD).tolist() == [1] * joiner + [0]
        t = torch.tensor([rank + 1], dtype=torch.int32)
        dist.all_reduce(t, group=sub)
        assert t.item() == _sum_of(range(joiner))
        _wait_until(lambda: all(pg.get_peer_state(dist.group.WORLD, [joiner])), "the joiner")
        resp = pg.recover_ranks(dist.group.WORLD, [joiner])
        assert resp.status == pg.ProposalStatus.Applied, resp
        _wait_until(lambda: pg.get_peer_state(sub, [joiner])[0], "the joiner in the subgroup")
        resp = pg.recover_ranks(sub, [joiner])
        assert resp.status == pg.ProposalStatus.Applied, resp
    else:
        _init(rank, world, port, pg.MooncakeBackendOptions(world, True))
        sub = dist.new_group(ranks=list(range(world)), backend="ep", pg_options=pg.MooncakeBackendOptions(world, True))
        pg.join_group(dist.group.WORLD)
        pg.join_group(sub)
    res["world_size_after"] = dist.get_world_size()
    value, work = _all_reduce(rank)
    assert value == _sum_of(range(world)) and pg.get_local_success(work), value
    t = torch.tensor([rank + 1], dtype=torch.int32)
    dist.all_reduce(t, group=sub)
    assert t.item() == _sum_of(range(world)), t
    out = torch.zeros(world, dtype=torch.int32)
    dist.all_gather_into_tensor(out, torch.tensor([rank + 1], dtype=torch.int32))
    assert out.tolist() == [r + 1 for r in range(world)], out
    rs = torch.zeros(1, dtype=torch.int32)
    dist.reduce_scatter_tensor(rs, torch.arange(1, world + 1, dtype=torch.int32))
    assert rs.item() == (rank + 1) * world, rs
    # p2p: the joiner and the last primary, both ways
    peer = {joiner: joiner - 1, joiner - 1: joiner}.get(rank)
    if peer is not None:
        send = torch.full((1024,), rank, dtype=torch.int32)
        recv = torch.empty(1024, dtype=torch.int32)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)])
        for w in works:
            w.wait()
        assert all(pg.get_local_success(w) for w in works)
        assert torch.all(recv == peer)
    dist.barrier()
    dist.destroy_process_group()
    return res


def graceful_leave(rank, world, port, leaver, linger_s=0.0, replacement=False):
    """A rank deactivates itself and destroys its group; the others mask it out at their next op
    and readmit a replacement later."""
    import torch.distributed as dist

    from moelink.compat.mooncake import pg

    if replacement:
        return _rejoin(rank, world, port)
    res = {"rank": rank}
    _init(rank, world, port, pg.MooncakeBackendOptions(world))
    value, _ = _all_reduce(rank)
    assert value == _sum_of(range(world))
    if rank == leaver:
        resp = pg.deactivate_ranks(dist.group.WORLD, [rank])
        assert resp.status == pg.ProposalStatus.Applied, resp
        try:
            _all_reduce(rank)
            raise AssertionError("an op after leaving ran")
        except RuntimeError as e:
            res["after_leave"] = str(e)
        dist.destroy_process_group()
        time.sleep(linger_s)  # the process lives on after leaving: the others must not wait for it
        return res
    stayers = [r for r in range(world) if r != leaver]
    t0 = time.monotonic()
    value, work = _all_reduce(rank)
    res["first_op_s"] = time.monotonic() - t0
    assert value == _sum_of(stayers), value
    assert pg.get_active_ranks(dist.group.WORLD).tolist() == [int(r != leaver) for r in range(world)]
    _wait_until(lambda: pg.get_peer_state(dist.group.WORLD, [leaver])[0], "the replacement")
    assert pg.recover_ranks(dist.group.WORLD, [leaver]).status == pg.ProposalStatus.Applied
    value, _ = _all_reduce(rank)
    assert value == _sum_of(range(world)), value
    dist.destroy_process_group()
    return res


def manual(rank, world, port, victim, replacement=False):
    """Mooncake's manual flow (auto_deactivate_on_failure=False, auto_sync_on_failure=False):
    per-op failure hints and local success, sync_after_failure, deactivate_ranks of the failed
    rank, then a replacement recovered. moelink masks a failed rank out by agreement whatever the
    options (the README's table), so deactivate_ranks finds it out already."""
    import torch.distributed as dist

    from moelink.compat.mooncake import pg

    opts = dict(auto_deactivate_on_failure=False, auto_sync_on_failure=False)
    if replacement:
        return _rejoin(rank, world, port, **opts)
    _init(rank, world, port, pg.MooncakeBackendOptions(world, False, **opts))
    backend = dist.group.WORLD
    value, work = _all_reduce(rank)
    assert value == _sum_of(range(world)) and pg.get_local_success(work)
    assert pg.get_failed_ranks_hint(work).tolist() == [0] * world
    if rank == victim:
        _die()
    survivors = [r for r in range(world) if r != victim]
    value, work = _all_reduce(rank)
    assert value == _sum_of(survivors), value
    assert not pg.get_local_success(work)
    assert pg.get_failed_ranks_hint(work).tolist() == [int(r == victim) for r in range(world)]
    resp = pg.sync_after_failure(backend)
    assert resp.status in (pg.SyncAfterFailureStatus.Reconciled, pg.SyncAfterFailureStatus.NoPending), resp
    assert not pg.get_peer_state(backend, [victim])[0]
    resp = pg.deactivate_ranks(backend, [victim])
    assert resp.status in (pg.ProposalStatus.Applied, pg.ProposalStatus.AppliedWithDroppedRanks), resp
    value, work = _all_reduce(rank)
    assert value == _sum_of(survivors) and pg.get_local_success(work)
    _wait_until(lambda: pg.get_peer_state(backend, [victim])[0], "the replacement")
    assert pg.recover_ranks(backend, [victim]).status == pg.ProposalStatus.Applied
    value, _ = _all_reduce(rank)
    assert value == _sum_of(range(world))
    dist.destroy_process_group()
    return {"rank": rank}


def refusals(rank, world, port, replacement=False):
    """What the compat layer refuses, with the group still usable after each: a live rank's
    eviction and a rank without a waiting replacement (Rejected, agreed by all), out-of-range
    ranks, the settings moelink has no counterpart for; and the active_ranks mirror tensor."""
    import torch
    import torch.distributed as dist

    from moelink.compat.mooncake import pg

    mirror = torch.full((world + 2,), 7, dtype=torch.int32)
    _init(rank, world, port, pg.MooncakeBackendOptions(mirror, False, world))
    assert mirror.tolist() == [1] * world + [0, 0], mirror
    backend = dist.group.WORLD
    out = {}
    resp = pg.deactivate_ranks(backend, [(rank + 1) % world])  # every rank names a live peer
    assert resp.status == pg.ProposalStatus.Rejected and "alive" in resp.reject_reason, resp
    assert pg.get_active_ranks(backend).tolist() == [1] * world
    # recover_ranks of an active rank changes nothing and applies
    assert pg.recover_ranks(backend, [0]).status == pg.ProposalStatus.Applied
    for call in (lambda: pg.get_peer_state(backend, [world]), lambda: pg.recover_ranks(backend, [-1])):
        try:
            call()
            raise AssertionError("an out-of-range rank was accepted")
        except ValueError as e:
            assert isinstance(e, RuntimeError) and "outside the group" in str(e), e
    for call, word in ((lambda: pg.set_p2p_timeout_us(10), "P2P"),
                       (lambda: pg.set_fault_reconciliation_window_us(10), "reconciliation"),
                       (lambda: pg.set_transfer_engine(object()), "TransferEngine"),
                       (lambda: pg.set_device_filter(["mlx5_0"]), "RDMA")):
        try:
            call()
            raise AssertionError(f"{word}: no error")
        except RuntimeError as e:
            assert word in str(e), e
    pg.set_transfer_engine(None)
    try:
        pg.get_active_ranks(object())
        raise AssertionError("a non-group was accepted")
    except TypeError:
        pass
    value, work = _all_reduce(rank)
    assert value == _sum_of(range(world)) and pg.get_local_success(work)
    pg.join_group(backend)  # an original, active rank: nothing to do
    # the backend object stands for its group, as Mooncake's functions accept either
    import moelink

    ep = moelink.get_backend()
    assert pg.get_active_ranks(ep) is pg.get_active_ranks(backend)
    assert pg.get_current_epoch(ep) == pg.get_current_epoch(backend)
    assert ep.ep_buffer(8, 256, 4 * world).group is backend  # moelink's own lookup of the same group
    out["epoch"] = pg.get_current_epoch(backend)
    out["synced"] = pg.get_num_synced_ranks(backend)
    dist.destroy_process_group()
    return out


# ---- the EP buffer (mooncake_ep_buffer.Buffer) ----

class AsDeepEP:
    """cases_ep.check_round's interface (DeepEP's low-latency names) over Mooncake's Buffer, so
    that the compat Buffer's rounds are checked by the same independent reference."""

    def __init__(self, buf, active_ranks=None, timeout_us=-1):
        self.buf, self.active_ranks, self.timeout_us = buf, active_ranks, timeout_us

    def low_latency_dispatch(self, x, idx, max_tokens, num_experts, use_fp8=True, round_scale=False,
                             async_finish=False, return_recv_hook=False):
        assert not round_scale, "Mooncake's dispatch has no round_scale"
        recv, count, handle, event, hook = self.buf.dispatch(x, idx, self.active_ranks, max_tokens, num_experts,
                                                             self.timeout_us, use_fp8=use_fp8, async_finish=async_finish,
                                                             return_recv_hook=return_recv_hook)
        assert (hook is None) != return_recv_hook
        return recv, count, handle, event, hook

    def low_latency_combine(self, y, idx, w, handle, zero_copy=False, async_finish=False, return_recv_hook=False):
        out, event, hook = self.buf.combine(y, idx, w, self.active_ranks, self.timeout_us, handle, zero_copy=zero_copy,
                                            async_finish=async_finish, return_recv_hook=return_recv_hook)
        return out, event, hook

    def get_next_combine_buffer(self, handle):
        return self.buf.get_next_combine_buffer(handle)


def ep_rounds(rank, world, device="cpu"):
    """Rounds through Mooncake's Buffer checked against pure torch (cases_ep.check_round): sizes,
    bf16 and FP8, zero_copy, hooks, two shapes on one Buffer; a caller's active_ranks; bad input."""
    import warnings

    import pytest
    import torch

    from moelink.compat.mooncake.mooncake_ep_buffer import Buffer

    import cases_ep

    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    group = __import__("torch.distributed", fromlist=["group"]).group.WORLD
    hidden, experts = 256, cases_ep.NUM_EXPERTS
    size = max(Buffer.get_ep_buffer_size_hint(cases_ep.MAX_TOKENS, h, world, experts) for h in (hidden, 1024))
    buf = Buffer(group, num_ep_buffer_bytes=size)
    active = torch.ones(world, dtype=torch.int32, device=device)
    rounds = AsDeepEP(buf, active_ranks=active)
    for tokens, topk, fp8 in ((0, 1, False), (17, 8, False), (64, 8, True), (1, 1, True)):
        cases_ep.check_round(rounds, rank, world, tokens, hidden, topk, fp8, device=device)
    cases_ep.check_round(rounds, rank, world, 9, hidden, 4, False, device=device, zero_copy=True)
    cases_ep.check_round(rounds, rank, world, 33, hidden, 4, True, device=device, return_recv_hook=True)
    cases_ep.check_round(rounds, rank, world, 33, 1024, 16, False, device=device)  # a second shape
    assert active.tolist() == [1] * world
    # Mooncake's own test passes a tensor of num_tokens entries: ignored (with a warning), as there
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cases_ep.check_round(AsDeepEP(buf, torch.ones(cases_ep.MAX_TOKENS, dtype=torch.int32, device=device)),
                             rank, world, 5, hidden, 2, False, device=device)
    assert any("ignored" in str(w.message) for w in seen), [str(w.message) for w in seen]
    # refusals, each before anything is sent (every rank refuses alike, so the group stays in step)
    x, idx, w = cases_ep.inputs(rank, 8, hidden, 4, device=device)
    with pytest.raises(ValueError, match="int32"):
        buf.dispatch(x, idx, active.float(), cases_ep.MAX_TOKENS, experts, -1)
    with pytest.raises(ValueError, match="num_ep_buffer_bytes"):
        buf.dispatch(torch.zeros(8, 4096, dtype=torch.bfloat16, device=device), idx, active, cases_ep.MAX_TOKENS,
                     experts, -1)
    with pytest.raises(ValueError, match="handle"):
        buf.combine(x, idx, w, active, -1, ("not", "a", "handle"))
    cases_ep.check_round(rounds, rank, world, 17, hidden, 8, False, device=device)
    # DeepEP's zero_copy idiom (Mooncake's own test uses it): the outputs copied into the combine
    # buffer, combine called with another tensor of that shape; the same result as without.
    recv, _, handle, _, _ = buf.dispatch(x, idx, active, cases_ep.MAX_TOKENS, experts, -1, use_fp8=False)
    nle = experts // world
    y = torch.stack([cases_ep.expert_fn(recv[le], rank * nle + le) for le in range(nle)])
    plain = buf.combine(y, idx, w, active, -1, handle)[0].clone()
    buf.get_next_combine_buffer(handle)[:] = y
    staged = buf.combine(y.clone(), idx, w, active, -1, handle, zero_copy=True)[0]
    assert torch.equal(plain, staged)
    with pytest.raises(ValueError, match="zero_copy"):
        buf.combine(y[:, :1], idx, w, active, -1, handle, zero_copy=True)
    return {"transports": [buf.transport_of(r) for r in range(world)]}


def ep_elastic(rank, world, port, victim, device="cpu", replacement=False):
    """SGLang's elastic EP loop in Mooncake's names: the group's mask mirrored into the tensor the
    loop passes to every dispatch/combine; a rank dies, the survivors' rounds go on over the
    others (checked against pure torch over the live experts) and their tensor shows it out;
    a replacement's new Buffer and the survivors' update_ep_member reconnect it; full rounds."""
    import torch
    import torch.distributed as dist

    from moelink.compat.mooncake import pg
    from moelink.compat.mooncake.mooncake_ep_buffer import Buffer

    import cases_ep

    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    hidden, experts, max_tokens = 512, 4 * world, cases_ep.MAX_TOKENS
    mirror = torch.ones(world, dtype=torch.int32, device=device)
    _init(rank, world, port, pg.MooncakeBackendOptions(mirror, replacement, world))
    group = dist.group.WORLD
    size = Buffer.get_ep_buffer_size_hint(max_tokens, hidden, world, experts)
    res = {"rank": rank}

    def full_round(seed_rank=rank):
        cases_ep.check_round(AsDeepEP(buf, mirror, timeout_us=10_000_000), rank, world, 24, hidden, 4, False,
                             device=device, num_experts=experts)

    if replacement:
        pg.join_group(group)
        buf = Buffer(group, num_ep_buffer_bytes=size)  # meets the survivors' update_ep_member
        full_round()
        res["mirror"] = mirror.tolist()
        dist.destroy_process_group()
        return res
    buf = Buffer(group, num_ep_buffer_bytes=size)
    full_round()
    if rank == victim:
        _die()
    # The survivors' rounds over the live ranks: tokens for the dead rank's experts come back as nothing.
    for i in range(3):
        x, idx, w = cases_ep.inputs(rank, 24, hidden, 4, num_experts=experts, device=device)
        recv, count, handle, _, _ = buf.dispatch(x, idx, mirror, max_tokens, experts, 2_000_000, use_fp8=False)
        nle = experts // world
        y = torch.stack([cases_ep.expert_fn(recv[le], rank * nle + le) for le in range(nle)])
        out, _, _ = buf.combine(y, idx, w, mirror, 2_000_000, handle)
        if device == "cuda":
            torch.cuda.synchronize()
        live = (idx >= 0) & (idx // nle != victim)
        want = torch.zeros(x.shape, dtype=torch.float32, device=device)
        for k in range(idx.shape[1]):
            e = idx[:, k].clamp(min=0)
            contrib = (x.float() * (0.125 * (e + 1)).unsqueeze(1)).to(torch.bfloat16).float()
            want += contrib * (w[:, k] * live[:, k]).unsqueeze(1)
        err = (out.float() - want).abs().max().item()
        assert err <= 0.02 * want.abs().max().item() + 0.1, f"round {i} after the loss: off by {err}"
        assert mirror.tolist() == [int(r != victim) for r in range(world)], (i, mirror.tolist())
    _wait_until(lambda: pg.get_peer_state(group, [victim])[0], "the replacement")
    assert pg.recover_ranks(group, [victim]).status == pg.ProposalStatus.Applied
    buf.update_ep_member()
    full_round()
    res["mirror"] = mirror.tolist()
    dist.destroy_process_group()
    return res
