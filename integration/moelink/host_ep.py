"""The EP buffer's host implementation, for CPU tensors: the same results and layout as the
GPU kernels, computed with torch and moved with all_to_all_single over the "ep" group (so
over moelink's transfer engine). For CPU-only machines, the demo and CI; not fast."""

from __future__ import annotations

import torch
import torch.distributed as dist

FP8_MAX = 448.0


def quantize_fp8(x: torch.Tensor, round_scale: bool):
    """e4m3 with one float scale per 128 values, computed as the dispatch kernel does."""
    t, h = x.shape
    xs = x.float().view(t, h // 128, 128)
    scale = xs.abs().amax(-1).clamp(min=1e-4) / FP8_MAX
    if round_scale:  # up to a power of two, exactly
        bits = scale.view(torch.int32)
        scale = torch.where((bits & 0x7FFFFF) != 0, (bits & -0x800000) + 0x800000, bits).view(torch.float32)
    q = (xs * (1.0 / scale).unsqueeze(-1)).to(torch.float8_e4m3fn).view(t, h)
    return q, scale


class HostState:
    """What combine needs from dispatch (the host counterpart of the GPU handle's state)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _exchange(group, send: torch.Tensor, send_counts, recv_counts) -> torch.Tensor:
    out = torch.empty((sum(recv_counts),) + tuple(send.shape[1:]), dtype=send.dtype)
    dist.all_to_all_single(out, send.contiguous(), recv_counts, send_counts, group=group)
    return out


def dispatch(group, rank, world, max_tokens, hidden, num_experts, x, topk_idx, use_fp8, round_scale):
    nle = num_experts // world
    t_count, k = topk_idx.shape
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    tok, slot = valid.nonzero(as_tuple=True)
    exp = topk_idx[tok, slot]
    order = torch.argsort(exp * max(1, t_count) + tok, stable=True)  # by destination expert, then token
    tok, slot, exp = tok[order], slot[order], exp[order]
    dst = exp // nle
    send_counts = torch.bincount(dst, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    sc, rc = send_counts.tolist(), recv_counts.tolist()
    meta = torch.stack([tok, slot, exp % nle], dim=1).to(torch.int32)
    r_meta = _exchange(group, meta, sc, rc)
    if use_fp8:
        q, scale = quantize_fp8(x, round_scale)
        payload = torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8).view(t_count, hidden // 128 * 4)], dim=1)
    else:
        payload = x.contiguous().view(torch.uint8)
    r_payload = _exchange(group, payload[tok], sc, rc)
    rows = world * max_tokens
    recv_x = torch.empty(nle, rows, hidden, dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16)
    recv_scales = torch.empty(nle, rows, hidden // 128, dtype=torch.float32) if use_fp8 else None
    src_info = torch.zeros(nle, rows, dtype=torch.int32)
    src_slot = torch.zeros(nle, rows, dtype=torch.int32)
    layout_range = torch.zeros(nle, world, dtype=torch.int64)
    recv_count = torch.zeros(nle, dtype=torch.int32)
    src_rank = torch.repeat_interleave(torch.arange(world), torch.tensor(rc))
    le_all = r_meta[:, 2].long()
    for le in range(nle):
        begin = 0
        for r in range(world):
            sel = ((le_all == le) & (src_rank == r)).nonzero().flatten()
            n = sel.numel()
            if n:
                p = r_payload[sel]
                if use_fp8:
                    recv_x[le, begin:begin + n] = p[:, :hidden].view(torch.float8_e4m3fn)
                    recv_scales[le, begin:begin + n] = p[:, hidden:].contiguous().view(torch.float32)
                else:
                    recv_x[le, begin:begin + n] = p.view(torch.bfloat16)
                src_info[le, begin:begin + n] = r_meta[sel, 0]
                src_slot[le, begin:begin + n] = r_meta[sel, 1]
            layout_range[le, r] = (begin << 32) | n
            begin += n
        recv_count[le] = begin
    state = HostState(recv_x=recv_x, recv_scales=recv_scales, recv_count=recv_count, src_info=src_info,
                      src_slot=src_slot, layout_range=layout_range, half=0, send_counts=sc, recv_counts=rc,
                      num_tokens=t_count, num_topk=k)
    return state


def combine(group, world, hidden, x, topk_idx, topk_weights, state, out):
    nle = x.shape[0]
    # Back to each token's rank, grouped by that rank: rows of (expert output, token, top-k slot).
    back_rows, back_meta, counts = [], [], [0] * world
    for r in range(world):
        for le in range(nle):
            lr = int(state.layout_range[le, r])
            begin, n = lr >> 32, lr & 0xFFFFFFFF
            if n:
                back_rows.append(x[le, begin:begin + n])
                back_meta.append(torch.stack([state.src_info[le, begin:begin + n],
                                              state.src_slot[le, begin:begin + n]], dim=1))
                counts[r] += n
    send = torch.cat(back_rows) if back_rows else torch.empty(0, hidden, dtype=torch.bfloat16)
    meta = torch.cat(back_meta) if back_meta else torch.empty(0, 2, dtype=torch.int32)
    recv_counts = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(recv_counts, torch.tensor(counts, dtype=torch.int64), group=group)
    rc = recv_counts.tolist()
    got = _exchange(group, send.contiguous().view(torch.uint8), counts, rc).view(torch.bfloat16)
    got_meta = _exchange(group, meta, counts, rc).long()
    result = out if out is not None else torch.empty(topk_idx.shape[0], hidden, dtype=torch.bfloat16)
    acc = torch.zeros(topk_idx.shape[0], hidden, dtype=torch.float32)
    if got.shape[0]:
        w = topk_weights[got_meta[:, 0], got_meta[:, 1]].float()
        acc.index_add_(0, got_meta[:, 0], got.float() * w.unsqueeze(1))
    result.copy_(acc.to(torch.bfloat16))
    return result
