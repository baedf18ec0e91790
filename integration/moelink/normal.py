"""The EP buffer's normal (high-throughput) mode: DeepEP's layout / dispatch / combine API for
training and prefill. ``moelink.Buffer`` calls into this module; users call the Buffer's
``get_dispatch_layout``, ``dispatch`` and ``combine`` (see buffer.py) and, for training, the
autograd pair ``dispatch_with_grad`` / ``combine_with_grad`` here.

Three routes with the same results and layout:

- the NVLink kernels (``_C.NormalBuffer``, src/ep/kernels/normal.cu): every rank of the group
  on one host, CUDA tensors: channelled kernels, sender and receiver blocks on separate SMs,
  ring buffers in the peers' memory;
- the two-hop route (two_hop.py): groups of several hosts with 2 to 8 ranks each; a host hop
  over the group, then the NVLink kernels (or, for CPU tensors, this file's group path)
  between the ranks of each host;
- the group path (this file): torch ops and one ``all_to_all_single`` over the "ep" group
  per call, for everything else (CPU tensors on one host, one GPU per host, a group with a
  masked-out rank).

Results (as DeepEP's intranode mode): received rows ordered by source rank, then source token
index; ``recv_topk_idx`` holds local expert ids or -1 (weight 0 there);
``num_recv_tokens_per_expert_list[e]`` is the number of received (token, local expert e)
pairs, rounded up to ``expert_alignment``. Combine sums, per token, the rows that come back
from every rank the dispatch sent it to (in float32, rounded to bf16 once), plus ``bias``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from . import _C
from .events import event

NUM_MAX_TOPK = 128  # as DeepEP's kNumMaxTopK: the NVL ring's per-token top-k room
NUM_MAX_SCALES = 128  # float scales per token in the ring (hidden up to 16384 in FP8)


class Config:
    """How the normal-mode kernels split the work: ``num_sms`` SMs (half of them send, half
    receive; one channel per pair), chunks of ``num_max_nvl_chunked_send_tokens`` tokens into
    rings of ``num_max_nvl_chunked_recv_tokens`` tokens per (source, channel). The RDMA chunk
    sizes are DeepEP's and size the two-hop route's buffers."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256):
        if num_sms < 2 or num_sms % 2:
            raise ValueError(f"moelink Config: num_sms must be an even number >= 2, got {num_sms}")
        if num_max_nvl_chunked_send_tokens < 1 or num_max_nvl_chunked_recv_tokens < 1:
            raise ValueError("moelink Config: chunk sizes must be >= 1")
        if num_max_nvl_chunked_send_tokens > num_max_nvl_chunked_recv_tokens:
            raise ValueError(f"moelink Config: num_max_nvl_chunked_send_tokens ({num_max_nvl_chunked_send_tokens}) "
                             f"must not exceed num_max_nvl_chunked_recv_tokens ({num_max_nvl_chunked_recv_tokens})")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    @property
    def num_channels(self) -> int:
        return self.num_sms // 2

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of the NVLink ring buffer per rank (the seed's formula): per channel and source
        rank, a few counters and ``num_max_nvl_chunked_recv_tokens`` token slots of hidden
        bytes, source index, top-k entries and scales; rounded up to 128."""
        nvl_ranks = min(num_ranks, 8)
        rdma_ranks = max(num_ranks // 8, 1)
        per = (2 * rdma_ranks + 3) * 4 + self.num_max_nvl_chunked_recv_tokens * _slot_bytes(hidden_bytes)
        return (self.num_channels * nvl_ranks * per + 127) // 128 * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's RDMA buffer size for these sizes (0 when every rank is on one host of 8). The
        two-hop route (two_hop.py) moves its host hop through the group's transfer engine and
        allocates no such buffer; the figure is for sizing comparisons."""
        if num_ranks <= 8:
            return 0
        rdma_ranks = num_ranks // 8
        per = (2 * 8 + 2) * 4 + self.num_max_rdma_chunked_recv_tokens * (_slot_bytes(hidden_bytes) + 16)
        return (self.num_channels * rdma_ranks * 2 * per + 127) // 128 * 128

    def __repr__(self) -> str:
        return (f"moelink.Config(num_sms={self.num_sms}, nvl_send={self.num_max_nvl_chunked_send_tokens}, "
                f"nvl_recv={self.num_max_nvl_chunked_recv_tokens}, rdma_send={self.num_max_rdma_chunked_send_tokens}, "
                f"rdma_recv={self.num_max_rdma_chunked_recv_tokens})")


def _slot_bytes(hidden_bytes: int) -> int:
    return hidden_bytes + 4 + NUM_MAX_TOPK * (8 + 4) + NUM_MAX_SCALES * 4


# Default (tokens per send chunk, ring slots) per group size. 2 ranks: from the sweeps in
# docs/PERF.md on 2 x H200 (dispatch: FP8's best, BF16 within 3 % of its best); larger groups:
# not measured yet, smaller chunks so that every destination's stream moves.
_DISPATCH = {2: (96, 256), 4: (24, 256), 8: (12, 256)}
_COMBINE = {2: (24, 256), 4: (12, 256), 8: (6, 256)}


def get_dispatch_config(num_ranks: int, num_sms: int = 24) -> Config:
    send, recv = _DISPATCH.get(num_ranks, (6, 256))
    return Config(num_sms, send, recv, 6, 256)


def get_combine_config(num_ranks: int, num_sms: int = 24) -> Config:
    send, recv = _COMBINE.get(num_ranks, (6, 256))
    return Config(num_sms, send, recv, 6, 256)


def nvl_buffer(owner, attr: str, needed: int, config: Config, hidden: int, num_ranks: int, group, make,
               dispatch_config, combine_config):
    """The NVLink kernels' buffer kept in ``owner.<attr>``: the one there when it holds
    ``needed`` bytes, else a new one from ``make(bytes)`` (collective: every rank makes the same
    calls), sized by the call's need or the default configs' hint, whichever is larger. The old
    one goes first, once every rank's kernels on it are done."""
    current = getattr(owner, attr)
    if current is not None and current.bytes() >= needed:
        return current
    hidden_bytes = hidden * 2
    want = max(needed, config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks),
               dispatch_config(num_ranks).get_nvl_buffer_size_hint(hidden_bytes, num_ranks),
               combine_config(num_ranks).get_nvl_buffer_size_hint(hidden_bytes, num_ranks))
    if current is not None:
        torch.cuda.synchronize()
        dist.barrier(group=group)
        setattr(owner, attr, None)
        del current
    setattr(owner, attr, make(want))
    return getattr(owner, attr)


