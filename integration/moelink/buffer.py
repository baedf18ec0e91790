"""moelink.Buffer: MoE dispatch and combine on the GPU, in DeepEP's two modes, with DeepEP's
names: the low-latency mode (decode) is ``low_latency_dispatch`` / ``low_latency_combine``
(low_latency.py has its contract), the normal mode (training, prefill) is
``get_dispatch_layout`` / ``dispatch`` / ``combine`` (normal.py). A mode is never guessed from a
call's arguments: ``dispatch`` and ``combine`` are the normal mode's, and raise a TypeError that
names ``low_latency_dispatch`` / ``low_latency_combine`` when called with the low-latency
arguments. Which route a normal-mode call takes, and how the buffer follows the group's
membership, is routing.py's.

Every rank of an "ep" group creates the Buffer with the same arguments (a collective call)::

    buf = moelink.Buffer(group, num_max_dispatch_tokens_per_rank=128, hidden=7168, num_experts=256)

Kernels run on the current stream (``previous_event`` is waited for first, ``async_finish``
returns an ``EventOverlap`` recorded after them, ``allocate_on_comm_stream`` is accepted and
changes nothing).
"""

from __future__ import annotations

import itertools

import torch

from . import _C, normal
from .low_latency import LowLatencyMode
from .normal import Config, NormalMode
from .routing import Routing

_KEYS = itertools.count()


class Buffer(LowLatencyMode, NormalMode, Routing):
    """See the module docstring; the modes' methods come from low_latency.py and normal.py, the
    routes and membership from routing.py."""

    def __init__(self, group=None, num_max_dispatch_tokens_per_rank: int = 128, hidden: int = 7168,
                 num_experts: int = 256):
        from . import get_backend

        backend = get_backend(group)
        self.group = group
        self.rank, self.num_ranks = backend.rank(), backend.size()
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
        self._key_index = next(_KEYS)
        self._key = f"moelink/ep_buffer/{self._key_index}"
        self._impl = None  # the GPU buffer
        self._epoch = 0  # the group's membership epoch last applied to the GPU buffer's mask
        # The membership epoch the GPU mappings were made for: after a change, the normal
        # mode's kernels wait for update_members() (its calls take the group route meanwhile).
        self._connected_epoch = backend.epoch
        self._zero_copy = {}  # (device, half) -> persistent combine source for zero_copy
        self._normal = None  # the normal mode's NVLink buffer, created at its first use
        self._normal_serial = itertools.count()
        self._updates = 0  # update_members calls (the ranks agree on the count: IBGDA records carry it)
        self._two_hop = {}  # device type -> the normal mode's route across hosts (two_hop.py), made at first use
        self._hosts = {}  # (device type, membership epoch) -> agreed ranks per host for the two-hop route
        if getattr(_C, "HAS_CUDA", False) and torch.cuda.is_available():
            self._gpu()  # on the current device; collective, like this constructor

    @staticmethod
    def get_buffer_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                             num_experts: int) -> int:
        """Bytes of GPU memory a Buffer of these sizes allocates on each rank."""
        return _C.ep_buffer_size_hint(num_ranks, num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def _gpu(self):
        if self._impl is None:
            if not getattr(_C, "HAS_CUDA", False):
                raise RuntimeError("moelink was built without CUDA (no nvcc at build time): CUDA tensors need it")
            self._impl = _C.LowLatencyBuffer(self._backend.store, self.rank, self.num_ranks, self._key,
                                     self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts,
                                     list(self._backend.active_mask()))
        return self._impl

    def transport_of(self, rank: int) -> str:
        """'local', 'nvlink', 'ibgda' or 'proxy' (GPU buffer); without one, the CPU path's transport."""
        if self._impl is not None:
            return self._impl.transport_of(rank)
        from . import transport_of

        return transport_of(rank, self.group)

    def active_ranks(self) -> torch.Tensor:
        if self._impl is None:
            return torch.ones(self.num_ranks, dtype=torch.int32, device="cpu")
        return self._impl.active_ranks()

    # ---- DeepEP's normal-mode entry points (the low-latency ones: low_latency.py) ----

    num_sms = 24  # SMs the normal mode's default configs use (DeepEP's Buffer.num_sms)

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        if new_num_sms < 2 or new_num_sms % 2:
            raise ValueError(f"moelink Buffer.set_num_sms: an even number >= 2, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return normal.get_dispatch_config(num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return normal.get_combine_config(num_ranks, Buffer.num_sms)

    def dispatch(self, x, *args, **kwargs):
        """Normal mode, as DeepEP's ``dispatch(x, handle=None, num_tokens_per_rank=None,
        num_tokens_per_rdma_rank=None, is_token_in_rank=None, num_tokens_per_expert=None,
        topk_idx=None, topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=None,
        previous_event=None, async_finish=False, allocate_on_comm_stream=False)`` ->
        ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
        event)`` (see normal.py). The low-latency dispatch is ``low_latency_dispatch``."""
        if (args and isinstance(args[0], torch.Tensor)) or "num_max_dispatch_tokens_per_rank" in kwargs:
            raise TypeError("moelink Buffer.dispatch is the normal mode (DeepEP's dispatch(x, handle=None, "
                            "num_tokens_per_rank=..., ...)); the low-latency dispatch is "
                            "Buffer.low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, "
                            "...)")
        return self._normal_dispatch(x, *args, **kwargs)

    def combine(self, x, *args, **kwargs):
        """Normal mode, as DeepEP's ``combine(x, handle, topk_weights=None, bias=None, config=None,
        previous_event=None, async_finish=False, allocate_on_comm_stream=False)`` ->
        ``(combined_x, combined_topk_weights, event)``. The low-latency combine is
        ``low_latency_combine``."""
        if (args and isinstance(args[0], torch.Tensor)) or "topk_idx" in kwargs:
            raise TypeError("moelink Buffer.combine is the normal mode (DeepEP's combine(x, handle, ...)); the "
                            "low-latency combine is Buffer.low_latency_combine(x, topk_idx, topk_weights, handle, ...)")
        return self._normal_combine(x, *args, **kwargs)

    def _wait(self, previous_event) -> None:
        if previous_event is not None:
            previous_event.current_stream_wait()
