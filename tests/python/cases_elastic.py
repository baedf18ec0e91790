"""Processes of the elastic-membership tests: a loop of all_reduce and all_gather over a group
whose store the parent hosts (so that any rank, rank 0 included, may die), a rank that kills
itself before op `kill_op`, survivors that check every result against the mask they report,
readmit a replacement and go on over the whole group."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta


def _init(rank, world, port, extension=False, timeout=60, on_peer_failure="continue"):
    import torch.distributed as dist

    import moelink

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=timeout))
    dist.init_process_group("ep", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout),
                            pg_options=moelink.EpOptions(is_extension=extension, on_peer_failure=on_peer_failure))


def _readmit(victim, wait_s):
    """On the active ranks: waits until `victim`'s replacement is ready, then readmits it."""
    import moelink

    deadline = time.monotonic() + wait_s
    while not moelink.get_peer_state([victim])[0]:
        assert time.monotonic() < deadline, "the replacement never became ready"
        time.sleep(0.2)
    moelink.recover_ranks([victim])


def _step(i, rank, world, log):
    """One iteration (two ops); checks results against the mask; appends to log."""
    import torch
    import torch.distributed as dist

    import moelink

    x = torch.full((1000,), float((rank + 1) * (i + 1)), dtype=torch.float64)
    mask = moelink.get_active_ranks().tolist()
    t0 = time.monotonic()
    work = dist.all_reduce(x, async_op=True)
    work.wait()
    t1 = time.monotonic()
    for r in moelink.failed_ranks(work):  # the mask the op ran over: before it, less what it lost
        mask[r] = 0
    want = sum((r + 1) * (i + 1) for r in range(world) if mask[r])
    assert torch.all(x == want), f"iteration {i}: all_reduce gave {x[0].item()}, the sum over mask {mask} is {want}"
    outs = [torch.full((7,), -1.0) for _ in range(world)]
    mask2 = moelink.get_active_ranks().tolist()
    work = dist.all_gather(outs, torch.full((7,), float(rank * 100 + i)), async_op=True)
    work.wait()
    for r in moelink.failed_ranks(work):
        mask2[r] = 0
    for r in range(world):
        expect = float(r * 100 + i) if mask2[r] else 0.0
        assert torch.all(outs[r] == expect), f"iteration {i}: all_gather slot {r} holds {outs[r][0].item()}, mask {mask2}"
    log.append({"i": i, "mask": mask, "mask2": mask2, "allreduce_s": t1 - t0, "t": time.time()})


def member(rank, world, port, victim, kill_iter, rejoin_iter, end_iter, replacement=False):
    import torch.distributed as dist

    log, result = [], {"rank": rank, "replacement": replacement}
    _init(rank, world, port, extension=replacement)
    start = rejoin_iter if replacement else 0
    i = start
    while i < end_iter:
        if not replacement and rank == victim and i == kill_iter:
            os.kill(os.getpid(), signal.SIGKILL)
        if not replacement and rank != victim and i == rejoin_iter:
            _readmit(victim, 60)
            result["recovered_at"] = time.time()
        _step(i, rank, world, log)
        i += 1
    dist.destroy_process_group()
    result["log"] = log
    return result


def staller(rank, world, port, stall_rank, stall_s, iters):
    import torch.distributed as dist

    import moelink

    result, log = {"rank": rank}, []
    _init(rank, world, port, timeout=30)
    for i in range(iters):
        if rank == stall_rank and i == iters // 2:
            time.sleep(stall_s)
        _step(i, rank, world, log)
    result["masks"] = [e["mask"] for e in log]
    result["epoch"] = moelink.get_backend().epoch
    dist.destroy_process_group()
    return result