@dataclass
class NormalState:
    """What a handle carries besides DeepEP's tensors: which buffer and call made it, the
    counts the group path moves, and which implementation it belongs to."""

    buffer_key: str
    num_tokens: int
    hidden: int
    num_recv_tokens: int
    send_counts: List[int]  # tokens to each rank
    recv_counts: List[int]  # tokens from each rank
    send_index: torch.Tensor  # int64 [sum(send_counts)]: the token of each sent row, grouped by rank
    path: str  # "nvlink", "group" or "two_hop"
    num_channels: int = 0
    num_out_rows: int = 0  # rows of the dispatch's outputs (num_worst_tokens pads them)
    route: Optional[object] = None  # the two-hop route's own state (two_hop.TwoHopState)
    counts_on_device: bool = False  # NVLink kernels with num_worst_tokens: the host never waited for the count


def layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """``(num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank)`` of a routing (any device)."""
    t, _ = topk_idx.shape
    nle = num_experts // num_ranks
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    safe = torch.where(valid, topk_idx, torch.zeros_like(topk_idx))
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=topk_idx.device)
    per_expert.index_add_(0, torch.where(valid, safe, torch.full_like(safe, num_experts)).flatten(),
                          torch.ones(topk_idx.numel(), dtype=torch.int32, device=topk_idx.device))
    in_rank = torch.zeros(t, num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
    dest = torch.where(valid, safe // nle, torch.full_like(safe, num_ranks))
    in_rank.scatter_(1, dest, True)
    in_rank = in_rank[:, :num_ranks].contiguous()
    return in_rank.sum(0, dtype=torch.int32), per_expert[:num_experts].contiguous(), in_rank


def check_layout(what: str, num_ranks: int, num_experts: int, x_rows: int, device, num_tokens_per_rank,
                 is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights) -> None:
    """The layout arguments of a non-cached dispatch, before anything moves."""
    for name, t in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                    ("num_tokens_per_expert", num_tokens_per_expert)):
        if t is None:
            raise ValueError(f"moelink {what}: {name} is required without a handle (get_dispatch_layout computes it)")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"moelink {what}: {name} must be a tensor")
        if t.device != device:
            raise ValueError(f"moelink {what}: {name} is on {t.device}, x on {device}")
    if num_tokens_per_rank.dtype != torch.int32 or tuple(num_tokens_per_rank.shape) != (num_ranks,):
        raise ValueError(f"moelink {what}: num_tokens_per_rank must be int32 [{num_ranks}], got "
                         f"{num_tokens_per_rank.dtype} {tuple(num_tokens_per_rank.shape)}")
    if is_token_in_rank.dtype != torch.bool or tuple(is_token_in_rank.shape) != (x_rows, num_ranks):
        raise ValueError(f"moelink {what}: is_token_in_rank must be bool [{x_rows}, {num_ranks}] (x's tokens), got "
                         f"{is_token_in_rank.dtype} {tuple(is_token_in_rank.shape)}: layout tensors of another call?")
    if num_tokens_per_expert.dtype != torch.int32 or tuple(num_tokens_per_expert.shape) != (num_experts,):
        raise ValueError(f"moelink {what}: num_tokens_per_expert must be int32 [{num_experts}], got "
                         f"{num_tokens_per_expert.dtype} {tuple(num_tokens_per_expert.shape)}")
    if topk_idx is not None:
        if topk_idx.dtype != torch.int64 or topk_idx.dim() != 2 or topk_idx.shape[0] != x_rows:
            raise ValueError(f"moelink {what}: topk_idx must be int64 [{x_rows}, topk], got {topk_idx.dtype} "
                             f"{tuple(topk_idx.shape)}")
        if not 1 <= topk_idx.shape[1] <= NUM_MAX_TOPK:
            raise ValueError(f"moelink {what}: top-k must be 1..{NUM_MAX_TOPK}, got {topk_idx.shape[1]}")
        if topk_idx.device != device:
            raise ValueError(f"moelink {what}: topk_idx is on {topk_idx.device}, x on {device}")
    if (topk_weights is None) != (topk_idx is None):
        raise ValueError(f"moelink {what}: topk_idx and topk_weights go together")
    if topk_weights is not None:
        if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_idx.shape:
            raise ValueError(f"moelink {what}: topk_weights must be float32 shaped like topk_idx "
                             f"{tuple(topk_idx.shape)}, got {topk_weights.dtype} {tuple(topk_weights.shape)}")
        if topk_weights.device != device:
            raise ValueError(f"moelink {what}: topk_weights is on {topk_weights.device}, x on {device}")


