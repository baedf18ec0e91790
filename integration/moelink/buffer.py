"""moelink.Buffer: low-latency MoE dispatch and combine on the GPU.

Every rank of an "ep" group creates one with the same arguments (a collective call)::

    buf = moelink.Buffer(group, num_max_dispatch_tokens_per_rank=128, hidden=7168, num_experts=256)
    recv_x, recv_count, handle, event, hook = buf.dispatch(x, topk_idx, 128, 256)
    y = experts(recv_x, recv_count)                      # [local experts, ranks * 128, hidden] bf16
    combined, event, hook = buf.combine(y, topk_idx, topk_weights, handle)

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
next dispatch or combine. A rank readmitted by ``recover_ranks`` stays masked out of a GPU
buffer created before it left (the buffer's CUDA IPC mappings are not renewed); create a new
Buffer on every rank to include it again.

Rounds: dispatch/combine pairs alternate between two halves of the buffer, so a round's
dispatch may be issued while the previous round's combine is still running. Nothing here
synchronizes with the host or allocates outside torch's allocator, so dispatch and combine can
be captured in a CUDA graph and replayed.
"""

from __future__ import annotations

import itertools
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import _C, host_ep

_KEYS = itertools.count()


class EventOverlap:
    """The CUDA event of an ``async_finish`` call (``None`` otherwise)."""

    def __init__(self, event: Optional[torch.cuda.Event] = None):
        self.event = event

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


def _noop() -> None:
    return None


