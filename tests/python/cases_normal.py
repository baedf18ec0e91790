"""Normal-mode (DeepEP's layout / dispatch / combine) checks, run in every rank of a group:
every output against a pure-torch reference that each rank computes from every rank's inputs
(inputs are drawn from per-rank seeds, so any rank can regenerate any other's)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import moelink
from moelink import normal


def make_inputs(rank, tokens, hidden, topk, num_experts, device, seed=0, holes=True):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = (torch.randn(tokens, hidden, generator=g) * (rank + 1)).to(torch.bfloat16)
    scores = torch.rand(tokens, num_experts, generator=g)
    idx = scores.topk(topk, dim=1).indices.to(torch.int64)
    if holes and tokens:
        drop = torch.rand(tokens, topk, generator=g) < 0.1
        idx[drop] = -1
    w = torch.rand(tokens, topk, generator=g).float()
    return x.to(device), idx.to(device), w.to(device)


def fp8_of(x):
    q, s = moelink.host_ep.quantize_fp8(x.float().cpu().to(torch.bfloat16), False)
    return q.to(x.device), s.to(x.device)


def ranks_of(idx, num_experts, world):
    """[tokens, world] bool: which ranks hold an expert a token selected (-1 selects none)."""
    idx = idx.cpu()
    valid = idx >= 0
    in_rank = torch.zeros(idx.shape[0], world, dtype=torch.bool)
    token = torch.arange(idx.shape[0]).unsqueeze(1).expand_as(idx)
    in_rank[token[valid], idx[valid] // (num_experts // world)] = True
    return in_rank


def reference(rank, world, tokens, hidden, topk, num_experts, seed):
    """What `rank` receives: rows by source rank, then token; local top-k ids; pairs per expert."""
    nle = num_experts // world
    rows, idxs, ws, srcs, per_expert = [], [], [], [], torch.zeros(nle, dtype=torch.int64)
    for s in range(world):
        x, idx, w = make_inputs(s, tokens, hidden, topk, num_experts, "cpu", seed)
        local = (idx >= rank * nle) & (idx < (rank + 1) * nle)
        keep = local.any(1)  # the tokens of source s that reach `rank`, in token order
        rows.append(x[keep])
        idxs.append(torch.where(local, idx - rank * nle, torch.full_like(idx, -1))[keep])
        ws.append(torch.where(local, w, torch.zeros_like(w))[keep])
        srcs.append(keep.nonzero().flatten())
        per_expert += torch.bincount(idx[local] - rank * nle, minlength=nle)
    return torch.cat(rows), torch.cat(idxs), torch.cat(ws), torch.cat(srcs), per_expert


def reference_sources(rank, world, tokens, hidden, topk, num_experts, seed):
    """The source rank of each row `rank` receives, in the order it receives them."""
    nle = num_experts // world
    out = []
    for s in range(world):
        _, idx, _ = make_inputs(s, tokens, hidden, topk, num_experts, "cpu", seed)
        out += [s] * int(((idx >= rank * nle) & (idx < (rank + 1) * nle)).any(1).sum())
    return torch.tensor(out, dtype=torch.int64)


def expert(y, rank):
    """The stand-in for the experts: a per-rank scaling, in bf16."""
    return (y.float() * (rank + 1)).to(torch.bfloat16)


def check_round(buf, rank, world, tokens, hidden, topk, use_fp8, alignment, device, seed, worst=0, config=None):
    ne = buf.num_experts
    x, idx, w = make_inputs(rank, tokens, hidden, topk, ne, device, seed)
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, ne)
    # The layout against a direct count.
    valid = idx >= 0
    ref_in_rank = ranks_of(idx, ne, world)
    hosts = buf._hosts_seen_here(torch.device(device))  # ranks per host on the two-hop route, else 0
    if hosts:  # tokens per host
        assert torch.equal(per_rdma.cpu(), ref_in_rank.view(tokens, world // hosts, hosts).any(2).sum(0).int())
    else:
        assert per_rdma is None
    assert torch.equal(in_rank.cpu(), ref_in_rank)
    assert torch.equal(per_rank.cpu(), ref_in_rank.sum(0).to(torch.int32))
    assert torch.equal(per_expert.cpu(), torch.bincount(idx[valid].cpu(), minlength=ne).to(torch.int32))
    xin = fp8_of(x) if use_fp8 else x
    recv_x, r_idx, r_w, counts, handle, event = buf.dispatch(
        xin, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=w, expert_alignment=alignment, num_worst_tokens=worst, config=config)
    ref_x, ref_idx, ref_w, ref_src, ref_pe = reference(rank, world, tokens, hidden, topk, ne, seed)
    n = ref_x.shape[0]
    data = recv_x[0] if use_fp8 else recv_x
    assert data.shape[0] == max(n, worst), (data.shape, n, worst)
    if use_fp8:
        q, s = fp8_of(ref_x)
        assert torch.equal(recv_x[0][:n].cpu().view(torch.uint8), q.cpu().view(torch.uint8))
        assert torch.equal(recv_x[1][:n].cpu(), s.cpu())
    else:
        assert torch.equal(recv_x[:n].cpu(), ref_x)
    assert torch.equal(r_idx[:n].cpu(), ref_idx)
    assert torch.equal(r_w[:n].cpu(), ref_w)
    assert torch.equal(handle[3][:n].cpu().long(), ref_src)
    if handle[-1].path == "two_hop":
        # recv_src_meta (source rank, token) and the per-source-rank prefix sums
        src_rank = reference_sources(rank, world, tokens, hidden, topk, ne, seed)
        assert torch.equal(handle[2][:n, 0].cpu().long(), src_rank)
        assert torch.equal(handle[2][:n, 1].cpu().long(), ref_src)
        assert torch.equal(handle[0].cpu().long(), torch.bincount(src_rank, minlength=world).cumsum(0))
    if worst:
        assert counts == []
        assert torch.all(r_idx[n:] == -1)
    else:
        assert counts == [(c + alignment - 1) // alignment * alignment for c in ref_pe.tolist()], (counts, ref_pe)
    # Cached dispatch: the same rows again.
    again = buf.dispatch(xin, handle=handle)
    assert again[1] is None and again[2] is None and again[3] is None and again[4] is None
    got = again[0][0] if use_fp8 else again[0]
    assert torch.equal(got[:n].cpu().view(torch.uint8), data[:n].cpu().view(torch.uint8))
    # Combine: every rank returns its experts' outputs; the token sums them.
    y = expert(ref_x if not use_fp8 else recv_x[0].float().cpu().to(torch.bfloat16)[:n], rank)
    y_full = torch.zeros(data.shape[0], hidden, dtype=torch.bfloat16)
    y_full[:n] = y
    combined, combined_w, _ = buf.combine(y_full.to(device), handle, topk_weights=r_w)
    combined_nw, none_w, _ = buf.combine(y_full.to(device), handle)
    assert none_w is None
    assert torch.equal(combined.cpu(), combined_nw.cpu())
    # Rings of 8 slots filled 1 and 3 at a time: every stream wraps many times, so a slot handed
    # back too early (or never) shows as a wrong sum (or a timeout).
    for chunk in (1, 3):
        small, small_w, _ = buf.combine(y_full.to(device), handle, topk_weights=r_w, config=moelink.Config(24, chunk, 8))
        assert torch.equal(small.cpu(), combined.cpu()) and torch.equal(small_w.cpu(), combined_w.cpu())
    if not use_fp8:
        acc = torch.zeros(tokens, hidden)
        for r in range(world):
            sel = ref_in_rank[:, r]
            acc[sel] += expert(x.cpu()[sel], r).float()
        torch.testing.assert_close(combined.cpu().float(), acc.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
    want_w = torch.where(idx.cpu() >= 0, w.cpu(), torch.zeros_like(w.cpu()))
    torch.testing.assert_close(combined_w.cpu(), want_w)
    # Bias is added once per token.
    b0 = torch.full((tokens, hidden), 0.5, dtype=torch.bfloat16, device=device)
    with_bias, _, _ = buf.combine(y_full.to(device), handle, bias=(b0, None))
    torch.testing.assert_close(with_bias.cpu().float(), combined_nw.cpu().float() + 0.5, rtol=1e-2, atol=1e-2)
    return handle


def routing(rank, world, device="cpu", hiddens=(2048,), big_tokens=4096):
    """Random routing with -1 entries; top-k 1 and 8; 0, 1 and many tokens; BF16 and FP8;
    expert alignment 1 and 128; fixed-size outputs (num_worst_tokens)."""
    ne = 8 * world
    for hidden in hiddens:
        buf = moelink.Buffer(None, 128, hidden, ne)
        seed = 0
        for topk in (1, 8):
            for tokens in (0, 1, 37, big_tokens):
                for use_fp8 in (False, True):
                    seed += 1
                    check_round(buf, rank, world, tokens, hidden, topk, use_fp8, 1 if tokens % 2 else 128, device,
                                seed)
        check_round(buf, rank, world, 37, hidden, 8, False, 1, device, 99, worst=37 * world)
        # A config of its own (fewer channels).
        check_round(buf, rank, world, 300, hidden, 8, False, 1, device, 100, config=moelink.Config(8, 4, 64))


def bad_input(rank, world, device="cpu"):
    """Wrong shapes, dtypes and handles raise before anything moves; the buffer stays usable."""
    ne = 8 * world
    buf = moelink.Buffer(None, 128, 256, ne)
    other = moelink.Buffer(None, 128, 256, ne)
    x, idx, w = make_inputs(rank, 16, 256, 4, ne, device, 7)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, ne)
    kw = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
              topk_weights=w)
    with pytest.raises(TypeError, match="bfloat16"):
        buf.dispatch(x.float(), **kw)
    with pytest.raises(ValueError, match=r"\[tokens, 256\]"):
        buf.dispatch(x[:, :128], **kw)
    with pytest.raises(ValueError, match="is_token_in_rank"):
        buf.dispatch(x[:8], **kw)  # layout tensors of another call
    with pytest.raises(ValueError, match="required"):
        buf.dispatch(x, topk_idx=idx, topk_weights=w)
    with pytest.raises(ValueError, match="topk_weights"):
        buf.dispatch(x, **dict(kw, topk_weights=w.double()))
    with pytest.raises(ValueError, match="int64"):
        buf.get_dispatch_layout(idx.int(), ne)
    with pytest.raises(ValueError, match="num_sms"):
        moelink.Config(3)
    recv, _, r_w, _, handle, _ = buf.dispatch(x, **kw)
    with pytest.raises(ValueError, match="another Buffer"):
        other.combine(recv, handle)
    with pytest.raises(ValueError, match="rows"):
        buf.combine(recv[:-1] if recv.shape[0] else torch.zeros(1, 256, dtype=torch.bfloat16, device=device), handle)
    with pytest.raises(ValueError, match="handle"):
        buf.combine(recv, ("not", "a", "handle"))
    if handle[-1].path == "nvlink" and recv.shape[0]:
        # Views 2 bytes into their storage: the kernels move rows in 16-byte units.
        def odd(t):
            return torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)[1:t.numel() + 1].view_as(t).copy_(t)

        with pytest.raises(ValueError, match="16-byte aligned"):
            buf.combine(odd(recv), handle)
        with pytest.raises(ValueError, match="16-byte aligned"):
            buf.dispatch(odd(x), **kw)
        with pytest.raises(ValueError, match="16-byte aligned"):
            buf.dispatch(odd(x), handle=handle)
    with pytest.raises(ValueError, match="takes no topk"):
        buf.dispatch(x, handle=handle, topk_idx=idx)
    with pytest.raises(ValueError, match="tokens"):
        buf.dispatch(x[:8], handle=handle)
    # More rows arrive than num_worst_tokens allows: raises on the ranks where that happens.
    n = reference(rank, world, 16, 256, 4, ne, 7)[0].shape[0]
    if handle[-1].path == "nvlink":
        # The kernels do not wait on the host there: rows past num_worst_tokens are dropped and
        # the ranks where that happened raise at their next call, which still runs everywhere.
        buf.dispatch(x, num_worst_tokens=1, **kw)
        torch.cuda.synchronize()
        if n > 1:
            with pytest.raises(ValueError, match="num_worst_tokens"):
                buf.dispatch(x, **kw)
        else:
            buf.dispatch(x, **kw)
    elif n > 1:
        with pytest.raises(ValueError, match="num_worst_tokens"):
            buf.dispatch(x, num_worst_tokens=1, **kw)
    else:
        buf.dispatch(x, num_worst_tokens=1, **kw)
    # Still usable, on every rank.
    check_round(buf, rank, world, 16, 256, 4, False, 1, device, 8)


def autograd(rank, world, device="cpu"):
    """dispatch_with_grad / combine_with_grad: gradients of x and topk_weights against a
    reference computed from every rank's inputs."""
    ne = 4 * world
    hidden, tokens, topk = 256, 64, 4
    buf = moelink.Buffer(None, 128, hidden, ne)
    x, idx, w = make_inputs(rank, tokens, hidden, topk, ne, device, 11)
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    recv_x, r_idx, r_w, counts, handle = normal.dispatch_with_grad(buf, x, idx, w)
    y = (recv_x.float() * (rank + 1)).to(torch.bfloat16)
    out = normal.combine_with_grad(buf, y, handle)
    g = torch.Generator().manual_seed(5 + rank)
    go = torch.randn(tokens, hidden, generator=g).to(device)
    loss = (out.float() * go).sum() + (r_w * (rank + 1)).sum()
    loss.backward()
    nle = ne // world
    in_rank = ranks_of(idx, ne, world).float()
    scale = (in_rank * torch.arange(1, world + 1).float()).sum(1, keepdim=True)
    ref_gx = (go.cpu() * scale)
    torch.testing.assert_close(x.grad.cpu().float(), ref_gx.to(torch.bfloat16).float(), rtol=2e-2, atol=2e-2)
    ref_gw = torch.where(idx.cpu() >= 0, (idx.cpu() // nle + 1).float(), torch.zeros(tokens, topk))
    torch.testing.assert_close(w.grad.cpu(), ref_gw)


def low_latency_names(rank, world, device="cpu"):
    """DeepEP's low-latency names reach the low-latency mode; dispatch/combine are the normal
    mode's and refuse the low-latency arguments."""
    ne = 4 * world
    buf = moelink.Buffer(None, 32, 256, ne)
    x, idx, w = make_inputs(rank, 8, 256, 2, ne, device, 3, holes=False)
    stats = torch.zeros(buf.num_local_experts, dtype=torch.int32, device=device)
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, 32, ne, cumulative_local_expert_recv_stats=stats,
                                                         use_fp8=False)
    assert torch.equal(stats.cpu(), count.cpu().to(torch.int32))
    with pytest.raises(TypeError, match="low_latency_combine"):  # no mode is guessed from the arguments
        buf.combine(recv, idx, w, handle)
    buf.low_latency_combine(recv, idx, w, handle)
    assert moelink.Buffer.get_low_latency_rdma_size_hint(32, 256, world, ne) > 0


def all_cpu(rank, world, big_tokens=4096, hiddens=(2048,)):
    routing(rank, world, "cpu", hiddens, big_tokens)
    bad_input(rank, world, "cpu")
    autograd(rank, world, "cpu")
    low_latency_names(rank, world, "cpu")
    losses = training_loop(rank, world, "cpu")
    dist.barrier()
    return losses


def two_hop_cpu(rank, world, expect="two_hop", big_tokens=1024):
    """The normal mode's cases on a group split into (virtual) hosts: the route the group
    agrees on is `expect` ("two_hop", or "group" with MOELINK_EP_TWO_HOP=0)."""
    path = moelink.Buffer(None, 128, 256, 4 * world)._normal_path(torch.device("cpu"))
    assert path == expect, path
    return all_cpu(rank, world, big_tokens=big_tokens)


def async_events(rank, world, device="cuda"):
    """previous_event orders a dispatch after work on another stream; async_finish hands back
    an event the caller waits on."""
    ne = 4 * world
    buf = moelink.Buffer(None, 128, 256, ne)
    x0, idx, w = make_inputs(rank, 64, 256, 4, ne, device, 21)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, ne)
    side = torch.cuda.Stream()
    x = torch.empty_like(x0)
    side.wait_stream(torch.cuda.current_stream())  # x0 was made there
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)  # the copy lands well after the dispatch is queued
        x.copy_(x0)
        ev = torch.cuda.Event()
        ev.record(side)
    recv_x, r_idx, _, _, handle, event = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
        topk_weights=w, previous_event=moelink.EventOverlap(ev), async_finish=True)
    event.current_stream_wait()
    ref_x = reference(rank, world, 64, 256, 4, ne, 21)[0]
    assert torch.equal(recv_x.cpu(), ref_x)
    combined, _, event = buf.combine(expert(recv_x, rank), handle, async_finish=True)
    event.current_stream_wait()
    assert combined.shape == (64, 256)


