"""The EP buffer's low-latency mode (decode): DeepEP's ``low_latency_dispatch`` /
``low_latency_combine``, the methods of ``moelink.Buffer`` that this module provides::

    buf = moelink.Buffer(group, num_max_dispatch_tokens_per_rank=128, hidden=7168, num_experts=256)
    recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(x, topk_idx, 128, 256)
    y = experts(recv_x, recv_count)                      # [local experts, ranks * 128, hidden] bf16
    combined, event, hook = buf.low_latency_combine(y, topk_idx, topk_weights, handle)

GPU warps write straight into the peers' buffers: over NVLink through CUDA IPC mappings
within a host. A peer on another host (or, with ``MOELINK_EP_RANKS_PER_HOST=n``, on another
"virtual host": ranks [0, n), [n, 2n), ...) is reached by IBGDA when both ends have an mlx5
NIC it can use (GPU threads post RDMA WRITEs on a queue pair per peer and ring its doorbell;
``MOELINK_EP_IBGDA=off`` turns it off, ``=emulate`` uses an emulated NIC for testing on one
host), else by the CPU-proxy path: the GPU writes into mapped host memory and a proxy thread
carries the bytes over moelink's transfer engine (shm or tcp). Paths per peer:
``buf.transport_of(rank)`` ('local', 'nvlink', 'ibgda' or 'proxy'); docs/EP.md says which of
them ran on hardware. The GPU buffer is created with the Buffer when CUDA is usable (on the
current device). CPU tensors take
a host implementation with the same results and layout (``host_ep.py``: torch ops and
all_to_all_single over the group), for machines without GPUs; ``timeout_us`` and
``active_ranks`` apply to the GPU path only (the host path has the group's timeout).

Layout of the results (as DeepEP's low-latency mode):

- ``recv_x``: bf16 ``[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]``,
  or with ``use_fp8`` a tuple (e4m3 data of that shape, float32 scales ``[..., hidden / 128]``;
  with ``use_ue8m0`` the scales are power-of-two exponents packed four to an int32,
  ``[..., hidden / 512]``). Expert e's received tokens are rows ``0 .. recv_count[e]-1``.
- ``handle``: ``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)``
  plus internal fields; ``src_info[e, i]`` is the sender's token index of row i;
  ``layout_range[e, r]`` packs, for tokens from rank r, ``(begin << 32) | count``.
- ``combine``: ``combined_x[t] = sum_k topk_weights[t, k] * y(token t at expert topk_idx[t, k])``.
  On the GPU each rank sums its own experts' weighted outputs for a token in float32 and sends
  that one row back in bf16, so the result carries one extra bf16 rounding per rank, not per
  expert. Its send half (also with ``return_recv_hook``) waits, up to ``timeout_us``, for every
  active rank's routing: the ranks' combine calls meet, as any collective's do.

Sizes: hidden a multiple of 128, top-k 1..16, num_experts a multiple of the group size, at most
``num_max_dispatch_tokens_per_rank`` tokens per call; a token must not list one expert twice;
entries of -1 (or out of range) are skipped. Violations raise before anything is launched.

Faults: a receiver that waits on a source longer than ``timeout_us`` (-1: the buffer default,
MOELINK_EP_TIMEOUT_US, 30 s; 0: no limit) marks it inactive in ``active_ranks`` (int32 per rank
on the GPU; ``buf.active_ranks()``) and treats it as having sent nothing; later rounds skip it.
The group's own membership (``moelink.get_active_ranks(group)``, changed by agreement when a
peer dies) is applied too: a rank the group has masked out is masked out of the buffer at its
next dispatch or combine. A rank readmitted by ``recover_ranks`` stays masked out until every
active rank calls ``update_members()``: the survivors after ``recover_ranks``, the replacement
process after creating its Buffer (the same arguments, the group's same Buffer); it maps the
new process's buffer, clears the signals and unmasks every rank the group has active. While a
membership change waits for it, normal-mode calls take the group route. It reconnects a
readmitted rank on every path (NVLink, CPU proxy, IBGDA); a replacement that reaches the others
differently than its predecessor did (another host) needs a new Buffer on every rank instead
(the call raises on every rank).

Rounds: dispatch/combine pairs alternate between two halves of the buffer, so a round's
dispatch may be issued while the previous round's combine is still running. Nothing here
synchronizes with the host or allocates outside torch's allocator, so dispatch and combine can
be captured in a CUDA graph and replayed.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from . import _C, host_ep
from .events import event, noop


class LowLatencyMode:
    """The low-latency methods of moelink.Buffer (a mixin: the Buffer holds the state)."""

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False, timeout_us: int = -1,
                             active_ranks: Optional[torch.Tensor] = None):
        """The low-latency dispatch (module docstring), under DeepEP's name and arguments.
        ``cumulative_local_expert_recv_stats`` (int32 [local experts]) gets each call's received
        counts added; ``dispatch_wait_recv_cost_stats`` is not measured by moelink and must be None."""
        if dispatch_wait_recv_cost_stats is not None:
            raise ValueError("moelink low_latency_dispatch: dispatch_wait_recv_cost_stats is not supported "
                             "(moelink does not time the receive per rank)")
        out = self._ll_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale,
                                use_ue8m0, async_finish, return_recv_hook, timeout_us, active_ranks)
        if cumulative_local_expert_recv_stats is not None:
            stats = cumulative_local_expert_recv_stats
            if stats.dtype != torch.int32 or tuple(stats.shape) != (self.num_local_experts,):
                raise ValueError(f"cumulative_local_expert_recv_stats must be int32 [{self.num_local_experts}]")
            if return_recv_hook:
                hook = out[4]

                def counted_hook():
                    hook()
                    stats.add_(out[1].to(stats.device))
                out = out[:4] + (counted_hook,)
            else:
                stats.add_(out[1].to(stats.device))
        return out

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None, timeout_us: int = -1,
                            active_ranks: Optional[torch.Tensor] = None):
        """The low-latency combine (module docstring), under DeepEP's name and arguments."""
        if use_logfmt:
            raise ValueError("moelink low_latency_combine: use_logfmt is not supported (rows travel as bf16)")
        if combine_wait_recv_cost_stats is not None:
            raise ValueError("moelink low_latency_combine: combine_wait_recv_cost_stats is not supported")
        return self._ll_combine(x, topk_idx, topk_weights, handle, zero_copy, async_finish, return_recv_hook, out,
                                timeout_us, active_ranks)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """DeepEP's name for get_buffer_size_hint (bytes of the low-latency buffer per rank)."""
        return _C.ep_buffer_size_hint(num_ranks, num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def get_next_combine_buffer(self, handle) -> torch.Tensor:
        """A persistent [local experts, ranks * max tokens, hidden] bf16 tensor (one per buffer
        half) that combine sends from directly: write the expert outputs into it and call
        combine with zero_copy=True (and x this tensor, or one of its shape and dtype, as DeepEP
        allows), saving a copy into a separate tensor."""
        return self._combine_buffer(handle[-1])

    def _ll_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=True,
                     round_scale=False, use_ue8m0=False, async_finish=False, return_recv_hook=False, timeout_us=-1,
                     active_ranks=None):
        self._check_call(num_max_dispatch_tokens_per_rank, num_experts)
        if use_ue8m0:
            if not (use_fp8 and round_scale):
                raise ValueError("use_ue8m0 needs use_fp8=True and round_scale=True (power-of-two scales)")
            if self.hidden % 512:
                raise ValueError(f"use_ue8m0 packs 4 scales per int32: hidden ({self.hidden}) must be a multiple of 512")
        if x.device.type == "cpu":
            self._check_host_inputs(x, topk_idx)
            out = host_ep.dispatch(self.group, self.rank, self.num_ranks, self.num_max_dispatch_tokens_per_rank,
                                   self.hidden, self.num_experts, x, topk_idx, use_fp8, round_scale)
            return_recv_hook = False  # the host path has received everything already
        else:
            self._follow_group()
            out = self._gpu().dispatch(x, topk_idx, use_fp8, round_scale, timeout_us, active_ranks,
                                       not return_recv_hook)
        recv_x = out.recv_x
        if use_fp8:
            scales = out.recv_scales
            if use_ue8m0:
                rows = scales.shape[:-1]
                scales = torch.empty(*rows, self.hidden // 512, dtype=torch.int32, device=x.device)
            recv_x = (out.recv_x, scales)

        def finish_recv():
            if use_fp8 and use_ue8m0:  # float 2^k -> its exponent byte, four per int32
                recv_x[1].copy_(((out.recv_scales.view(torch.int32) >> 23) & 0xFF).to(torch.uint8).view(torch.int32))

        hook: Callable[[], None] = noop
        if return_recv_hook:
            def hook():
                self._impl.dispatch_recv(out, use_fp8, timeout_us, active_ranks)
                finish_recv()
        else:
            finish_recv()
        handle = (out.src_info, out.layout_range, num_max_dispatch_tokens_per_rank, self.hidden, num_experts, out)
        return recv_x, out.recv_count, handle, event(async_finish), hook

    def _ll_combine(self, x, topk_idx, topk_weights, handle, zero_copy=False, async_finish=False,
                    return_recv_hook=False, out=None, timeout_us=-1, active_ranks=None):
        state = handle[-1]
        if zero_copy:  # the data is in the combine buffer (DeepEP's contract): x, if another tensor, gives its shape
            staged = self._combine_buffer(state)
            if x.data_ptr() != staged.data_ptr():
                if x.dtype != staged.dtype or x.shape != staged.shape:
                    raise ValueError(f"moelink combine: zero_copy=True sends get_next_combine_buffer(handle) "
                                     f"({staged.dtype} {tuple(staged.shape)}); x is {x.dtype} {tuple(x.shape)}")
                x = staged
        if isinstance(state, host_ep.HostState):
            rows = self.num_ranks * self.num_max_dispatch_tokens_per_rank
            if x.dtype != torch.bfloat16 or tuple(x.shape) != (self.num_local_experts, rows, self.hidden):
                raise ValueError(f"moelink combine: x must be a bfloat16 [{self.num_local_experts}, {rows}, "
                                 f"{self.hidden}] tensor, got {x.dtype} {tuple(x.shape)}")
            if topk_weights.shape != topk_idx.shape:
                raise ValueError("moelink combine: topk_weights must be shaped like topk_idx")
            if tuple(topk_idx.shape) != (state.num_tokens, state.num_topk):  # LowLatencyBuffer::combine checks the GPU path
                raise ValueError(f"moelink combine: topk_idx must be the dispatch's [{state.num_tokens}, "
                                 f"{state.num_topk}] routing (the handle's), got {tuple(topk_idx.shape)}")
            result = host_ep.combine(self.group, self.num_ranks, self.hidden, x, topk_idx, topk_weights, state, out)
            return result, event(False), noop
        self._follow_group()
        result = self._gpu().combine(x, topk_idx, topk_weights, state, out, timeout_us, active_ranks,
                                     not return_recv_hook)
        hook: Callable[[], None] = noop
        if return_recv_hook:
            def hook():
                self._impl.combine_recv(topk_idx, topk_weights, state, result, timeout_us, active_ranks)
        return result, event(async_finish), hook

    def _check_host_inputs(self, x: torch.Tensor, topk_idx: torch.Tensor) -> None:
        if x.dtype != torch.bfloat16:
            raise TypeError(f"moelink dispatch: x must be bfloat16, got {x.dtype}")
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"moelink dispatch: x must be a [tokens, {self.hidden}] tensor, got {tuple(x.shape)}")
        if x.shape[0] > self.num_max_dispatch_tokens_per_rank:
            raise ValueError(f"moelink dispatch: {x.shape[0]} tokens exceed num_max_dispatch_tokens_per_rank="
                             f"{self.num_max_dispatch_tokens_per_rank}")
        if topk_idx.dtype != torch.int64:
            raise TypeError("moelink dispatch: topk_idx must be int64")
        if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0] or topk_idx.device != x.device:
            raise ValueError(f"moelink dispatch: topk_idx must be a [{x.shape[0]}, topk] tensor on {x.device}")
        if not 1 <= topk_idx.shape[1] <= 16:
            raise ValueError(f"moelink dispatch: top-k must be 1..16, got {topk_idx.shape[1]}")

    def _check_call(self, num_max_dispatch_tokens_per_rank, num_experts):
        if num_max_dispatch_tokens_per_rank != self.num_max_dispatch_tokens_per_rank:
            raise ValueError(f"num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank}, but the buffer "
                             f"was created for {self.num_max_dispatch_tokens_per_rank}")
        if num_experts != self.num_experts:
            raise ValueError(f"num_experts={num_experts}, but the buffer was created for {self.num_experts}")

    def _combine_buffer(self, state) -> torch.Tensor:
        device = state.recv_count.device
        key = (str(device), state.half)
        if key not in self._zero_copy:
            rows = self.num_ranks * self.num_max_dispatch_tokens_per_rank
            self._zero_copy[key] = torch.empty(self.num_local_experts, rows, self.hidden, dtype=torch.bfloat16,
                                               device=device)
        return self._zero_copy[key]
