"""EP buffer cases, run on one GPU per rank by test_ep_buffer.py. Every rank builds every
rank's inputs from the same seeds, so it can compute the expected results with pure torch."""

import torch
import torch.distributed as dist

import moelink

NUM_EXPERTS = 256
MAX_TOKENS = 128


def inputs(rank, tokens, hidden, topk, num_experts=NUM_EXPERTS, device="cuda"):
    g = torch.Generator().manual_seed(1000 * rank + 7 * tokens + topk + hidden)
    x = (torch.randn(tokens, hidden, generator=g) * (rank + 1)).to(torch.bfloat16)
    scores = torch.rand(tokens, num_experts, generator=g)
    idx = scores.topk(topk, dim=1).indices  # distinct experts per token
    idx[torch.rand(tokens, topk, generator=g) < 0.1] = -1  # some "no expert"
    w = torch.rand(tokens, topk, generator=g)
    return x.to(device), idx.to(device), w.to(device)


def expert_fn(y, e):
    """What 'expert' e computes in the tests: a scale, done in float32, rounded to bf16."""
    return (y.float() * (0.125 * (e + 1))).to(torch.bfloat16)


def ref_fp8(x):
    xs = x.float().view(x.shape[0], x.shape[1] // 128, 128)
    scale = xs.abs().amax(-1).clamp(min=1e-4) / 448.0
    return (xs / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(x.shape), scale


def check_round(buf, rank, world, tokens, hidden, topk, use_fp8, **kw):
    """One dispatch + combine round, checked against pure torch. The round always completes
    (combine runs even when dispatch was wrong) so that the ranks stay in step; the first
    problem found is raised at the end."""
    ne = kw.pop("num_experts", NUM_EXPERTS)
    nle = ne // world
    dev = kw.pop("device", "cuda")
    x, idx, w = inputs(rank, tokens, hidden, topk, num_experts=ne, device=dev)
    recv, count, handle, event, hook = buf.low_latency_dispatch(x, idx, MAX_TOKENS, ne, use_fp8=use_fp8,
                                                     round_scale=kw.get("round_scale", False),
                                                     async_finish=kw.get("async_finish", False),
                                                     return_recv_hook=kw.get("return_recv_hook", False))
    if kw.get("return_recv_hook"):
        hook()
    event.current_stream_wait()
    if dev == "cuda":
        # Wait in cudaDeviceSynchronize, not inside a pageable copy (.cpu()): with the emulated
        # NIC, whose thread issues CUDA copies, a thread blocked in such a copy holds up those
        # copies while the kernel still waits for them (see docs/EP.md).
        torch.cuda.synchronize()
    src_info, layout_range = handle[0].cpu(), handle[1].cpu()
    data, scales = recv if use_fp8 else (recv, None)
    everyone = [inputs(r, tokens, hidden, topk, num_experts=ne, device=dev) for r in range(world)]
    problems = []
    counts = count.cpu()
    for le in range(nle):
        e = rank * nle + le
        total = 0
        for r, (xr, ir, _) in enumerate(everyone):
            want = sorted((ir == e).any(1).nonzero().flatten().tolist())
            lr = int(layout_range[le, r])
            begin, n = lr >> 32, lr & 0xFFFFFFFF
            total += n
            if n != len(want):
                problems.append(f"expert {e} from rank {r}: {n} tokens, expected {len(want)}")
                continue
            got = src_info[le, begin:begin + n].tolist()
            if sorted(got) != want:
                problems.append(f"expert {e} from rank {r}: tokens {sorted(got)} != {want}")
                continue
            if n:
                order = torch.tensor(got, device=dev)
                rows = slice(begin, begin + n)
                if use_fp8:
                    q_ref, s_ref = ref_fp8(xr[order])
                    if kw.get("round_scale"):  # up to a power of two, exactly
                        bits = s_ref.view(torch.int32)
                        up = (bits & 0x7FFFFF) != 0
                        s_ref = torch.where(up, (bits & -0x800000) + 0x800000, bits).view(torch.float32)
                        q_ref = (xr[order].float().view(n, -1, 128) / s_ref.unsqueeze(-1)).to(
                            torch.float8_e4m3fn).view(n, -1)
                    if not torch.equal(scales[le, rows], s_ref):
                        problems.append(f"expert {e} from rank {r}: FP8 scales differ")
                    diff = (data[le, rows].float() - q_ref.float()).abs()
                    if not bool((diff <= q_ref.float().abs() * 0.126 + 2 ** -9).all()):
                        problems.append(f"expert {e} from rank {r}: FP8 data off by more than one e4m3 step")
                elif not torch.equal(data[le, rows], xr[order]):
                    problems.append(f"expert {e} from rank {r}: data differs")
        if int(counts[le]) != total:
            problems.append(f"recv_count[{le}] = {int(counts[le])}, expected {total}")
    # Combine: expert e scales its tokens by (e+1)/8; each token gets the weighted sum back.
    y = buf.get_next_combine_buffer(handle) if kw.get("zero_copy") else torch.empty(
        nle, world * MAX_TOKENS, hidden, dtype=torch.bfloat16, device=dev)
    src = (data.float().view(nle, -1, hidden // 128, 128) * scales.unsqueeze(-1)).view(nle, -1, hidden).to(
        torch.bfloat16) if use_fp8 else data
    for le in range(nle):
        y[le] = expert_fn(src[le], rank * nle + le)
    out, event, hook = buf.low_latency_combine(y, idx, w, handle, zero_copy=kw.get("zero_copy", False),
                                   async_finish=kw.get("async_finish", False),
                                   return_recv_hook=kw.get("return_recv_hook", False))
    if kw.get("return_recv_hook"):
        hook()
    event.current_stream_wait()
    if dev == "cuda":
        torch.cuda.synchronize()
    want = torch.zeros(tokens, hidden, dtype=torch.float32, device=dev)
    bound = torch.zeros_like(want)
    for k in range(topk):
        e = idx[:, k]
        valid = e >= 0
        xv = x
        if use_fp8:
            q, s = ref_fp8(x)
            xv = (q.float().view(tokens, hidden // 128, 128) * s.unsqueeze(-1)).view(tokens, hidden).to(torch.bfloat16)
        contrib = (xv.float() * (0.125 * (e.clamp(min=0) + 1)).unsqueeze(1)).to(torch.bfloat16).float()
        contrib = contrib * (w[:, k] * valid).unsqueeze(1)
        want += contrib
        bound += contrib.abs()
    # bf16: the kernel and this reference round alike (tolerance for summation order); FP8:
    # the kernel's e4m3 rounding may differ by one step (12.5%) per element from torch's.
    tol = bound * (0.13 if use_fp8 else 0.01) + 0.05
    if not bool(((out.float() - want).abs() <= tol).all()):
        bad = int(((out.float() - want).abs() > tol).sum())
        problems.append(f"combine: {bad} of {out.numel()} elements off")
    if problems:
        raise AssertionError(f"tokens={tokens} hidden={hidden} topk={topk} fp8={use_fp8} {kw}: " +
                             "; ".join(problems[:5]))


def _setup(rank):
    torch.cuda.set_device(rank % torch.cuda.device_count())  # one GPU: MOELINK_TEST_SHARE_GPU
    torch.manual_seed(0)


def routing_matrix(rank, world):
    _setup(rank)
    for hidden in (2048, 4096, 7168):
        buf = moelink.Buffer(None, MAX_TOKENS, hidden, NUM_EXPERTS)
        for r in range(world):
            assert buf.transport_of(r) == ("local" if r == rank else "nvlink")
        for topk in (1, 8, 16):
            for tokens in (1, 17, 128):
                for use_fp8 in (False, True):
                    check_round(buf, rank, world, tokens, hidden, topk, use_fp8)
        del buf
        torch.cuda.synchronize()
        dist.barrier()


def modes(rank, world):
    _setup(rank)
    buf = moelink.Buffer(None, MAX_TOKENS, 2048, NUM_EXPERTS)
    check_round(buf, rank, world, 64, 2048, 8, True, async_finish=True)
    check_round(buf, rank, world, 64, 2048, 8, False, return_recv_hook=True)
    check_round(buf, rank, world, 64, 2048, 8, False, zero_copy=True)
    check_round(buf, rank, world, 33, 2048, 4, True, round_scale=True)
    repeated_experts(rank, world)


def two_rounds_in_flight(rank, world):
    _setup(rank)
    hidden, nle = 2048, NUM_EXPERTS // world
    buf = moelink.Buffer(None, MAX_TOKENS, hidden, NUM_EXPERTS)
    outs = []
    rounds = []
    for seed_tokens in (40, 41):
        x, idx, w = inputs(rank, seed_tokens, hidden, 8)
        rounds.append((x, idx, w) + buf.low_latency_dispatch(x, idx, MAX_TOKENS, NUM_EXPERTS, use_fp8=False)[:3])
    for x, idx, w, recv, count, handle in rounds:  # combine both after both dispatches
        y = recv.clone()
        outs.append((buf.low_latency_combine(y, idx, w, handle)[0], x, idx, w))
    torch.cuda.synchronize()
    for out, x, idx, w in outs:
        want = (w * (idx >= 0)).sum(1, keepdim=True) * x.float()  # identity experts
        torch.testing.assert_close(out.float(), want.to(torch.bfloat16).float(), rtol=1e-2, atol=4e-2)


def cuda_graph(rank, world, capture_error_mode="global"):
    _setup(rank)
    hidden = 2048
    buf = moelink.Buffer(None, MAX_TOKENS, hidden, NUM_EXPERTS)
    x, idx, w = inputs(rank, 96, hidden, 8)
    static_x = x.clone()

    def step():
        recv, count, handle, _, _ = buf.low_latency_dispatch(static_x, idx, MAX_TOKENS, NUM_EXPERTS, use_fp8=False)
        return buf.low_latency_combine(recv, idx, w, handle)[0]

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(s)
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
        out = step()
    dist.barrier()
    for i in range(3):
        static_x.copy_(x * (i + 1))
        graph.replay()
        torch.cuda.synchronize()
        want = (w * (idx >= 0)).sum(1, keepdim=True) * (x * (i + 1)).float()
        torch.testing.assert_close(out.float(), want.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-1)
        dist.barrier()


def bad_input_raises(rank, world):
    _setup(rank)
    import pytest

    buf = moelink.Buffer(None, MAX_TOKENS, 2048, NUM_EXPERTS)
    x, idx, w = inputs(rank, 8, 2048, 4)
    with pytest.raises(ValueError, match="exceed num_max_dispatch_tokens_per_rank"):
        buf.low_latency_dispatch(torch.zeros(MAX_TOKENS + 1, 2048, dtype=torch.bfloat16, device="cuda"),
                     torch.zeros(MAX_TOKENS + 1, 4, dtype=torch.int64, device="cuda"), MAX_TOKENS, NUM_EXPERTS)
    with pytest.raises(TypeError, match="bfloat16"):
        buf.low_latency_dispatch(x.float(), idx, MAX_TOKENS, NUM_EXPERTS)
    with pytest.raises(ValueError, match="top-k must be"):
        buf.low_latency_dispatch(x, torch.zeros(8, 17, dtype=torch.int64, device="cuda"), MAX_TOKENS, NUM_EXPERTS)
    with pytest.raises(ValueError, match="num_experts"):
        buf.low_latency_dispatch(x, idx, MAX_TOKENS, 128)
    with pytest.raises(ValueError, match="multiple of 128"):
        moelink.Buffer(None, MAX_TOKENS, 2000, NUM_EXPERTS)

    def shifted(t):  # the same values, contiguous, 2 bytes past a 16-byte boundary
        s = torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)[1:1 + t.numel()].view_as(t)
        return s.copy_(t)

    with pytest.raises(ValueError, match="x must start at a 16-byte aligned address"):
        buf.low_latency_dispatch(shifted(x), idx, MAX_TOKENS, NUM_EXPERTS)
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, MAX_TOKENS, NUM_EXPERTS, use_fp8=False)
    with pytest.raises(ValueError, match="the dispatch's"):
        buf.low_latency_combine(recv, idx[:4].contiguous(), w[:4].contiguous(), handle)
    with pytest.raises(ValueError, match="x must start at a 16-byte aligned address"):
        buf.low_latency_combine(shifted(recv), idx, w, handle)
    with pytest.raises(ValueError, match="out must start at a 16-byte aligned address"):
        buf.low_latency_combine(recv, idx, w, handle, out=shifted(torch.empty_like(x)))
    buf.low_latency_combine(recv, idx, w, handle)  # the refused call launched nothing; the round completes
    check_round(buf, rank, world, 8, 2048, 4, False)  # still works


def _repeated_inputs(rank, rnd, tokens, hidden, device):
    g = torch.Generator().manual_seed(31 * rank + rnd)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    a = torch.randint(0, NUM_EXPERTS, (tokens, 1), generator=g)
    b = torch.randint(0, NUM_EXPERTS, (tokens, 1), generator=g)
    idx = torch.cat([a, b, a, torch.full((tokens, 1), -1)], 1)  # expert a twice, -1 last
    w = torch.rand(tokens, 4, generator=g)
    return x.to(device), idx.to(device), w.to(device)


def repeated_experts(rank, world, device="cuda"):
    """A token that lists an expert twice takes two of its slots (one row on the wire to the
    rank), and combine adds both weighted outputs; three rounds, so stale signals would show."""
    if device == "cuda":
        _setup(rank)
    hidden, tokens, nle = 1024, 24, NUM_EXPERTS // world
    buf = moelink.Buffer(None, MAX_TOKENS, hidden, NUM_EXPERTS)
    for rnd in range(3):
        x, idx, w = _repeated_inputs(rank, rnd, tokens, hidden, device)
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, MAX_TOKENS, NUM_EXPERTS, use_fp8=False)
        if device == "cuda":
            torch.cuda.synchronize()
        src_info, layout_range = handle[0].cpu(), handle[1].cpu()
        everyone = [_repeated_inputs(r, rnd, tokens, hidden, "cpu") for r in range(world)]
        for le in range(nle):
            e = rank * nle + le
            assert int(count[le]) == sum(int((ir == e).sum()) for _, ir, _ in everyone), (le, int(count[le]))
            for r, (xr, ir, _) in enumerate(everyone):
                lr = int(layout_range[le, r])
                begin, n = lr >> 32, lr & 0xFFFFFFFF
                want = sorted(t for t, k in (ir == e).nonzero().tolist())
                got = src_info[le, begin:begin + n].tolist()
                assert sorted(got) == want, (le, r, got, want)
                assert torch.equal(recv[le, begin:begin + n].cpu(), xr[got]), (le, r)
        y = torch.empty_like(recv)
        for le in range(nle):
            y[le] = expert_fn(recv[le], rank * nle + le)
        out = buf.low_latency_combine(y, idx, w, handle)[0]
        want = torch.zeros(tokens, hidden, dtype=torch.float32, device=device)
        for k in range(4):
            e = idx[:, k]
            contrib = (x.float() * (0.125 * (e.clamp(min=0) + 1)).unsqueeze(1)).to(torch.bfloat16).float()
            want += contrib * (w[:, k] * (e >= 0)).unsqueeze(1)
        torch.testing.assert_close(out.float(), want.to(torch.bfloat16).float(), rtol=1e-2, atol=5e-2)


def timeout_masks_absent_rank(rank, world, num_experts=NUM_EXPERTS):
    _setup(rank)
    hidden = 2048
    buf = moelink.Buffer(None, MAX_TOKENS, hidden, num_experts)
    absent = world - 1
    dist.barrier()
    if rank != absent:
        x, idx, w = inputs(rank, 32, hidden, 8, num_experts=num_experts)
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, MAX_TOKENS, num_experts, use_fp8=False, timeout_us=300000)
        out = buf.low_latency_combine(recv, idx, w, handle, timeout_us=300000)[0]
        torch.cuda.synchronize()
        active = buf.active_ranks().tolist()
        assert active[absent] == 0 and all(active[r] == 1 for r in range(world) if r != absent), active
        nle = num_experts // world
        live = (idx >= 0) & (idx // nle != absent)
        want = (w * live).sum(1, keepdim=True) * x.float()
        torch.testing.assert_close(out.float(), want.to(torch.bfloat16).float(), rtol=1e-2, atol=4e-2)
    torch.cuda.synchronize()
    dist.barrier()


def few_experts(rank, world):
    """64 experts (fewer local experts than the other cases, more tokens per expert), hidden
    384 (an odd number of FP8 scale groups per row), and the absent-rank timeout."""
    _setup(rank)
    ne = 64
    buf = moelink.Buffer(None, MAX_TOKENS, 2048, ne)
    for tokens, topk, use_fp8 in ((128, 8, True), (128, 8, False), (17, 1, True), (128, 16, False)):
        check_round(buf, rank, world, tokens, 2048, topk, use_fp8, num_experts=ne)
    check_round(buf, rank, world, 64, 2048, 8, True, num_experts=ne, return_recv_hook=True)
    del buf
    # hidden 384: an odd number of FP8 scale groups per row (3)
    buf = moelink.Buffer(None, MAX_TOKENS, 384, ne)
    for tokens, topk, use_fp8 in ((128, 8, True), (17, 4, True), (64, 8, False)):
        check_round(buf, rank, world, tokens, 384, topk, use_fp8, num_experts=ne)
    del buf
    torch.cuda.synchronize()
    dist.barrier()
    timeout_masks_absent_rank(rank, world, num_experts=ne)


SMALL_CASES = [(t, k, f) for k in (1, 8) for t in (1, 17, 128) for f in (False, True)]


def _cross_host_rounds(rank, world, rph, cross, sizes, check_peer=None):
    """Rounds over buffers whose peers in other (virtual) hosts of `rph` ranks are reached by
    `cross` ('proxy' or 'ibgda'): each (hidden, cases) of `sizes`, plus hook and zero-copy
    with async_finish at hidden 2048."""
    for hidden, cases in sizes:
        buf = moelink.Buffer(None, MAX_TOKENS, hidden, NUM_EXPERTS)
        for r in range(world):
            want = "local" if r == rank else ("nvlink" if r // rph == rank // rph else cross)
            assert buf.transport_of(r) == want, (r, buf.transport_of(r), want)
            if check_peer is not None:
                check_peer(buf, r, want)
        for tokens, topk, use_fp8 in cases:
            check_round(buf, rank, world, tokens, hidden, topk, use_fp8)
        if hidden == 2048:
            check_round(buf, rank, world, 64, hidden, 8, True, return_recv_hook=True)
            check_round(buf, rank, world, 64, hidden, 8, False, zero_copy=True, async_finish=True)
        del buf
        torch.cuda.synchronize()
        dist.barrier()


def proxy_path(rank, world, ranks_per_host=2, transport="shm"):
    """Run with MOELINK_EP_RANKS_PER_HOST=2: ranks of the other half are proxy peers (GPU
    writes into mapped host memory, a CPU proxy carries them over the transfer engine)."""
    _setup(rank)

    def engine_transport(buf, r, want):
        if want == "proxy":
            assert buf._impl.proxy_transport_of(r) == transport, buf._impl.proxy_transport_of(r)

    _cross_host_rounds(rank, world, ranks_per_host, "proxy",
                       ((2048, SMALL_CASES), (4096, [(128, 16, True), (64, 8, False)])), engine_transport)
    two_rounds_in_flight(rank, world)


def proxy_path_tcp(rank, world):
    """The proxy path over the engine's tcp transport (MOELINK_TRANSPORT=tcp)."""
    _setup(rank)
    buf = moelink.Buffer(None, MAX_TOKENS, 2048, NUM_EXPERTS)
    for r in range(world):
        if buf.transport_of(r) == "proxy":
            assert buf._impl.proxy_transport_of(r) == "tcp", buf._impl.proxy_transport_of(r)
    for tokens, topk, use_fp8 in ((17, 8, True), (128, 8, False)):
        check_round(buf, rank, world, tokens, 2048, topk, use_fp8)


def ibgda_emulated(rank, world):
    """Run with MOELINK_EP_RANKS_PER_HOST=world/2 and MOELINK_EP_IBGDA=emulate: ranks of the
    other half are IBGDA peers. The kernels post RDMA WRITE WQEs on a queue pair per peer, ring
    its doorbell and poll its completions, and the emulated NIC (a host thread reading the
    queues) carries the WRITEs into the peer's GPU buffer: everything of IBGDA but the NIC."""
    _setup(rank)
    _cross_host_rounds(rank, world, world // 2, "ibgda",
                       ((2048, SMALL_CASES), (7168, [(128, 8, True), (128, 16, False)])))
    two_rounds_in_flight(rank, world)
    repeated_experts(rank, world)
    # The emulated NIC's thread issues CUDA copies; in the default (global) capture mode such a
    # call from another thread invalidates the capture (docs/EP.md). A real NIC makes none.
    cuda_graph(rank, world, capture_error_mode="thread_local")
    timeout_masks_absent_rank(rank, world)


def host_path(rank, world):
    """The same checks through the CPU-tensor implementation (no GPU needed)."""
    buf = moelink.Buffer(None, MAX_TOKENS, 256, NUM_EXPERTS)
    for topk in (1, 8):
        for tokens in (0, 1, 17, 64):
            for use_fp8 in (False, True):
                check_round(buf, rank, world, tokens, 256, topk, use_fp8, device="cpu")
    check_round(buf, rank, world, 9, 256, 4, True, device="cpu", round_scale=True)
    check_round(buf, rank, world, 9, 256, 4, False, device="cpu", zero_copy=True)
    big = moelink.Buffer(None, MAX_TOKENS, 1024, NUM_EXPERTS)
    for use_fp8 in (False, True):
        check_round(big, rank, world, 33, 1024, 16, use_fp8, device="cpu")
    repeated_experts(rank, world, device="cpu")
    import pytest
    x, idx, w = inputs(rank, 8, 256, 4, device="cpu")
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, MAX_TOKENS, NUM_EXPERTS, use_fp8=False)
    with pytest.raises(ValueError, match="the dispatch's"):
        buf.low_latency_combine(recv, idx[:4], w[:4], handle)
    # dispatch / combine are the normal mode's (DeepEP's names): the low-latency arguments are
    # refused with the name to call, not taken as the other mode.
    with pytest.raises(TypeError, match="low_latency_dispatch"):
        buf.dispatch(x, idx, MAX_TOKENS, NUM_EXPERTS)
    with pytest.raises(TypeError, match="low_latency_combine"):
        buf.combine(recv, idx, w, handle)
    # update_members on a CPU buffer: nothing to remap (the host path follows the group's
    # mask by itself), and the buffer keeps working.
    buf.update_members()
    check_round(buf, rank, world, 17, 256, 4, False, device="cpu")


CASES = ["routing_matrix", "modes", "two_rounds_in_flight", "cuda_graph", "bad_input_raises",
         "timeout_masks_absent_rank", "few_experts"]