def split_x(what: str, x, hidden: int):
    """``(data, scales)`` of a bf16 tensor or an FP8 tuple, checked (scales None for bf16)."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"moelink {what}: an FP8 x is a tuple (e4m3 data, float scales)")
        data, scales = x
        if data.dtype != torch.float8_e4m3fn:
            raise TypeError(f"moelink {what}: FP8 data must be float8_e4m3fn, got {data.dtype}")
        if data.dim() != 2 or data.shape[1] != hidden:
            raise ValueError(f"moelink {what}: x must be [tokens, {hidden}], got {tuple(data.shape)}")
        if scales.dtype != torch.float32 or tuple(scales.shape) != (data.shape[0], hidden // 128):
            raise ValueError(f"moelink {what}: FP8 scales must be float32 [{data.shape[0]}, {hidden // 128}], got "
                             f"{scales.dtype} {tuple(scales.shape)}")
        if scales.device != data.device:
            raise ValueError(f"moelink {what}: FP8 data and scales are on different devices")
        return data.contiguous(), scales.contiguous()
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"moelink {what}: x must be a tensor or an FP8 tuple")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"moelink {what}: x must be bfloat16 (or an FP8 tuple), got {x.dtype}")
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"moelink {what}: x must be [tokens, {hidden}], got {tuple(x.shape)}")
    return x.contiguous(), None


def pad_counts(counts: Sequence[int], alignment: int) -> List[int]:
    return [(c + alignment - 1) // alignment * alignment for c in counts]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A row-wise uint8 view of a 2-D (or 1-D, one value per row) tensor."""
    t = t.contiguous()
    if t.dim() == 1:
        t = t.unsqueeze(1)
    width = t.element_size()
    for d in t.shape[1:]:
        width *= d
    return t.view(torch.uint8).reshape(t.shape[0], width)


