"""``mooncake.mooncake_ep_buffer`` served by moelink: Mooncake's EP ``Buffer`` (its low-latency
dispatch / combine with an ``active_ranks`` tensor and ``timeout_us`` per call) over moelink's
EP buffer (moelink.Buffer: NVLink kernels within a host, IBGDA or the CPU proxy across hosts, a
host implementation for CPU tensors)::

    buffer = Buffer(group, num_ep_buffer_bytes=Buffer.get_ep_buffer_size_hint(128, 7168, world, 256))
    recv_x, recv_count, handle, event, hook = buffer.dispatch(x, topk_idx, active_ranks, 128, 256, timeout_us)
    combined_x, event, hook = buffer.combine(y, topk_idx, topk_weights, active_ranks, timeout_us, handle)

Mooncake sizes its buffer by ``num_ep_buffer_bytes`` up front and learns the shapes per call;
moelink's buffer is made for one (tokens per rank, hidden, experts), so this Buffer makes one at
the first call of each shape (a collective, as every rank makes the same calls), within
``num_ep_buffer_bytes`` (ValueError past it).

``active_ranks`` (int32, one entry per rank, on the tensors' device): the kernels skip the ranks
it masks out and write 0 for a rank they waited on longer than ``timeout_us`` (a negative value:
moelink's default, MOELINK_EP_TIMEOUT_US; 0: no limit), as Mooncake's do. The group's own
membership is applied to it when it changes (a rank the group masked out is masked out of it);
the tensor given to ``MooncakeBackendOptions(active_ranks)`` is the group's mask, refreshed here
at each change (SGLang's way). A tensor of another length is ignored, as Mooncake ignores it
(a warning says so). With CPU tensors the group's mask is written into it after the call.

``disable_p2p=True`` makes every rank its own (virtual) host for this Buffer's GPU buffers
(MOELINK_EP_RANKS_PER_HOST=1 while they are made): peers are reached by IBGDA or the CPU proxy,
not NVLink, as Mooncake then uses RDMA.

``update_ep_member()`` after ``pg.recover_ranks`` (the survivors) and the replacement's new
``Buffer(group, ...)`` meet in one collective that reconnects the replacement in place
(moelink.Buffer.update_members); no dispatch or combine may be in flight.
"""

from __future__ import annotations

import itertools
import json
import os
import warnings
from typing import Optional

import torch
import torch.distributed as dist

import moelink
from moelink import _C
from moelink.events import EventOverlap, event
from moelink.routing import mask_out_inactive

from . import pg as _pg

__all__ = ["Buffer", "EventOverlap"]

_INDEXES = itertools.count()  # per process: every rank creates its Buffers in the same order


def _shape_key(index: int, i: int) -> str:
    return f"moelink/compat/mooncake/ep_buffer/{index}/shape/{i}"