class Buffer:
    """See the module docstring."""

    def __init__(self, group=None, num_max_dispatch_tokens_per_rank: int = 128, hidden: int = 7168,
                 num_experts: int = 256):
        from . import get_backend

        backend = get_backend(group)
        self.group = group
        self.rank, self.num_ranks = backend.rank, backend.size
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.hidden = hidden
        self.num_experts = num_experts
        self.num_local_experts = num_experts // max(1, self.num_ranks)
        if hidden <= 0 or hidden % 128:
            raise ValueError(f"moelink Buffer: hidden ({hidden}) must be a positive multiple of 128")
        if num_experts <= 0 or num_experts % self.num_ranks:
            raise ValueError(f"moelink Buffer: num_experts ({num_experts}) must be a positive multiple of the "
                             f"group size ({self.num_ranks})")
        if num_max_dispatch_tokens_per_rank < 1:
            raise ValueError("moelink Buffer: num_max_dispatch_tokens_per_rank must be >= 1")
        self._backend = backend
        # Every rank creates its buffers in the same order, so the keys agree.
        self._key = f"moelink/ep_buffer/{next(_KEYS)}"
        self._impl = None  # the GPU buffer
        self._epoch = 0  # the group's membership epoch last applied to the GPU buffer's mask
        self._zero_copy = {}  # (device, half) -> persistent combine source for zero_copy
        if getattr(_C, "HAS_CUDA", False) and torch.cuda.is_available():
            self._gpu()  # on the current device; collective, like this constructor

    @staticmethod
    def get_buffer_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                             num_experts: int) -> int:
        """Bytes of GPU memory a Buffer of these sizes allocates on each rank."""
        return _C.EpBuffer.size_hint(num_ranks, num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def _gpu(self):
        if self._impl is None:
            if not getattr(_C, "HAS_CUDA", False):
                raise RuntimeError("moelink was built without CUDA (no nvcc at build time): CUDA tensors need it")
            self._impl = _C.EpBuffer(self._backend.store, self.rank, self.num_ranks, self._key,
                                     self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts)
        return self._impl

    def transport_of(self, rank: int) -> str:
        """'local', 'nvlink', 'ibgda' or 'proxy' (GPU buffer); without one, the CPU path's transport."""
        if self._impl is not None:
            return self._impl.transport_of(rank)
        from . import transport_of

        return transport_of(rank, self.group)

    def active_ranks(self) -> torch.Tensor:
        if self._impl is None:
            return torch.ones(self.num_ranks, dtype=torch.int32)
        return self._impl.active_ranks()

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

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                 num_experts: int, use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                 async_finish: bool = False, return_recv_hook: bool = False, timeout_us: int = -1,
                 active_ranks: Optional[torch.Tensor] = None):
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

        hook: Callable[[], None] = _noop
        if return_recv_hook:
            def hook():
                self._impl.dispatch_recv(out, use_fp8, timeout_us, active_ranks)
                finish_recv()
        else:
            finish_recv()
        handle = (out.src_info, out.layout_range, num_max_dispatch_tokens_per_rank, self.hidden, num_experts, out)
        return recv_x, out.recv_count, handle, self._event(async_finish), hook

    def combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle,
                zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False,
                out: Optional[torch.Tensor] = None, timeout_us: int = -1,
                active_ranks: Optional[torch.Tensor] = None):
        state = handle[-1]
        if zero_copy and x.data_ptr() != self._combine_buffer(state).data_ptr():
            raise ValueError("zero_copy=True expects x to be the tensor from get_next_combine_buffer(handle)")
        if isinstance(state, host_ep.HostState):
            rows = self.num_ranks * self.num_max_dispatch_tokens_per_rank
            if x.dtype != torch.bfloat16 or tuple(x.shape) != (self.num_local_experts, rows, self.hidden):
                raise ValueError(f"moelink combine: x must be a bfloat16 [{self.num_local_experts}, {rows}, "
                                 f"{self.hidden}] tensor, got {x.dtype} {tuple(x.shape)}")
            if topk_weights.shape != topk_idx.shape:
                raise ValueError("moelink combine: topk_weights must be shaped like topk_idx")
            if tuple(topk_idx.shape) != (state.num_tokens, state.num_topk):  # EpBuffer::combine checks the GPU path
                raise ValueError(f"moelink combine: topk_idx must be the dispatch's [{state.num_tokens}, "
                                 f"{state.num_topk}] routing (the handle's), got {tuple(topk_idx.shape)}")
            result = host_ep.combine(self.group, self.num_ranks, self.hidden, x, topk_idx, topk_weights, state, out)
            return result, self._event(False), _noop
        self._follow_group()
        result = self._gpu().combine(x, topk_idx, topk_weights, state, out, timeout_us, active_ranks,
                                     not return_recv_hook)
        hook: Callable[[], None] = _noop
        if return_recv_hook:
            def hook():
                self._impl.combine_recv(topk_idx, topk_weights, state, result, timeout_us, active_ranks)
        return result, self._event(async_finish), hook

    def _follow_group(self) -> None:
        """Masks ranks the group has masked out (after a membership change) out of the GPU buffer."""
        epoch = self._backend.epoch
        if epoch == self._epoch or self._impl is None:
            return
        self._epoch = epoch
        mine = self._impl.active_ranks()
        group = torch.tensor(self._backend.active_mask(), dtype=torch.int32).to(mine.device, non_blocking=True)
        mine.mul_(group)  # stream-ordered before this call's kernels

    def get_next_combine_buffer(self, handle) -> torch.Tensor:
        """A persistent [local experts, ranks * max tokens, hidden] bf16 tensor (one per buffer
        half) that combine sends from directly: write the expert outputs into it and call
        combine with it and zero_copy=True, saving a copy into a separate tensor."""
        return self._combine_buffer(handle[-1])

    def _combine_buffer(self, state) -> torch.Tensor:
        device = state.recv_count.device
        key = (str(device), state.half)
        if key not in self._zero_copy:
            rows = self.num_ranks * self.num_max_dispatch_tokens_per_rank
            self._zero_copy[key] = torch.empty(self.num_local_experts, rows, self.hidden, dtype=torch.bfloat16,
                                               device=device)
        return self._zero_copy[key]

    @staticmethod
    def _event(async_finish: bool) -> EventOverlap:
        if not async_finish:
            return EventOverlap(None)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream())
        return EventOverlap(ev)