def _columns(t: torch.Tensor, begin: int, end: int) -> torch.Tensor:
    """Columns [begin, end) of a uint8 matrix in fresh memory (so they can be viewed as wider types)."""
    out = torch.empty(t.shape[0], end - begin, dtype=t.dtype, device=t.device)
    out.copy_(t[:, begin:end])
    return out


def _a2a(group, send: torch.Tensor, send_counts: List[int], recv_counts: List[int]) -> torch.Tensor:
    out = torch.empty((sum(recv_counts),) + tuple(send.shape[1:]), dtype=send.dtype, device=send.device)
    dist.all_to_all_single(out, send.contiguous(), recv_counts, send_counts, group=group)
    return out


def exchange_layout(group, world: int, num_experts: int, is_token_in_rank: torch.Tensor,
                    num_tokens_per_expert: torch.Tensor, buffer_key: str, hidden: int, path: str):
    """One ``all_to_all_single`` of the counts: every rank tells each rank how many rows it
    will send it and how many (token, expert) pairs of that rank's experts they carry.
    Returns the call's state (counts both ways, the sent rows' tokens grouped by destination)
    and the pairs per local expert that arrive here."""
    nle = num_experts // world
    t = is_token_in_rank.shape[0]
    send_tokens = is_token_in_rank.sum(0, dtype=torch.int64)
    meta = torch.cat([send_tokens.view(world, 1), num_tokens_per_expert.to(torch.int64).view(world, nle)], 1)
    got = _a2a(group, meta.contiguous(), [1] * world, [1] * world).cpu()
    send_counts = send_tokens.cpu().tolist()
    recv_counts = got[:, 0].tolist()
    _, tok_of = is_token_in_rank.t().nonzero(as_tuple=True)  # grouped by rank, tokens ascending
    state = NormalState(buffer_key, t, hidden, sum(recv_counts), send_counts, recv_counts, tok_of, path)
    return state, got[:, 1:].sum(0).tolist()


class Rows:
    """The rows one exchange moved, as a uint8 matrix read field by field, left to right."""

    def __init__(self, got: torch.Tensor):
        self.got, self.col = got, 0

    def take(self, width: int, dtype, shape_tail) -> torch.Tensor:
        part = _columns(self.got, self.col, self.col + width).view(dtype).reshape((self.got.shape[0],) + shape_tail)
        self.col += width
        return part


def move_rows(group, state: NormalState, parts: List[torch.Tensor]) -> Rows:
    """Sends every token's fields (``parts``: row-wise uint8 matrices over the call's tokens)
    to the ranks ``state`` says, in one ``all_to_all_single``."""
    payload = torch.cat(parts, 1)[state.send_index]
    return Rows(_a2a(group, payload, state.send_counts, state.recv_counts))


