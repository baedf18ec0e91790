"""moelink.Buffer: MoE dispatch and combine on the GPU, in DeepEP's two modes.

The normal (high-throughput) mode, for training and prefill, is DeepEP's ``get_dispatch_layout``
/ ``dispatch(x, handle=None, num_tokens_per_rank=..., ...)`` / ``combine(x, handle, ...)``: see
normal.py for its semantics and paths. Kernels run on the current stream (``previous_event`` is
waited for first, ``async_finish`` returns an event recorded after them,
``allocate_on_comm_stream`` is accepted and changes nothing). The rest of this docstring is the
low-latency mode (decode).

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

import itertools
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import _C, host_ep, normal, two_hop
from .normal import Config

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
        return _C.LowLatencyBuffer.size_hint(num_ranks, num_max_dispatch_tokens_per_rank, hidden, num_experts)

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
        return Buffer.get_buffer_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

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

        hook: Callable[[], None] = _noop
        if return_recv_hook:
            def hook():
                self._impl.dispatch_recv(out, use_fp8, timeout_us, active_ranks)
                finish_recv()
        else:
            finish_recv()
        handle = (out.src_info, out.layout_range, num_max_dispatch_tokens_per_rank, self.hidden, num_experts, out)
        return recv_x, out.recv_count, handle, self._event(async_finish), hook

    def _ll_combine(self, x, topk_idx, topk_weights, handle, zero_copy=False, async_finish=False,
                    return_recv_hook=False, out=None, timeout_us=-1, active_ranks=None):
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
            if tuple(topk_idx.shape) != (state.num_tokens, state.num_topk):  # LowLatencyBuffer::combine checks the GPU path
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

    # ---- DeepEP's entry points: the normal mode, or the low-latency mode by its arguments ----

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
        event)`` (see normal.py). Called as ``dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank,
        num_experts, ...)`` it is the low-latency dispatch (``low_latency_dispatch``)."""
        if (args and isinstance(args[0], torch.Tensor)) or "num_max_dispatch_tokens_per_rank" in kwargs:
            return self._ll_dispatch(x, *args, **kwargs)
        return self._normal_dispatch(x, *args, **kwargs)

    def combine(self, x, *args, **kwargs):
        """Normal mode, as DeepEP's ``combine(x, handle, topk_weights=None, bias=None, config=None,
        previous_event=None, async_finish=False, allocate_on_comm_stream=False)`` ->
        ``(combined_x, combined_topk_weights, event)``. Called as ``combine(x, topk_idx,
        topk_weights, handle, ...)`` it is the low-latency combine (``low_latency_combine``)."""
        if (args and isinstance(args[0], torch.Tensor)) or "topk_idx" in kwargs:
            return self._ll_combine(x, *args, **kwargs)
        return self._normal_combine(x, *args, **kwargs)

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
            per_rank, per_expert, in_rank = normal.layout(topk_idx, num_experts, self.num_ranks)
        per_rdma = None
        hosts = self._hosts_seen_here(topk_idx.device)
        if hosts:  # the two-hop route's host hop: tokens per host
            per_rdma = in_rank.view(in_rank.shape[0], self.num_ranks // hosts, hosts).any(2).sum(0, dtype=torch.int32)
        return per_rank, per_rdma, per_expert, in_rank, self._event(async_finish and topk_idx.is_cuda)

    def _wait(self, previous_event) -> None:
        if previous_event is not None:
            previous_event.current_stream_wait()

    def _kernels_usable(self, device: torch.device) -> bool:
        return device.type == "cuda" and self._impl is not None and hasattr(_C, "NormalBuffer")

    def _normal_path(self, device: torch.device) -> str:
        """'nvlink' when the kernels can serve the call (CUDA tensors, every rank of the group on
        NVLink and active); 'two_hop' when the group spans hosts of several ranks each
        (two_hop.py; decided with the other ranks once per membership epoch); else 'group'
        (torch ops + all_to_all_single over the group). A non-cached dispatch is where every
        rank asks, so the agreement is a collective there."""
        if not all(self._backend.active_mask()):
            return "group"
        kernels = self._kernels_usable(device)
        if kernels and self._backend.epoch != self._connected_epoch:
            return "group"
        if kernels and self.num_ranks <= 8 and \
                all(self._impl.transport_of(r) in ("local", "nvlink") for r in range(self.num_ranks)):
            return "nvlink"
        return "two_hop" if self._agreed_hosts(device) else "group"

    def _hosts_seen_here(self, device: torch.device) -> int:
        """Ranks per host for the two-hop route as this rank sees the group (0: not applicable)."""
        if not two_hop.enabled():
            return 0
        if self._kernels_usable(device):
            same = [r for r in range(self.num_ranks) if self._impl.transport_of(r) in ("local", "nvlink")]
        else:
            per_host = _C.setting("MOELINK_EP_RANKS_PER_HOST")
            if per_host:
                same = [r for r in range(self.num_ranks) if r // per_host == self.rank // per_host]
            else:
                same = [r for r in range(self.num_ranks) if self._backend.transport_of(r) in ("local", "shm")]
        return two_hop.hosts_of(self.rank, self.num_ranks, same)

    def _agreed_hosts(self, device: torch.device) -> int:
        key = (device.type, self._backend.epoch)
        if key not in self._hosts:
            mine = self._hosts_seen_here(device)
            both = torch.tensor([mine, -mine], dtype=torch.int64)
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
            self._hosts[key] = mine if both[0].item() == -both[1].item() else 0
        return self._hosts[key]

    def _route(self, device: torch.device) -> "two_hop.TwoHop":
        """The two-hop route for tensors on ``device``'s type (after _normal_path chose it)."""
        route = self._two_hop.get(device.type)
        if route is None:
            route = self._two_hop[device.type] = two_hop.TwoHop(self, self._agreed_hosts(device))
        return route

    def update_members(self) -> None:
        """Collective over the group's active ranks: brings the GPU buffer up to the group's
        membership after ``moelink.recover_ranks`` (or ``extend_group_size_to``) without
        rebuilding it. Survivors call it after readmitting; the readmitted rank's new process
        calls it after creating its Buffer (with the same arguments, as the group's same
        Buffer). It waits for this rank's kernels and for what its CPU proxy and NIC still
        carry, connects the readmitted ranks' new processes whatever the path (maps their
        buffers over CUDA IPC, opens their CPU-proxy inboxes, connects new IBGDA queue pairs),
        clears every signal, and unmasks every rank the group has active, also one this buffer
        masked out after a ``timeout_us`` expired; the normal mode's buffer is rebuilt at its
        next use. No dispatch or combine may be in flight on any rank (their handles from
        before the call are void). A replacement must reach the others the way its predecessor
        did (the same host, or one with the same paths: NVLink, proxy, IBGDA); otherwise the
        call raises ValueError on every rank, changing nothing, and a new Buffer on every rank
        is the way on."""
        backend = self._backend
        if self._impl is None:  # no GPU buffer: the host path follows the group's mask by itself
            self._epoch = self._connected_epoch = backend.epoch
            return
        torch.cuda.synchronize(self._impl.active_ranks().device)  # this rank's rounds are over
        serial = next(self._normal_serial)
        self._updates += 1
        mine = torch.tensor([self._impl.nonce(), self._key_index + 1, serial, self._impl.pairs_hash(), self._updates],
                            dtype=torch.int64)
        cols = mine.numel()
        every = torch.zeros(self.num_ranks * cols, dtype=torch.int64)
        dist.all_gather_into_tensor(every, mine, group=self.group)  # inactive ranks' slots: zeros
        mask = list(backend.active_mask())
        every = every.view(self.num_ranks, cols).tolist()
        active = [r for r in range(self.num_ranks) if mask[r]]
        keys = {every[r][1] - 1 for r in active}
        if len(keys) != 1:
            raise ValueError(f"moelink Buffer.update_members: the active ranks call it on different Buffers "
                             f"(creation indices {sorted(keys)}); a replacement process must create the same "
                             "Buffers in the same order as the others")
        paths = {every[r][3] for r in active}
        if len(paths) != 1:
            raise ValueError("moelink Buffer.update_members: the ranks reach each other differently in their "
                             "Buffers (a replacement process on another host than its predecessor, or with "
                             "another NIC, or a rank that was inactive when the others created it): create a new "
                             "Buffer on every rank instead")
        self._updates = generation = max(every[r][4] for r in active)
        self._normal = None  # the next normal-mode call creates it anew, over the new mappings
        self._two_hop = {}  # and the two-hop route's NVLink buffer with it
        self._normal_serial = itertools.count(max(row[2] for row in every) + 1)
        error = None
        for step in (self._impl.settle,  # then no rank's traffic is on its way anywhere
                     lambda: self._impl.update_members(mask, [every[r][0] if mask[r] else 0
                                                              for r in range(self.num_ranks)], generation)):
            try:
                if error is None:
                    step()
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                error = e
            ok = torch.tensor([0 if error is not None else 1], dtype=torch.int32)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)  # nobody goes on before all are ready
            if error is not None:
                raise error
            if not ok.item():
                raise RuntimeError("moelink Buffer.update_members failed on another rank (see its error); this "
                                   "rank's buffer may be left with that rank masked out")
        self._epoch = self._connected_epoch = backend.epoch

    def _normal_buffer(self, needed: int, config: Config):
        """The NVL buffer over the whole group, created at first use and grown when a call needs
        more (normal.nvl_buffer)."""
        def make(size):
            return _C.NormalBuffer(self._backend.store, self.rank, self.num_ranks,
                                   f"{self._key}/normal/{next(self._normal_serial)}", size, self.num_experts)

        return normal.nvl_buffer(self, "_normal", needed, config, self.hidden, self.num_ranks, self.group, make,
                                 self.get_dispatch_config, self.get_combine_config)

    def _check_handle(self, what: str, handle) -> normal.NormalState:
        if not isinstance(handle, tuple) or len(handle) != 7 or not isinstance(handle[-1], normal.NormalState):
            raise ValueError(f"moelink {what}: handle must be the handle a normal-mode dispatch of this buffer returned")
        state = handle[-1]
        if state.buffer_key != self._key:
            raise ValueError(f"moelink {what}: the handle belongs to another Buffer")
        return state

    def _normal_dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                         is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                         expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                         previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        what = "dispatch"
        data, scales = normal.split_x(what, x, self.hidden)
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
            normal.check_layout(what, self.num_ranks, self.num_experts, t, device, num_tokens_per_rank,
                                is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights)
            path = self._normal_path(device)
        self._wait(previous_event)
        if path == "two_hop":
            route = self._route(device)
            if handle is not None:
                recv_x, recv_s = route.cached_dispatch(data, scales, state, user_config)
                return (recv_x, recv_s) if scales is not None else recv_x, None, None, None, None, \
                    self._event(async_finish and data.is_cuda)
            recv_x, recv_s, r_idx, r_w, counts, handle = route.dispatch(
                data, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert, user_config,
                expert_alignment, num_worst_tokens, self._kernels_usable(device))
        elif path == "group":
            if handle is None:
                recv_x, recv_s, r_idx, r_w, counts, src_idx, state = normal.group_dispatch(
                    self.group, self.rank, self.num_ranks, self.num_experts, data, scales, topk_idx, topk_weights,
                    is_token_in_rank, num_tokens_per_expert, None, expert_alignment, num_worst_tokens, self._key)
                state.num_out_rows = recv_x.shape[0]
                prefix = torch.tensor(state.recv_counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
                handle = (prefix, None, None, src_idx, is_token_in_rank, None, state)
            else:
                recv_x, recv_s, *_ = normal.group_dispatch(
                    self.group, self.rank, self.num_ranks, self.num_experts, data, scales, None, None,
                    is_token_in_rank, None, state, 1, state.num_out_rows, self._key)
                return (recv_x, recv_s) if scales is not None else recv_x, None, None, None, None, \
                    self._event(async_finish and data.is_cuda)
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
                    self._event(async_finish)
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
            counts = [] if num_worst_tokens else normal.pad_counts(res.num_recv_per_expert, expert_alignment)
            state = normal.NormalState(self._key, t, self.hidden, res.num_recv, [], [], None, "nvlink",
                                       config.num_channels, counts_on_device=num_worst_tokens > 0)
            state.num_out_rows = recv_x.shape[0]
            handle = (res.rank_prefix, res.channel_prefix, res.recv_channel_prefix, res.recv_src_idx,
                      is_token_in_rank, res.send_head, state)
        return (recv_x, recv_s) if scales is not None else recv_x, r_idx, r_w, counts, handle, \
            self._event(async_finish and data.is_cuda)

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
            combined, combined_w = normal.group_combine(self.group, x, state, topk_weights, biases)
            return combined, combined_w, self._event(async_finish and x.is_cuda)
        if state.path == "two_hop":
            combined, combined_w = self._route(device).combine(x, state, topk_weights, biases, user_config)
            return combined, combined_w, self._event(async_finish and x.is_cuda)
        shape = _C.NormalShape(state.num_channels, config.num_max_nvl_chunked_recv_tokens,
                               config.num_max_nvl_chunked_send_tokens)
        k = topk_weights.shape[1] if topk_weights is not None else 0
        needed = _C.NormalBuffer.bytes_needed(self.num_ranks, self.num_local_experts, shape, self.hidden * 2, 0, k)
        combined, combined_w = self._normal_buffer(needed, config).combine(
            x, topk_weights, biases[0] if biases else None, biases[1] if len(biases) > 1 else None, handle[0],
            handle[2], handle[5], state.num_recv_tokens, shape, -1)
        return combined, combined_w, self._event(async_finish)

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