def raiser(rank, world, port, victim):
    """on_peer_failure="raise": the op that loses a peer raises on every survivor; the next runs."""
    import torch
    import torch.distributed as dist

    import moelink

    result = {"rank": rank}
    _init(rank, world, port, on_peer_failure="raise")
    dist.all_reduce(torch.ones(4))
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
        result["first"] = "ok"
    except Exception as e:  # noqa: BLE001
        result["first"] = str(e)
    result["first_s"] = time.monotonic() - t0
    x = torch.ones(4)
    w = dist.all_reduce(x, async_op=True)
    w.wait()
    result["second"] = x.tolist()
    result["failed_ranks"] = moelink.failed_ranks(w)
    result["mask"] = moelink.get_active_ranks().tolist()
    try:
        dist.send(torch.ones(2), victim)
        result["send"] = "ok"
    except Exception as e:  # noqa: BLE001
        result["send"] = str(e)
    dist.destroy_process_group()
    return result


def gpu_member(rank, world, port, replacement=False):
    """2 GPUs: CUDA all_reduce and an EP round trip; rank 1 dies; rank 0 goes on over itself
    (CUDA collectives over the host route, the EP buffer with rank 1 masked out), then
    readmits a replacement; both bring the EP buffer up to date (``update_members``), check a
    low-latency and a normal-mode round trip over both ranks, and run CUDA all_reduce over
    the whole group (back on the in-host kernels)."""
    import torch
    import torch.distributed as dist

    import cases_normal
    import moelink

    res = {"rank": rank, "replacement": replacement}
    hidden, experts, tokens = 1024, 16, 64
    torch.cuda.set_device(rank % torch.cuda.device_count())
    _init(rank, world, port, extension=replacement)

    def cuda_allreduce(i, n=4096):
        x = torch.full((n,), float(rank + 1 + i), device="cuda")
        mask = moelink.get_active_ranks().tolist()
        w = dist.all_reduce(x, async_op=True)
        w.wait()  # stream-ordered: raises only an error already known
        w.get_future().wait()  # blocks until the op is over: raises its error (a loss on the GPU)
        for r in moelink.failed_ranks(w):
            mask[r] = 0
        want = sum(r + 1 + i for r in range(world) if mask[r])
        assert torch.all(x == want).item(), f"op {i}: {x[0].item()} != {want} over {mask}"
        return mask

    def ep_round(buf, local_only):
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).cuda()
        idx = torch.rand(tokens, experts, generator=g).topk(4, dim=1).indices.cuda()
        w = torch.ones(tokens, 4, device="cuda")
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, 128, experts, use_fp8=False, timeout_us=5_000_000)
        out, _, _ = buf.low_latency_combine(recv, idx, w, handle, timeout_us=5_000_000)
        torch.cuda.synchronize()
        per_rank = experts // world
        counted = (idx // per_rank == rank).sum(1) if local_only else (idx >= 0).sum(1)
        want = x.float() * counted.unsqueeze(1).float()
        err = (out.float() - want).abs().max().item()
        assert err <= 0.05 * want.abs().max().item() + 1e-3, f"EP round trip off by {err}"

    def rejoined(buf):
        """After the readmission, on both ranks: the buffer follows the group again."""
        buf.update_members()
        res["ep_active"] = buf.active_ranks().tolist()
        res["transports"] = [buf.transport_of(r) for r in range(world)]
        ep_round(buf, local_only=False)
        res["normal_path"] = buf._normal_path(torch.device("cuda"))
        cases_normal.check_round(buf, rank, world, 512, hidden, 4, False, 1, "cuda", seed=3)
        ep_round(buf, local_only=False)  # the low-latency halves after the normal mode's calls
        res["ep_rejoined"] = "ok"

    if replacement:
        res["path_before"] = moelink.get_backend().cuda_path()
        rejoined(moelink.Buffer(None, 128, hidden, experts))
        res["masks"] = [cuda_allreduce(1000 + k, n=4096 << (3 * k)) for k in range(5)]
        res["path"] = moelink.get_backend().cuda_path()
    else:
        buf = moelink.Buffer(None, 128, hidden, experts)
        for i in range(3):  # both halves of the buffer in use before the failure
            ep_round(buf, local_only=False)
        for i in range(5):
            cuda_allreduce(i)
        # A CUDA graph captured before the failure: replayed after it, its kernels give up
        # at once (no hang, no crash, the group unharmed); it has to be captured again.
        gx = torch.ones(4096, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            with torch.cuda.graph(graph, stream=side):
                dist.all_reduce(gx)
        torch.cuda.current_stream().wait_stream(side)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.all(gx == world), gx[:4]
        res["path_before"] = moelink.get_backend().cuda_path()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        try:
            cuda_allreduce(5)
            res["inflight"] = "completed"
        except Exception as e:  # noqa: BLE001
            res["inflight"] = str(e)
        res["detect_s"] = time.monotonic() - t0
        res["masks_after"] = [cuda_allreduce(6 + k) for k in range(5)]
        res["path_after"] = moelink.get_backend().cuda_path()
        t0 = time.monotonic()
        graph.replay()  # the stale graph
        torch.cuda.synchronize()
        res["stale_graph_s"] = time.monotonic() - t0
        res["after_stale_graph"] = cuda_allreduce(20)
        ep_round(buf, local_only=True)
        res["ep_after"] = "ok"
        _readmit(1, 120)
        res["ep_active_before_update"] = buf.active_ranks().tolist()
        res["normal_path_before_update"] = buf._normal_path(torch.device("cuda"))
        rejoined(buf)
        res["masks"] = [cuda_allreduce(1000 + k, n=4096 << (3 * k)) for k in range(5)]
        res["path"] = moelink.get_backend().cuda_path()
    dist.destroy_process_group()
    return res


def _survivor_after(res, outcomes, victim, full_sums):
    """A survivor's record once its ops are settled: their outcomes, the mask and CUDA route after
    the change; then it readmits the victim's replacement and sums over every rank again."""
    import moelink

    res["outcomes"] = {str(i): o for i, o in sorted(outcomes.items())}
    res["mask"] = moelink.get_active_ranks().tolist()
    res["path_after"] = moelink.get_backend().cuda_path()
    _readmit(victim, 120)
    res["full"] = full_sums(5000)
    res["path"] = moelink.get_backend().cuda_path()


def gpu_trio(rank, world, port, victim=1, kill_iter=12, iters=40, replacement=False):
    """3 GPU processes (or 3 on one GPU): a loop of async CUDA all_reduce (one- and two-shot
    sizes) and all_gather_into_tensor with ops in flight (up to 6 iterations on rank 2, 1 on
    rank 0, so the survivors issue ahead of each other) and no host sync between issues; the
    victim kills itself with ops in flight. Survivors record every op's outcome
    (its values, or that it failed); the parent checks that they agree op by op and that the
    ops after the change run over the survivors on the in-host kernels. Then a replacement is
    readmitted and the group runs full sums, in-host again."""
    import random

    import torch
    import torch.distributed as dist

    import moelink

    res = {"rank": rank, "replacement": replacement}
    torch.cuda.set_device(rank % torch.cuda.device_count())
    _init(rank, world, port, extension=replacement)
    sizes = [1000, 1 << 19]  # floats: one-shot, and two-shot for 3 ranks (2 MiB)

    def full_sums(base):
        out = []
        for k in range(4):
            n = sizes[k % 2]
            x = torch.full((n,), float(rank + 1 + base + k), device="cuda")
            w = dist.all_reduce(x, async_op=True)
            w.get_future().wait()
            out.append(x[0].item() == sum(r + 1 + base + k for r in range(world)) and bool(torch.all(x == x[0])))
        return out

    if replacement:
        res["full"] = full_sums(5000)
        res["path"] = moelink.get_backend().cuda_path()
    else:
        rnd = random.Random(rank)
        pending, outcomes = [], {}

        def settle(item):
            i, x, w, ag, w2 = item
            try:
                w.get_future().wait()  # this op is over on the GPU (later ones may still run)
                w2.get_future().wait()
                w.wait()  # the current stream after it, for the reads below
                w2.wait()
                vals = x.unique().tolist()
                slots = [ag[r * 64:(r + 1) * 64].unique().tolist() for r in range(world)]
                outcomes[i] = {"sum": vals, "slots": slots}
            except Exception as e:  # noqa: BLE001
                outcomes[i] = {"error": str(e)[:300]}

        for i in range(iters):
            n = sizes[i % 2]
            x = torch.full((n,), float(rank + 1 + i), device="cuda")
            y = torch.full((64,), float(100 * (rank + 1) + i), device="cuda")
            ag = torch.full((world * 64,), -1.0, device="cuda")
            torch.cuda._sleep(rnd.randint(0, 2_000_000))  # the stream runs behind the host
            works = []
            for issue in (lambda: dist.all_reduce(x, async_op=True),
                          lambda: dist.all_gather_into_tensor(ag, y, async_op=True)):
                try:  # every op is issued, whatever the one before did (the ranks stay in step)
                    works.append(issue())
                except Exception as e:  # noqa: BLE001
                    outcomes[i] = {"error": "at issue: " + str(e)[:300]}
            if len(works) == 2:
                pending.append((i, x, works[0], ag, works[1]))
            if rank == victim and i == kill_iter:
                os.kill(os.getpid(), signal.SIGKILL)
            while len(pending) > (6 if rank == 2 else 1):  # rank 2 runs ahead of rank 0
                settle(pending.pop(0))
            if i < kill_iter:
                time.sleep(rnd.random() * 0.01)
        while pending:
            settle(pending.pop(0))
        _survivor_after(res, outcomes, victim, full_sums)
    dist.destroy_process_group()
    return res


def gpu_two_level(rank, world, port, victim=3, kill_iter=5, iters=14, replacement=False):
    """4 GPU processes as 2 virtual hosts of 2 (MOELINK_RANKS_PER_HOST=2): a loop of async CUDA
    all_reduce of 2 MiB (two levels while the group is whole: route host+nvlink), one op in
    flight; the victim kills itself with its op issued. Survivors record every op's outcome (its
    values, or that it failed) and the route after the change; then a replacement is readmitted
    and the group sums over all ranks again."""
    import torch
    import torch.distributed as dist

    import moelink

    res = {"rank": rank, "replacement": replacement}
    torch.cuda.set_device(rank % torch.cuda.device_count())
    _init(rank, world, port, extension=replacement)
    n = 1 << 19

    def full_sums(base):
        out = []
        for k in range(3):
            x = torch.full((n,), float(rank + 1 + base + k), device="cuda")
            dist.all_reduce(x)
            out.append(x.unique().tolist() == [float(sum(r + 1 + base + k for r in range(world)))])
        return out

    def graph_sums(base):
        # an all_reduce captured over the areas of the group's current epoch, replayed with new inputs
        from cuda_support import capture

        x = torch.zeros(n, device="cuda")
        graph = capture(lambda: dist.all_reduce(x))
        out = []
        for k in range(3):
            x.fill_(float(rank + 1 + base + k))
            graph.replay()
            torch.cuda.synchronize()
            out.append(x.unique().tolist() == [float(sum(r + 1 + base + k for r in range(world)))])
        return out

    if replacement:
        res["full"] = full_sums(5000)
        res["path"] = moelink.get_backend().cuda_path()
        res["graph"] = graph_sums(7000)
    else:
        outcomes, pending = {}, None

        def settle(item):
            i, x, w = item
            try:
                w.get_future().wait()  # raises when the op failed (wait() alone orders the stream)
                w.wait()
                outcomes[i] = {"sum": x.unique().tolist()}
            except Exception as e:  # noqa: BLE001
                outcomes[i] = {"error": str(e)[:300]}

        for i in range(iters):
            x = torch.full((n,), float(rank + 1 + i), device="cuda")
            try:
                w = dist.all_reduce(x, async_op=True)
            except Exception as e:  # noqa: BLE001
                outcomes[i], w = {"error": "at issue: " + str(e)[:300]}, None
            if i == 0:
                w.wait()
                res["path_before"] = moelink.get_backend().cuda_path()
            if rank == victim and i == kill_iter:
                os.kill(os.getpid(), signal.SIGKILL)
            if pending:
                settle(pending)
            pending = (i, x, w) if w else None
        if pending:
            settle(pending)
        _survivor_after(res, outcomes, victim, full_sums)
        res["graph"] = graph_sums(7000)
    dist.destroy_process_group()
    return res


def grower(rank, world, port, initial, replacement=False):
    """A group created by ranks [0, initial) of `world`; the rest join as extensions and
    extend_group_size_to(world) readmits them."""
    import torch
    import torch.distributed as dist

    import moelink

    res = {"rank": rank}
    if rank < initial:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group("ep", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60),
                                pg_options=moelink.EpOptions(initial_world_size=initial))
        res["mask_before"] = moelink.get_active_ranks().tolist()
        x = torch.full((1000,), float(rank + 1))
        dist.all_reduce(x)
        res["sum_before"] = x[0].item()
        outs = [torch.full((3,), -1.0) for _ in range(world)]
        dist.all_gather(outs, torch.full((3,), float(rank)))
        res["gather_before"] = [o[0].item() for o in outs]
        deadline = time.monotonic() + 60
        while moelink.get_num_synced_ranks() < world:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        moelink.extend_group_size_to(world)
    else:
        _init(rank, world, port, extension=True)
    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x)
    res["sum_after"] = x[0].item()
    res["mask_after"] = moelink.get_active_ranks().tolist()
    dist.destroy_process_group()
    return res


