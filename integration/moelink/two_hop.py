"""The normal mode's two-hop route, for groups that span hosts of several GPUs each (DeepEP's
internode mode). A token bound for ranks on another host crosses the network once per host,
not once per rank:

1. **Host hop** (DeepEP's RDMA hop): rank ``(h, l)`` (host h, local index l; rank = h*L + l)
   sends each token once to the same-index rank ``(h', l)`` of every host h' that holds one of
   its experts, with the token's routing row, source token index, top-k ids and weights. It is
   one ``all_to_all_single`` over the "ep" group (rows only between same-index ranks), so it
   rides the transfer engine: RDMA where the group has it, tcp otherwise.
2. **Local hop** (DeepEP's NVLink forwarding): each rank forwards what it received to the
   ranks of its own host that need it, with the normal mode's NVLink kernels over the host's L
   ranks (CUDA tensors), or with the group path between those ranks (CPU tensors).

The receiver puts its rows in DeepEP's order (source rank, then source token), using the
source rank and token that travel with each row through both hops. Combine runs the hops
backwards: the local hop's combine sums each forwarded row over the host's ranks (one bf16
rounding there, as DeepEP's internode combine has), the host hop returns the sums to the
source rank, which adds them per token in float32 (plus the biases).

The handle keeps both hops' layouts: ``(recv_gbl_rank_prefix_sum, recv_rdma_rank_prefix_sum,
recv_src_meta, recv_src_idx, is_token_in_rank, send_nvl_head, state)``: inclusive prefix sums
of the rows received per source rank and of the rows this rank forwards per source host,
``[rows, 2]`` int32 (source rank, source token) per received row, the source token index, the
routing, the NVLink hop's ``send_head`` (None when the local hop took the group path), and the
state both hops replay (cached dispatch, combine).

Used when every rank is active, the group's ranks form hosts of L consecutive ranks (2 <= L
<= 8, at least two hosts: real hosts, or ``MOELINK_EP_RANKS_PER_HOST=L`` virtual ones), and
``MOELINK_EP_TWO_HOP`` is not 0 (decided in C++, src/ep/routes.cpp); the ranks agree on it once
per membership epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from . import _C, normal
from .normal import Config, NormalState


@dataclass
class TwoHopState:
    """What a two-hop dispatch leaves for its cached repeats and its combine."""

    hop1: NormalState  # the host hop: counts and sent tokens over the whole group
    in_local: torch.Tensor  # bool [forwarded rows, L]: the local ranks each forwarded row goes to
    hop2_kernels: Optional[tuple]  # NVLink hop: (rank_prefix, channel_prefix, recv_channel_prefix, send_head)
    hop2_state: Optional[NormalState]  # local hop over the group path (CPU tensors)
    perm: Optional[torch.Tensor]  # received row i is the local hop's row perm[i]
    num_channels: int


class TwoHop:
    """The route for one Buffer (created at its first two-hop call, dropped by
    ``Buffer.update_members``)."""

    def __init__(self, buffer, ranks_per_host: int):
        self.buf = buffer
        self.group = buffer.group
        self.world, self.rank = buffer.num_ranks, buffer.rank
        self.L = ranks_per_host
        self.H = self.world // self.L
        self.host, self.local = divmod(self.rank, self.L)
        self.num_experts = buffer.num_experts
        self.nle = self.num_experts // self.world
        self.nvl = None  # the local hop's NVLink buffer over this host's L ranks

    # ---- the two hops -------------------------------------------------------------------

    def _host_in_rank(self, is_token_in_rank: torch.Tensor) -> torch.Tensor:
        """[tokens, world]: True at (t, (h', my local index)) when token t goes to host h'."""
        t = is_token_in_rank.shape[0]
        in_host = is_token_in_rank.view(t, self.H, self.L).any(2)
        out = torch.zeros(t, self.H, self.L, dtype=torch.bool, device=is_token_in_rank.device)
        out[:, :, self.local] = in_host
        return out.view(t, self.world)

    def _nvl_shape(self, config: Config, num_channels: Optional[int] = None):
        return _C.NormalShape(num_channels or config.num_channels, config.num_max_nvl_chunked_recv_tokens,
                              config.num_max_nvl_chunked_send_tokens)

    def _nvl_buffer(self, needed: int, config: Config):
        buf = self.buf

        def make(size):
            return _C.NormalBuffer(buf._backend.store, self.local, self.L,
                                   f"{buf._key}/two_hop/{self.host}/{next(buf._normal_serial)}", size,
                                   self.num_experts // self.H)

        return normal.nvl_buffer(self, "nvl", needed, config, buf.hidden, self.L, self.group, make,
                                 buf.get_dispatch_config, buf.get_combine_config)

    def dispatch(self, data: torch.Tensor, scales, topk_idx, topk_weights, is_token_in_rank: torch.Tensor,
                 num_tokens_per_expert: torch.Tensor, config: Optional[Config], expert_alignment: int,
                 num_worst_tokens: int, use_nvlink: bool):
        """Returns ``(recv_data, recv_scales, recv_topk_idx, recv_topk_weights, counts_list, handle)``."""
        buf, W, L = self.buf, self.world, self.L
        device = data.device
        t, hidden = data.shape
        hop1, per_expert = normal.exchange_layout(self.group, W, self.num_experts, self._host_in_rank(is_token_in_rank),
                                                  num_tokens_per_expert, buf._key, hidden, "host hop")
        parts = [normal._bytes(data)]
        if scales is not None:
            parts.append(normal._bytes(scales))
        parts += [normal._bytes(torch.arange(t, dtype=torch.int32, device=device)), normal._bytes(is_token_in_rank)]
        if topk_idx is not None:
            parts += [normal._bytes(topk_idx), normal._bytes(topk_weights)]
        rows = normal.move_rows(self.group, hop1, parts)
        n1 = rows.got.shape[0]
        data1 = rows.take(hidden * data.element_size(), data.dtype, (hidden,))
        s_cols = scales.shape[1] if scales is not None else 0
        scales1 = rows.take(s_cols * 4, torch.float32, (s_cols,)) if scales is not None else None
        tok1 = rows.take(4, torch.int32, ())
        in_local = rows.take(W, torch.bool, (W,))[:, self.host * L:(self.host + 1) * L].contiguous()
        topk1 = w1 = None
        if topk_idx is not None:
            k = topk_idx.shape[1]
            topk1 = rows.take(8 * k, torch.int64, (k,))
            w1 = rows.take(4 * k, torch.float32, (k,))
        # Each forwarded row carries its source rank and token through the local hop, as two
        # more (bit-copied) scale columns.
        # (on the GPU: the CPU op takes milliseconds where its thread pool meets the engine's threads)
        src1 = torch.repeat_interleave(torch.arange(W, dtype=torch.int32, device=device),
                                       torch.tensor(hop1.recv_counts, dtype=torch.int64, device=device), output_size=n1)
        meta1 = torch.stack([src1, tok1], 1).view(torch.float32)
        ext = torch.cat([scales1, meta1], 1) if scales1 is not None else meta1.contiguous()
        if use_nvlink:
            config = config or buf.get_dispatch_config(L)
            base, span = self.host * L * self.nle, L * self.nle
            rel = w_in = None
            if topk1 is not None:  # expert ids relative to this host; other hosts' experts -1
                rel = torch.where((topk1 >= base) & (topk1 < base + span), topk1 - base, torch.full_like(topk1, -1))
                w_in = w1
            shape = self._nvl_shape(config)
            needed = _C.NormalBuffer.bytes_needed(L, self.nle, shape, hidden * data.element_size(), s_cols + 2,
                                                  topk1.shape[1] if topk1 is not None else 0)
            res = self._nvl_buffer(needed, config).dispatch(
                data1, ext, rel, w_in, in_local, torch.zeros(span, dtype=torch.int32, device=device), shape, 0, -1)
            recv, recv_ext, r_idx, r_w, n = res.recv_x, res.recv_scales, res.recv_topk_idx, res.recv_topk_weights, \
                res.num_recv
            if topk1 is None:
                r_idx = r_w = None
            hop2_kernels, hop2_state, send_nvl_head, channels = \
                (res.rank_prefix, res.channel_prefix, res.recv_channel_prefix, res.send_head), None, res.send_head, \
                config.num_channels
        else:
            in2 = torch.zeros(n1, W, dtype=torch.bool, device=device)
            in2[:, self.host * L:(self.host + 1) * L] = in_local
            recv, recv_ext, r_idx, r_w, _, _, hop2_state = normal.group_dispatch(
                self.group, self.rank, W, self.num_experts, data1, ext, topk1, w1, in2,
                torch.zeros(self.num_experts, dtype=torch.int32, device=device), None, 1, 0, buf._key)
            n = recv.shape[0]
            hop2_kernels, send_nvl_head, channels = None, None, 0
        meta = recv_ext[:, s_cols:s_cols + 2].contiguous().view(torch.int32)  # [n, 2]: source rank, token
        recv_s = recv_ext[:, :s_cols].contiguous() if scales is not None else None
        # The local hop delivers rows by forwarding rank, then source host: reorder them by
        # source rank (source host, then forwarding rank), keeping token order.
        perm = torch.argsort(meta[:, 0], stable=True)
        recv, meta = recv[perm], meta[perm]
        recv_s = recv_s[perm] if recv_s is not None else None
        if r_idx is not None:
            r_idx, r_w = r_idx[perm], r_w[perm]
        if num_worst_tokens and n > num_worst_tokens:  # every exchange is over: no rank is left waiting
            raise ValueError(f"moelink dispatch: {n} tokens arrived, more than num_worst_tokens={num_worst_tokens}")
        rows_out = max(n, num_worst_tokens)
        src_idx = meta[:, 1].contiguous()
        if rows_out > n:
            recv = normal._pad(recv, rows_out)
            recv_s = normal._pad(recv_s, rows_out) if recv_s is not None else None
            src_idx = normal._pad(src_idx, rows_out, -1)
            if r_idx is not None:
                r_idx, r_w = normal._pad(r_idx, rows_out, -1), normal._pad(r_w, rows_out)
        counts = [] if num_worst_tokens else normal.pad_counts(per_expert, expert_alignment)
        gbl_prefix = torch.bincount(meta[:, 0].long(), minlength=W).cumsum(0).to(torch.int32)
        rdma_prefix = torch.tensor(hop1.recv_counts, dtype=torch.int64).view(self.H, L)[:, self.local] \
            .cumsum(0).to(torch.int32).to(device)
        route = TwoHopState(hop1, in_local, hop2_kernels, hop2_state, perm, channels)
        state = NormalState(buf._key, t, hidden, n, hop1.send_counts, hop1.recv_counts, hop1.send_index, "two_hop",
                            channels, rows_out, route)
        handle = (gbl_prefix, rdma_prefix, meta, src_idx, is_token_in_rank, send_nvl_head, state)
        return recv, recv_s, r_idx, r_w, counts, handle

    def cached_dispatch(self, data: torch.Tensor, scales, state: NormalState, config: Optional[Config]):
        """The rows again along a dispatch's routes (``handle=``): ``(recv_data, recv_scales)``."""
        r = state.route
        hidden = data.shape[1]
        parts = [normal._bytes(data)] + ([normal._bytes(scales)] if scales is not None else [])
        rows = normal.move_rows(self.group, r.hop1, parts)
        data1 = rows.take(hidden * data.element_size(), data.dtype, (hidden,))
        s_cols = scales.shape[1] if scales is not None else 0
        scales1 = rows.take(s_cols * 4, torch.float32, (s_cols,)) if scales is not None else None
        n = state.num_recv_tokens
        if r.hop2_kernels is not None:
            config = config or self.buf.get_dispatch_config(self.L)
            shape = self._nvl_shape(config, r.num_channels)
            needed = _C.NormalBuffer.bytes_needed(self.L, self.nle, shape, hidden * data.element_size(), s_cols, 0)
            rank_prefix, channel_prefix, recv_channel_prefix, _ = r.hop2_kernels
            recv, recv_s = self._nvl_buffer(needed, config).cached_dispatch(
                data1, scales1, r.in_local, rank_prefix, channel_prefix, recv_channel_prefix, n, n, shape, -1)
        else:
            recv, recv_s, *_ = normal.group_dispatch(self.group, self.rank, self.world, self.num_experts, data1, scales1,
                                                     None, None, None, None, r.hop2_state, 1, 0, self.buf._key)

        def ordered(t):  # DeepEP's row order, padded to the dispatch's output rows
            return normal._pad(t[r.perm], state.num_out_rows) if state.num_out_rows > n else t[r.perm]

        return ordered(recv), ordered(recv_s) if recv_s is not None else None

    def combine(self, x: torch.Tensor, state: NormalState, topk_weights, biases: List[torch.Tensor],
                config: Optional[Config]):
        """Both hops backwards: ``(combined_x, combined_topk_weights)``."""
        r = state.route
        n = state.num_recv_tokens
        y = torch.empty(n, x.shape[1], dtype=x.dtype, device=x.device).index_copy_(0, r.perm, x[:n])
        w = None
        if topk_weights is not None:
            w = torch.empty(n, topk_weights.shape[1], dtype=topk_weights.dtype, device=x.device) \
                .index_copy_(0, r.perm, topk_weights[:n])
        if r.hop2_kernels is not None:
            config = config or self.buf.get_combine_config(self.L)
            shape = self._nvl_shape(config, r.num_channels)
            k = w.shape[1] if w is not None else 0
            needed = _C.NormalBuffer.bytes_needed(self.L, self.nle, shape, x.shape[1] * 2, 0, k)
            rank_prefix, _, recv_channel_prefix, send_head = r.hop2_kernels
            partial, partial_w = self._nvl_buffer(needed, config).combine(
                y, w, None, None, rank_prefix, recv_channel_prefix, send_head, n, shape, -1)
        else:
            partial, partial_w = normal.group_combine(self.group, y, r.hop2_state, w, [])
        return normal.group_combine(self.group, partial, r.hop1, partial_w, biases)