class Buffer:
    """Mooncake's EP Buffer (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup, num_ep_buffer_bytes: int, disable_p2p: bool = False):
        _, self._ep = _pg._resolve(group)
        self.group = group
        self.backend = group
        self.rank = group.rank()
        self.group_size = group.size()
        self.num_ep_buffer_bytes = int(num_ep_buffer_bytes)
        if self.num_ep_buffer_bytes <= 0:
            raise ValueError(f"num_ep_buffer_bytes must be positive, got {num_ep_buffer_bytes}")
        self.disable_p2p = bool(disable_p2p)
        self.device_type = "cuda" if getattr(_C, "HAS_CUDA", False) and torch.cuda.is_available() else "cpu"
        self._use_fallback = self.device_type != "cuda"  # Mooncake's name: no GPU kernels (the host path)
        self._index = next(_INDEXES)
        self._shapes = []  # (tokens per rank, hidden, experts) in creation order
        self._buffers = {}  # shape -> moelink.Buffer
        self._epoch = self._ep.epoch  # the membership epoch last applied to a caller's active_ranks
        self._warned_length = False
        self._connect()

    # ---- buffers per shape, and membership ----

    def _connect(self) -> None:
        """Collective: brings this Buffer to the shapes the other ranks have (a replacement
        process's new Buffer, or update_ep_member on every rank) and reconnects each."""
        count = torch.tensor([len(self._shapes)], dtype=torch.int64, device="cpu")
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
        store = self._ep.store
        for i in range(len(self._shapes), int(count.item())):
            record = store.get(_shape_key(self._index, i)).decode()
            shape = json.loads(record)
            if not (isinstance(shape, list) and len(shape) == 3 and all(type(v) is int and v > 0 for v in shape)):
                raise ValueError(f"Mooncake Buffer: the group's shape record {i} is {record!r}, not three positive "
                                 "integers (tokens per rank, hidden, experts)")
            self._make(tuple(shape))
        for shape in self._shapes:
            self._buffers[shape].update_members()
        self._epoch = self._ep.epoch

    def _make(self, shape) -> "moelink.Buffer":
        tokens, hidden, experts = shape
        need = moelink.Buffer.get_buffer_size_hint(tokens, hidden, self.group_size, experts)
        if need > self.num_ep_buffer_bytes:
            raise ValueError(f"Mooncake Buffer: dispatching {tokens} tokens per rank of hidden {hidden} to {experts} "
                             f"experts needs {need} bytes, num_ep_buffer_bytes is {self.num_ep_buffer_bytes} (size it "
                             "with Buffer.get_ep_buffer_size_hint)")
        saved = os.environ.get("MOELINK_EP_RANKS_PER_HOST")
        if self.disable_p2p:  # every rank its own (virtual) host: no NVLink between ranks
            os.environ["MOELINK_EP_RANKS_PER_HOST"] = "1"
        try:
            buf = moelink.Buffer(self.group, tokens, hidden, experts)
        finally:
            if self.disable_p2p:
                if saved is None:
                    os.environ.pop("MOELINK_EP_RANKS_PER_HOST", None)
                else:
                    os.environ["MOELINK_EP_RANKS_PER_HOST"] = saved
        self._buffers[shape] = buf
        self._shapes.append(shape)
        self._ep.store.set(_shape_key(self._index, len(self._shapes) - 1), json.dumps(list(shape)))
        return buf

    def _buffer(self, tokens: int, hidden: int, experts: int) -> "moelink.Buffer":
        shape = (int(tokens), int(hidden), int(experts))
        return self._buffers.get(shape) or self._make(shape)

    def update_ep_member(self) -> None:
        """Collective over the group's active ranks, after ``pg.recover_ranks`` (a replacement
        process creates its Buffer instead): reconnects the readmitted ranks in place."""
        self._connect()

    def _mask(self, active_ranks: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
        """The mask a call's kernels use: the caller's tensor with the group's changes applied."""
        _pg._refresh(self._ep)
        if active_ranks is None:
            return None
        if not isinstance(active_ranks, torch.Tensor) or active_ranks.dtype != torch.int32 or active_ranks.dim() != 1 \
                or not active_ranks.is_contiguous():
            raise ValueError("active_ranks must be a contiguous 1-D int32 tensor (one entry per rank)")
        if active_ranks.numel() != self.group_size:
            if not self._warned_length:
                warnings.warn(f"Mooncake Buffer: active_ranks has {active_ranks.numel()} entries, the group "
                              f"{self.group_size}: it is ignored (the group's mask is used), as Mooncake does",
                              RuntimeWarning, stacklevel=3)
                self._warned_length = True
            return None
        if active_ranks.device != device:
            raise ValueError(f"active_ranks is on {active_ranks.device}, the call's tensors on {device}")
        if device.type == "cuda" and self._ep.epoch != self._epoch:
            self._epoch = self._ep.epoch
            mask_out_inactive(self._ep, active_ranks)
        return active_ranks

    def _after_host_call(self, active_ranks: Optional[torch.Tensor]) -> None:
        if active_ranks is not None and active_ranks.device.type == "cpu" and active_ranks.numel() == self.group_size:
            active_ranks.copy_(torch.tensor(self._ep.active_mask(), dtype=torch.int32, device="cpu"))

    # ---- Mooncake's entry points ----

    @staticmethod
    def get_ep_buffer_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                num_experts: int) -> int:
        """Bytes a Buffer needs for calls of these sizes."""
        return moelink.Buffer.get_buffer_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, active_ranks: Optional[torch.Tensor],
                 num_max_dispatch_tokens_per_rank: int, num_experts: int, timeout_us: int,
                 use_fp8: Optional[bool] = None, async_finish: bool = False, return_recv_hook: bool = False,
                 topk_weights: Optional[torch.Tensor] = None):
        """-> ``(recv_x, recv_count, handle, event, hook)``: recv_x bf16 ``[local experts, ranks *
        num_max_dispatch_tokens_per_rank, hidden]`` (with ``use_fp8``, the default: e4m3 data and
        float32 scales per 128 values); ``hook`` (``return_recv_hook``) receives, else None."""
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError("x must be a [tokens, hidden] bfloat16 tensor")
        if topk_weights is not None and (topk_weights.shape != topk_idx.shape or topk_weights.dtype != torch.float32):
            raise ValueError("topk_weights must be float32 and shaped like topk_idx")
        buf = self._buffer(num_max_dispatch_tokens_per_rank, x.shape[1], num_experts)
        mask = self._mask(active_ranks, x.device)
        recv_x, recv_count, handle, ev, hook = buf.low_latency_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=True if use_fp8 is None else use_fp8,
            async_finish=async_finish, return_recv_hook=return_recv_hook, timeout_us=int(timeout_us),
            active_ranks=mask)
        if x.device.type == "cpu":
            self._after_host_call(active_ranks)
        return recv_x, recv_count, handle, ev, hook if return_recv_hook else None

    def combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                active_ranks: Optional[torch.Tensor], timeout_us: int, handle, zero_copy: bool = False,
                async_finish: bool = False, return_recv_hook: bool = False, out: Optional[torch.Tensor] = None):
        """-> ``(combined_x, event, hook)``: ``combined_x[t] = sum_k topk_weights[t, k] *
        x(token t at expert topk_idx[t, k])``. ``zero_copy``: the expert outputs are in
        get_next_combine_buffer(handle) (x that tensor, or one of its shape)."""
        buf = self._handle_buffer(handle)
        mask = self._mask(active_ranks, x.device)
        combined, ev, hook = buf.low_latency_combine(
            x, topk_idx, topk_weights, handle, zero_copy=zero_copy, async_finish=async_finish,
            return_recv_hook=return_recv_hook, out=out, timeout_us=int(timeout_us), active_ranks=mask)
        if x.device.type == "cpu":
            self._after_host_call(active_ranks)
        return combined, ev, hook if return_recv_hook else None

    def get_next_combine_buffer(self, handle) -> torch.Tensor:
        """The tensor combine sends from with ``zero_copy=True`` (write the expert outputs into it)."""
        return self._handle_buffer(handle).get_next_combine_buffer(handle)

    def _handle_buffer(self, handle) -> "moelink.Buffer":
        try:
            shape = (int(handle[2]), int(handle[3]), int(handle[4]))
        except (TypeError, IndexError, ValueError):
            raise ValueError("handle must be the one this Buffer's dispatch returned") from None
        buf = self._buffers.get(shape)
        if buf is None:
            raise ValueError(f"handle is of a dispatch this Buffer did not make (shape {shape})")
        return buf

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current stream now."""
        return event(True)

    def get_comm_stream(self) -> torch.cuda.Stream:
        """The stream the kernels run on: moelink launches on the caller's current stream."""
        return torch.cuda.current_stream()

    def active_ranks(self) -> torch.Tensor:
        """The group's mask (int32 per rank, CPU)."""
        return _pg.get_active_ranks(self.group)

    def transport_of(self, rank: int) -> str:
        """How dispatch reaches ``rank``: 'local', 'nvlink', 'ibgda' or 'proxy' (moelink's)."""
        if not self._shapes:
            return moelink.transport_of(rank, self.group)
        return self._buffers[self._shapes[0]].transport_of(rank)

    @classmethod
    def create_elastic(cls, *args, **kwargs):
        raise RuntimeError("moelink.compat.mooncake: Buffer.create_elastic (an EP buffer without a process group, "
                           "connected rank by rank through a TCPStore) is not served: create the group with "
                           "init_process_group('ep', pg_options=pg.MooncakeBackendOptions(max_group_size)) and use "
                           "Buffer(group, num_ep_buffer_bytes); ranks join with recover_ranks + update_ep_member")