def group_dispatch(group, rank: int, world: int, num_experts: int, data: torch.Tensor, scales, topk_idx, topk_weights,
                   is_token_in_rank: torch.Tensor, num_tokens_per_expert: Optional[torch.Tensor],
                   state: Optional[NormalState], expert_alignment: int, num_worst_tokens: int, buffer_key: str):
    """The group path's dispatch; ``state`` set repeats a cached layout (no counts exchanged).
    Returns (recv_data, recv_scales, recv_topk_idx, recv_topk_weights, counts_list, recv_src_idx, state)."""
    device = data.device
    t, hidden = data.shape
    nle = num_experts // world
    if state is None:
        state, per_expert = exchange_layout(group, world, num_experts, is_token_in_rank, num_tokens_per_expert,
                                            buffer_key, hidden, "group")
    else:
        per_expert = None
    parts = [_bytes(data)]
    if scales is not None:
        parts.append(_bytes(scales))
    parts.append(_bytes(torch.arange(t, dtype=torch.int32, device=device)))
    if topk_idx is not None:
        parts += [_bytes(topk_idx), _bytes(topk_weights)]
    got = move_rows(group, state, parts)
    n = got.got.shape[0]
    if num_worst_tokens and n > num_worst_tokens:  # every rank has finished the exchange: none is left waiting
        raise ValueError(f"moelink dispatch: {n} tokens arrived, more than num_worst_tokens={num_worst_tokens}")
    rows = max(n, num_worst_tokens)
    take = got.take
    recv_data = take(hidden * data.element_size(), data.dtype, (hidden,))
    recv_scales = take(scales.shape[1] * 4, torch.float32, (scales.shape[1],)) if scales is not None else None
    recv_src_idx = take(4, torch.int32, ()).contiguous()
    recv_topk_idx = recv_topk_weights = None
    if topk_idx is not None:
        k = topk_idx.shape[1]
        g_idx = take(8 * k, torch.int64, (k,))
        g_w = take(4 * k, torch.float32, (k,))
        local = (g_idx >= rank * nle) & (g_idx < (rank + 1) * nle)
        recv_topk_idx = torch.where(local, g_idx - rank * nle, torch.full_like(g_idx, -1))
        recv_topk_weights = torch.where(local, g_w, torch.zeros_like(g_w))
    if rows > n:  # num_worst_tokens: fixed-size outputs, padding rows zero (top-k -1)
        recv_data = _pad(recv_data, rows)
        recv_scales = _pad(recv_scales, rows) if recv_scales is not None else None
        recv_src_idx = _pad(recv_src_idx, rows, -1)
        if recv_topk_idx is not None:
            recv_topk_idx, recv_topk_weights = _pad(recv_topk_idx, rows, -1), _pad(recv_topk_weights, rows)
    counts = [] if (num_worst_tokens or per_expert is None) else pad_counts(per_expert, expert_alignment)
    return recv_data, recv_scales, recv_topk_idx, recv_topk_weights, counts, recv_src_idx, state


def _pad(t: torch.Tensor, rows: int, value=0) -> torch.Tensor:
    out = torch.full((rows,) + tuple(t.shape[1:]), value, dtype=t.dtype, device=t.device) if value else \
        torch.zeros((rows,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    out[:t.shape[0]] = t
    return out


def group_combine(group, x: torch.Tensor, state: NormalState, topk_weights, bias):
    """The group path's combine: every received row goes back to its rank, which sums them per token."""
    device = x.device
    n = state.num_recv_tokens
    parts = [_bytes(x[:n])]
    if topk_weights is not None:
        parts.append(_bytes(topk_weights[:n].float()))
    payload = torch.cat(parts, 1)
    got = _a2a(group, payload, state.recv_counts, state.send_counts)
    hidden = x.shape[1]
    rows = _columns(got, 0, hidden * 2).view(torch.bfloat16)
    acc = torch.zeros(state.num_tokens, hidden, dtype=torch.float32, device=device)
    acc.index_add_(0, state.send_index, rows.float())
    for b in bias:
        acc += b.float()
    combined_w = None
    if topk_weights is not None:
        k = topk_weights.shape[1]
        w = _columns(got, hidden * 2, got.shape[1]).view(torch.float32).reshape(-1, k)
        combined_w = torch.zeros(state.num_tokens, k, dtype=torch.float32, device=device)
        combined_w.index_add_(0, state.send_index, w)
    return acc.to(torch.bfloat16), combined_w


# --- autograd ---------------------------------------------------------------------------------

class _Dispatch(torch.autograd.Function):
    """recv_x = dispatch(x); its adjoint is a combine with the same handle (rows summed back
    to their tokens). ``topk_weights``' gradient is the combined gradient of the received
    weights at local experts."""

    @staticmethod
    def forward(ctx, x, topk_weights, buffer, topk_idx, layout_args, kwargs, holder):
        out = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, **layout_args, **kwargs)
        recv_x, recv_topk_idx, recv_topk_weights, counts, handle, _ = out
        ctx.buffer, ctx.handle, ctx.recv_topk_idx = buffer, handle, recv_topk_idx
        ctx.mark_non_differentiable(recv_topk_idx)
        holder["counts"], holder["handle"] = counts, handle  # not tensors: handed back beside the outputs
        return recv_x, recv_topk_idx, recv_topk_weights

    @staticmethod
    def backward(ctx, grad_x, _grad_idx, grad_w):
        grad_w_in = None
        w = None
        if grad_w is not None and ctx.needs_input_grad[1]:
            w = torch.where(ctx.recv_topk_idx >= 0, grad_w, torch.zeros_like(grad_w))
        if grad_x is None:
            grad_x = torch.zeros(ctx.handle[-1].num_recv_tokens, ctx.handle[-1].hidden, dtype=torch.bfloat16,
                                 device=ctx.recv_topk_idx.device)
        gx, gw, _ = ctx.buffer.combine(grad_x.to(torch.bfloat16).contiguous(), ctx.handle, topk_weights=w)
        if w is not None:
            grad_w_in = gw
        return gx, grad_w_in, None, None, None, None, None


class _Combine(torch.autograd.Function):
    """combined = combine(y); its adjoint is a dispatch of the gradient with the same handle."""

    @staticmethod
    def forward(ctx, y, buffer, handle):
        ctx.buffer, ctx.handle = buffer, handle
        combined, _, _ = buffer.combine(y, handle)
        return combined

    @staticmethod
    def backward(ctx, grad):
        g = ctx.buffer.dispatch(grad.to(torch.bfloat16).contiguous(), handle=ctx.handle)[0]
        return g, None, None


def dispatch_with_grad(buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                       num_experts: Optional[int] = None, **kwargs):
    """Differentiable normal-mode dispatch of a bf16 ``x``: computes the layout, dispatches, and
    returns ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle)``;
    gradients flow to ``x`` and ``topk_weights``."""
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts or buffer.num_experts)
    layout_args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    holder = {}
    recv_x, recv_idx, recv_w = _Dispatch.apply(x, topk_weights, buffer, topk_idx, layout_args, kwargs, holder)
    return recv_x, recv_idx, recv_w, holder["counts"], holder["handle"]