def gpu_cross_host_member(rank, world, port, victim, replacement=False):
    """GPU ranks on 2 virtual hosts (MOELINK_EP_RANKS_PER_HOST=world/2): the other host over
    the CPU proxy, or over IBGDA through the emulated NIC (MOELINK_EP_IBGDA=emulate). `victim`
    dies after a few EP round trips; the survivors' round trips go on without it; a replacement
    is readmitted and every rank's Buffer reconnects it in place (``update_members``): exact
    round trips over all ranks again, the normal mode too."""
    import torch
    import torch.distributed as dist

    import cases_normal
    import moelink

    res = {"rank": rank, "replacement": replacement}
    hidden, experts, tokens, topk = 1024, 16, 64, 4
    torch.cuda.set_device(rank % torch.cuda.device_count())
    _init(rank, world, port, extension=replacement, timeout=120)

    def ep_round(buf, seed):
        """A round trip with identity experts: each token comes back as x times the
        weights of its top-k entries on active ranks."""
        g = torch.Generator().manual_seed(rank * 1000 + seed)
        x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).cuda()
        idx = torch.rand(tokens, experts, generator=g).topk(topk, dim=1).indices.cuda()
        w = torch.rand(tokens, topk, generator=g).cuda()
        mask = moelink.get_active_ranks()
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, 128, experts, use_fp8=False, timeout_us=20_000_000)
        out, _, _ = buf.low_latency_combine(recv, idx, w, handle, timeout_us=20_000_000)
        torch.cuda.synchronize()
        live = mask.cuda()[idx // (experts // world)].float()
        want = x.float() * (w * live).sum(1, keepdim=True)
        err = (out.float() - want).abs().max().item()
        assert err <= 0.02 * want.abs().max().item() + 1e-2, f"round {seed} over {mask.tolist()}: off by {err}"
        return mask.tolist()

    def rejoined(buf):
        buf.update_members()
        res["ep_active"] = buf.active_ranks().tolist()
        res["transports"] = [buf.transport_of(r) for r in range(world)]
        res["engine"] = [buf._impl.proxy_transport_of(r) for r in range(world)]  # "" unless a proxy peer
        res["masks"] = [ep_round(buf, 100 + i) for i in range(4)]
        cases_normal.check_round(buf, rank, world, 256, hidden, topk, False, 1, "cuda", seed=5)
        res["masks"].append(ep_round(buf, 200))  # the low-latency halves after the normal mode
        dist.barrier()
        res["rejoined"] = "ok"

    if replacement:
        rejoined(moelink.Buffer(None, 128, hidden, experts))
    else:
        buf = moelink.Buffer(None, 128, hidden, experts)
        res["transports_before"] = [buf.transport_of(r) for r in range(world)]
        res["masks_before"] = [ep_round(buf, i) for i in range(3)]
        dist.barrier()
        if rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while moelink.get_active_ranks()[victim]:  # the group agrees on the loss
            assert time.monotonic() < deadline, "the victim was never masked out"
            dist.all_reduce(torch.ones(4))
        res["masks_after"] = [ep_round(buf, 10 + i) for i in range(3)]
        _readmit(victim, 120)
        rejoined(buf)
    dist.destroy_process_group()
    return res