def graph_capture(rank, world, device="cuda"):
    """The NVLink kernels with num_worst_tokens need no host wait: a layer (layout, dispatch,
    experts, combine) captured once in a CUDA graph and replayed with new tokens and routing
    gives, every replay, the references' rows, padding and combined sums."""
    ne, hidden, tokens, topk = 4 * world, 256, 64, 4
    worst = tokens * world
    buf = moelink.Buffer(None, 128, hidden, ne)
    sx, sidx, sw = (t.clone() for t in make_inputs(rank, tokens, hidden, topk, ne, device, 30))

    def layer():
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(sidx, ne)
        recv_x, r_idx, r_w, counts, handle, _ = buf.dispatch(
            sx, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=sidx, topk_weights=sw, num_worst_tokens=worst)
        assert counts == []
        combined, combined_w, _ = buf.combine(expert(recv_x, rank), handle, topk_weights=r_w)
        return recv_x, r_idx, handle[3], combined, combined_w

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer()  # warm-up: creates the NVL buffer
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = layer()
    for step in range(3):
        x, idx, w = make_inputs(rank, tokens, hidden, topk, ne, device, 31 + step)
        sx.copy_(x)
        sidx.copy_(idx)
        sw.copy_(w)
        graph.replay()
        recv_x, r_idx, src, combined, combined_w = (t.cpu() for t in outs)
        ref_x, ref_idx, _, ref_src, _ = reference(rank, world, tokens, hidden, topk, ne, 31 + step)
        n = ref_x.shape[0]
        assert recv_x.shape[0] == worst
        assert torch.equal(recv_x[:n], ref_x) and not recv_x[n:].any()
        assert torch.equal(r_idx[:n], ref_idx) and torch.all(r_idx[n:] == -1)
        assert torch.equal(src[:n].long(), ref_src) and torch.all(src[n:] == -1)
        in_rank = ranks_of(idx, ne, world)
        acc = torch.zeros(tokens, hidden)
        for r in range(world):
            acc[in_rank[:, r]] += expert(x.cpu()[in_rank[:, r]], r).float()
        torch.testing.assert_close(combined.float(), acc.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(combined_w, torch.where(idx.cpu() >= 0, w.cpu(), torch.zeros_like(w.cpu())))
    dist.barrier()


def _mlp(x, w1, w2):
    return torch.relu(x @ w1) @ w2


def training_loop(rank, world, device="cuda", steps=3):
    """A small MoE layer trained for a few SGD steps: dispatch -> experts -> combine ->
    backward, against a single-process reference over every rank's tokens and every expert;
    loss, input and router-weight gradients and the local experts' gradients must agree."""
    nle, hidden, tokens, topk = 4, 128, 96, 2
    ne = nle * world
    buf = moelink.Buffer(None, 128, hidden, ne)
    g = torch.Generator().manual_seed(77)
    w1 = [torch.randn(hidden, hidden, generator=g) * 0.05 for _ in range(ne)]
    w2 = [torch.randn(hidden, hidden, generator=g) * 0.05 for _ in range(ne)]
    mine = range(rank * nle, (rank + 1) * nle)
    p1 = [w1[e].clone().to(device).requires_grad_() for e in mine]
    p2 = [w2[e].clone().to(device).requires_grad_() for e in mine]
    r1 = [t.clone().to(device).requires_grad_() for t in w1]
    r2 = [t.clone().to(device).requires_grad_() for t in w2]
    lr = 0.5
    losses = []
    for step in range(steps):
        data = [make_inputs(s, tokens, hidden, topk, ne, device, 50 + step) for s in range(world)]
        targets = [torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(900 + s + 10 * step)).to(device)
                   for s in range(world)]
        # moelink
        x = data[rank][0].clone().requires_grad_()
        w = data[rank][2].clone().requires_grad_()
        recv_x, r_idx, r_w, _, handle = normal.dispatch_with_grad(buf, x, data[rank][1], w)
        y = torch.zeros(recv_x.shape[0], hidden, device=device)
        for k in range(topk):
            for le in range(nle):
                sel = r_idx[:, k] == le
                if sel.any():
                    y = y.index_add(0, sel.nonzero()[:, 0],
                                    r_w[sel, k:k + 1] * _mlp(recv_x[sel].float(), p1[le], p2[le]))
        out = normal.combine_with_grad(buf, y.to(torch.bfloat16), handle)
        loss = ((out.float() - targets[rank]) ** 2).mean()
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        # the reference: every rank's tokens through every expert, grouped per rank as the layer is
        ref_total = 0.0
        ref_x = ref_w = None
        for s in range(world):
            xs = data[s][0].clone().requires_grad_(s == rank)
            ws = data[s][2].clone().requires_grad_(s == rank)
            idx = data[s][1]
            out_s = torch.zeros(tokens, hidden, device=device)
            for r in range(world):
                part = torch.zeros(tokens, hidden, device=device)
                for k in range(topk):
                    for e in range(r * nle, (r + 1) * nle):
                        sel = (idx[:, k] == e).nonzero()[:, 0]
                        if sel.numel():
                            part = part.index_add(0, sel, ws[sel, k:k + 1] * _mlp(xs[sel].float(), r1[e], r2[e]))
                out_s = out_s + part.to(torch.bfloat16).float()
            ref_total = ref_total + ((out_s.to(torch.bfloat16).float() - targets[s]) ** 2).mean()
            if s == rank:
                ref_x, ref_w = xs, ws
        ref_total.backward()
        torch.testing.assert_close(total.cpu(), ref_total.detach().cpu(), rtol=2e-2, atol=1e-3)
        torch.testing.assert_close(x.grad.float().cpu(), ref_x.grad.float().cpu(), rtol=5e-2, atol=2e-3)
        torch.testing.assert_close(w.grad.cpu(), ref_w.grad.cpu(), rtol=5e-2, atol=2e-3)
        for i, e in enumerate(mine):
            torch.testing.assert_close(p1[i].grad.cpu(), r1[e].grad.cpu(), rtol=5e-2, atol=2e-3)
            torch.testing.assert_close(p2[i].grad.cpu(), r2[e].grad.cpu(), rtol=5e-2, atol=2e-3)
        with torch.no_grad():
            for p in p1 + p2:
                p -= lr * p.grad
                p.grad = None
            for p in r1 + r2:
                p -= lr * p.grad
                p.grad = None
        losses.append(float(total))
    return losses


def all_gpu(rank, world, big_tokens=4096, hiddens=(2048, 7168)):
    torch.cuda.set_device(rank % torch.cuda.device_count())  # one GPU: MOELINK_TEST_SHARE_GPU
    path = moelink.Buffer(None, 128, 256, 4 * world)._normal_path(torch.device("cuda", rank))
    routing(rank, world, "cuda", hiddens, big_tokens)
    bad_input(rank, world, "cuda")
    autograd(rank, world, "cuda")
    async_events(rank, world, "cuda")
    if path == "nvlink":
        graph_capture(rank, world, "cuda")
    losses = training_loop(rank, world, "cuda")
    torch.cuda.synchronize()
    dist.barrier()
    return {"path": path, "losses": losses}