def combine_with_grad(buffer, y: torch.Tensor, handle) -> torch.Tensor:
    """Differentiable normal-mode combine of bf16 expert outputs ``y`` with a dispatch's handle."""
    return _Combine.apply(y, buffer, handle)



class NormalMode:
    """The normal-mode methods of moelink.Buffer (a mixin: the Buffer holds the state; the route
    a call takes is routing.py's): ``get_dispatch_layout``, and the bodies of ``dispatch`` and
    ``combine``."""

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """``(num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
        is_token_in_rank, event)`` of a routing: int32 [ranks], int32 [hosts] when the group
        takes the two-hop route across hosts (two_hop.py; else None), int32 [num_experts], bool
        [tokens, ranks]. Entries of -1 (or out of range) route nowhere."""
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dtype != torch.int64 or topk_idx.dim() != 2:
            raise ValueError("moelink get_dispatch_layout: topk_idx must be an int64 [tokens, topk] tensor")
        if num_experts <= 0 or num_experts % self.num_ranks:
            raise ValueError(f"moelink get_dispatch_layout: num_experts ({num_experts}) must be a positive multiple "
                             f"of the group size ({self.num_ranks})")
        self._wait(previous_event)
        if topk_idx.is_cuda and hasattr(_C, "NormalBuffer") and self.num_ranks <= 64 and num_experts <= 4096:
            with torch.cuda.device(topk_idx.device):
                per_rank, per_expert, in_rank = _C.NormalBuffer.layout(topk_idx, num_experts, self.num_ranks)
        else:
            per_rank, per_expert, in_rank = layout(topk_idx, num_experts, self.num_ranks)
        per_rdma = None
        hosts = self._hosts_seen_here(topk_idx.device)
        if hosts:  # the two-hop route's host hop: tokens per host
            per_rdma = in_rank.view(in_rank.shape[0], self.num_ranks // hosts, hosts).any(2).sum(0, dtype=torch.int32)
        return per_rank, per_rdma, per_expert, in_rank, event(async_finish and topk_idx.is_cuda)

    def _normal_dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                         is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                         expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                         previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        what = "dispatch"
        data, scales = split_x(what, x, self.hidden)
        device = data.device
        t = data.shape[0]
        if expert_alignment < 1:
            raise ValueError(f"moelink dispatch: expert_alignment must be >= 1, got {expert_alignment}")
        if num_worst_tokens < 0:
            raise ValueError(f"moelink dispatch: num_worst_tokens must be >= 0, got {num_worst_tokens}")
        if config is not None and not isinstance(config, Config):
            raise TypeError("moelink dispatch: config must be a moelink.Config")
        user_config = config
        config = config or self.get_dispatch_config(self.num_ranks)
        state = None
        if handle is not None:
            state = self._check_handle(what, handle)
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("moelink dispatch: a cached dispatch (with handle) takes no topk_idx/topk_weights")
            if state.num_tokens != t:
                raise ValueError(f"moelink dispatch: x has {t} tokens, the handle's dispatch had {state.num_tokens}")
            is_token_in_rank = handle[4]
            if is_token_in_rank.device != device:
                raise ValueError(f"moelink dispatch: x is on {device}, the handle's layout on {is_token_in_rank.device}")
            path = state.path
        else:
            check_layout(what, self.num_ranks, self.num_experts, t, device, num_tokens_per_rank,
                                is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights)
            path = self._normal_path(device)
        self._wait(previous_event)
        if path == "two_hop":
            route = self._route(device)
            if handle is not None:
                recv_x, recv_s = route.cached_dispatch(data, scales, state, user_config)
                return (recv_x, recv_s) if scales is not None else recv_x, None, None, None, None, \
                    event(async_finish and data.is_cuda)
            recv_x, recv_s, r_idx, r_w, counts, handle = route.dispatch(
                data, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert, user_config,
                expert_alignment, num_worst_tokens, self._kernels_usable(device))
        elif path == "group":
            if handle is None:
                recv_x, recv_s, r_idx, r_w, counts, src_idx, state = group_dispatch(
                    self.group, self.rank, self.num_ranks, self.num_experts, data, scales, topk_idx, topk_weights,
                    is_token_in_rank, num_tokens_per_expert, None, expert_alignment, num_worst_tokens, self._key)
                state.num_out_rows = recv_x.shape[0]
                prefix = torch.tensor(state.recv_counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
                handle = (prefix, None, None, src_idx, is_token_in_rank, None, state)
            else:
                recv_x, recv_s, *_ = group_dispatch(
                    self.group, self.rank, self.num_ranks, self.num_experts, data, scales, None, None,
                    is_token_in_rank, None, state, 1, state.num_out_rows, self._key)
                return (recv_x, recv_s) if scales is not None else recv_x, None, None, None, None, \
                    event(async_finish and data.is_cuda)
        else:
            k = topk_idx.shape[1] if topk_idx is not None else 0
            s_cols = scales.shape[1] if scales is not None else 0
            if handle is not None:
                shape = _C.NormalShape(state.num_channels, config.num_max_nvl_chunked_recv_tokens,
                                       config.num_max_nvl_chunked_send_tokens)
                needed = _C.NormalBuffer.bytes_needed(self.num_ranks, self.num_local_experts, shape,
                                                      self.hidden * data.element_size(), s_cols, 0)
                recv_x, recv_s = self._normal_buffer(needed, config).cached_dispatch(
                    data, scales, is_token_in_rank, handle[0], handle[1], handle[2],
                    -1 if state.counts_on_device else state.num_recv_tokens, state.num_out_rows, shape, -1)
                return (recv_x, recv_s) if scales is not None else recv_x, None, None, None, None, \
                    event(async_finish)
            shape = _C.NormalShape(config.num_channels, config.num_max_nvl_chunked_recv_tokens,
                                   config.num_max_nvl_chunked_send_tokens)
            needed = _C.NormalBuffer.bytes_needed(self.num_ranks, self.num_local_experts, shape,
                                                  self.hidden * data.element_size(), s_cols, k)
            res = self._normal_buffer(needed, config).dispatch(data, scales, topk_idx, topk_weights, is_token_in_rank,
                                                               num_tokens_per_expert, shape, num_worst_tokens, -1)
            recv_x, recv_s, r_idx, r_w = res.recv_x, res.recv_scales, res.recv_topk_idx, res.recv_topk_weights
            if topk_idx is None:
                r_idx = r_w = None
            if scales is None:
                recv_s = None
            counts = [] if num_worst_tokens else pad_counts(res.num_recv_per_expert, expert_alignment)
            state = NormalState(self._key, t, self.hidden, res.num_recv, [], [], None, "nvlink",
                                       config.num_channels, counts_on_device=num_worst_tokens > 0)
            state.num_out_rows = recv_x.shape[0]
            handle = (res.rank_prefix, res.channel_prefix, res.recv_channel_prefix, res.recv_src_idx,
                      is_token_in_rank, res.send_head, state)
        return (recv_x, recv_s) if scales is not None else recv_x, r_idx, r_w, counts, handle, \
            event(async_finish and data.is_cuda)

    def _normal_combine(self, x, handle, topk_weights=None, bias=None, config: Optional[Config] = None,
                        previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        what = "combine"
        state = self._check_handle(what, handle)
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"moelink combine: x must be a bfloat16 [received tokens, {self.hidden}] tensor, got "
                             f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
        if x.shape[0] not in (state.num_recv_tokens, state.num_out_rows):
            raise ValueError(f"moelink combine: x has {x.shape[0]} rows, the handle's dispatch received "
                             f"{state.num_recv_tokens}")
        device = x.device
        if handle[4].device != device:
            raise ValueError(f"moelink combine: x is on {device}, the handle's layout on {handle[4].device}")
        if topk_weights is not None:
            if topk_weights.dtype != torch.float32 or topk_weights.dim() != 2 or topk_weights.shape[0] != x.shape[0] \
                    or topk_weights.device != device:
                raise ValueError(f"moelink combine: topk_weights must be float32 [{x.shape[0]}, topk] on {device}")
        biases = []
        for b in (bias if isinstance(bias, (tuple, list)) else (bias,)):
            if b is None:
                continue
            if not isinstance(b, torch.Tensor) or b.dtype != torch.bfloat16 or \
                    tuple(b.shape) != (state.num_tokens, self.hidden) or b.device != device:
                raise ValueError(f"moelink combine: bias must be bfloat16 [{state.num_tokens}, {self.hidden}] on "
                                 f"{device} (or a tuple of up to two)")
            biases.append(b.contiguous())
        if len(biases) > 2:
            raise ValueError("moelink combine: at most two bias tensors")
        if config is not None and not isinstance(config, Config):
            raise TypeError("moelink combine: config must be a moelink.Config")
        user_config = config
        config = config or self.get_combine_config(self.num_ranks)
        self._wait(previous_event)
        x = x.contiguous()
        if topk_weights is not None:
            topk_weights = topk_weights.contiguous()
        if state.path == "group":
            combined, combined_w = group_combine(self.group, x, state, topk_weights, biases)
            return combined, combined_w, event(async_finish and x.is_cuda)
        if state.path == "two_hop":
            combined, combined_w = self._route(device).combine(x, state, topk_weights, biases, user_config)
            return combined, combined_w, event(async_finish and x.is_cuda)
        shape = _C.NormalShape(state.num_channels, config.num_max_nvl_chunked_recv_tokens,
                               config.num_max_nvl_chunked_send_tokens)
        k = topk_weights.shape[1] if topk_weights is not None else 0
        needed = _C.NormalBuffer.bytes_needed(self.num_ranks, self.num_local_experts, shape, self.hidden * 2, 0, k)
        combined, combined_w = self._normal_buffer(needed, config).combine(
            x, topk_weights, biases[0] if biases else None, biases[1] if len(biases) > 1 else None, handle[0],
            handle[2], handle[5], state.num_recv_tokens, shape, -1)
        return combined, combined_w, event(async_finish)

    def _normal_buffer(self, needed: int, config: Config):
        """The NVL buffer over the whole group, created at first use and grown when a call needs
        more (nvl_buffer)."""
        def make(size):
            return _C.NormalBuffer(self._backend.store, self.rank, self.num_ranks,
                                   f"{self._key}/normal/{next(self._normal_serial)}", size, self.num_experts)

        return nvl_buffer(self, "_normal", needed, config, self.hidden, self.num_ranks, self.group, make,
                                 self.get_dispatch_config, self.get_combine_config)

    def _check_handle(self, what: str, handle) -> NormalState:
        if not isinstance(handle, tuple) or len(handle) != 7 or not isinstance(handle[-1], NormalState):
            raise ValueError(f"moelink {what}: handle must be the handle a normal-mode dispatch of this buffer returned")
        state = handle[-1]
        if state.buffer_key != self._key:
            raise ValueError(f"moelink {what}: the handle belongs to another Buffer")
        return state
