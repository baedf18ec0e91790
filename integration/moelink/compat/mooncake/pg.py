"""``mooncake.pg`` served by moelink: Mooncake's backend options and elastic-membership
functions over groups of backend ``"ep"``.

Every function takes the group first, as Mooncake's do: the ProcessGroup (``dist.group.WORLD``,
a ``new_group``), or the backend object behind it. What each does in moelink:

- ``MooncakeBackendOptions(max_group_size, is_extension, auto_deactivate_on_failure,
  auto_sync_on_failure)`` or ``MooncakeBackendOptions(active_ranks, is_extension,
  max_group_size)``: ``pg_options`` of ``init_process_group("ep")`` / ``new_group``. A
  ``max_group_size`` above ``world_size`` makes a group of ``max_group_size`` ranks whose ranks
  ``[world_size, max_group_size)`` are reserved (inactive) until they join with
  ``is_extension=True`` and the active ranks call ``recover_ranks``. An ``active_ranks`` tensor
  (int32, at least ``max_group_size`` entries) is kept equal to the group's mask: a CPU tensor
  by the collective worker at every membership change, a CUDA tensor by every function here
  and every dispatch/combine of the compat Buffer.
- ``get_active_ranks`` (int32 mask, the same tensor on every call), ``get_peer_state`` (this
  rank's view: active, or a replacement process waiting and answering), ``get_num_synced_ranks``,
  ``get_current_epoch`` (moelink's membership epoch): local, no communication.
- ``recover_ranks`` / ``activate_ranks``: readmit waiting replacement processes, a collective over
  the active ranks (moelink.recover_ranks); ``Applied``, or ``Rejected`` with the reason when a
  rank is not waiting. ``extend_group_size_to``: moelink's (readmits reserved ranks below the size).
- ``deactivate_ranks``: this rank alone leaves the group (``[own rank]``: its backend shuts down,
  the others mask it out at their next op); ranks that have failed are masked out by agreement
  (a collective over the active ranks that call it); a live rank cannot be evicted (``Rejected``).
- ``join_group``: the replacement's side of readmission. moelink readmits a replacement inside
  ``init_process_group`` (it returns once the active ranks call ``recover_ranks``), so this
  checks that this rank is active and returns.
- ``sync_after_failure``: a barrier over the active ranks, through which any failed rank is
  agreed out; ``Reconciled`` if the mask changed, else ``NoPending``.
- ``get_failed_ranks_hint(work)`` / ``get_local_success(work)``: the ranks an op lost (int32 per
  rank) and whether this rank's part succeeded.
- ``set_host_ip``, ``set_collective_timeout_us``: moelink's MOELINK_HOST_IP /
  MOELINK_FAILURE_PROBE_MS for groups created afterwards. ``set_device_filter``: the RDMA device
  the EP buffer's IBGDA uses (MOELINK_IBGDA_DEVICE); raises where the machine has none.
  ``set_p2p_timeout_us``, ``set_fault_reconciliation_window_us``, ``set_transfer_engine``: raise
  (the README's table says why).
"""

from __future__ import annotations

import enum
import os
from typing import Iterable, List, Optional

import torch
import torch.distributed as dist

import moelink
from moelink import _C

__all__ = [
    "MooncakeBackendOptions", "ProposalStatus", "ViewUpdateStatus", "SyncAfterFailureStatus",
    "ProposeViewUpdateResponse", "SyncAfterFailureResponse", "get_active_ranks", "get_num_synced_ranks",
    "extend_group_size_to", "get_peer_state", "recover_ranks", "activate_ranks", "deactivate_ranks", "join_group",
    "get_failed_ranks_hint", "get_local_success", "get_current_epoch", "sync_after_failure", "set_host_ip",
    "set_collective_timeout_us", "set_p2p_timeout_us", "set_fault_reconciliation_window_us", "set_device_filter",
    "set_transfer_engine", "MOONCAKE_PG_MAX_RANKS",
]

MOONCAKE_PG_MAX_RANKS = 64  # Mooncake's limit on max_group_size; moelink has none, it is kept for range checks


class InvalidArgument(ValueError, RuntimeError):
    """Bad input to a compat function: a ValueError, and a RuntimeError as Mooncake raises."""


class ProposalStatus(enum.IntEnum):
    Rejected = 0
    Applied = 1
    AppliedWithDroppedRanks = 2


ViewUpdateStatus = ProposalStatus  # Mooncake's earlier name


class SyncAfterFailureStatus(enum.IntEnum):
    Reconciled = 0
    NoPending = 1
    Rejected = 2


class ProposeViewUpdateResponse:
    """What recover_ranks / activate_ranks / deactivate_ranks return."""

    def __init__(self, status: ProposalStatus, new_epoch: int, dropped_ranks=(), reject_reason: str = ""):
        self.status = status
        self.new_epoch = int(new_epoch)
        self.dropped_ranks = list(dropped_ranks)
        self.reject_reason = reject_reason

    def __repr__(self):
        return (f"ProposeViewUpdateResponse(status={self.status.name}, new_epoch={self.new_epoch}, "
                f"dropped_ranks={self.dropped_ranks}, reject_reason={self.reject_reason!r})")


class SyncAfterFailureResponse:
    def __init__(self, status: SyncAfterFailureStatus, reject_reason: str = ""):
        self.status = status
        self.reject_reason = reject_reason

    def __repr__(self):
        return f"SyncAfterFailureResponse(status={self.status.name}, reject_reason={self.reject_reason!r})"


# ---- options ----

class MooncakeBackendOptions(moelink.EpOptions):
    """Mooncake's ``pg_options``, for backend ``"ep"`` (see the module docstring)::

        MooncakeBackendOptions(max_group_size, is_extension=False, auto_deactivate_on_failure=True,
                               auto_sync_on_failure=True)
        MooncakeBackendOptions(active_ranks, is_extension=False, max_group_size=0)
    """

    def __init__(self, *args, **kwargs):
        first = args[0] if args else kwargs.get("active_ranks", kwargs.get("max_group_size"))
        if isinstance(first, torch.Tensor):
            names = ("active_ranks", "is_extension", "max_group_size")
            values = dict(active_ranks=None, is_extension=False, max_group_size=0)
        else:
            names = ("max_group_size", "is_extension", "auto_deactivate_on_failure", "auto_sync_on_failure")
            values = dict(max_group_size=0, is_extension=False, auto_deactivate_on_failure=True,
                          auto_sync_on_failure=True)
        if len(args) > len(names):
            raise TypeError(f"MooncakeBackendOptions takes at most {len(names)} arguments ({', '.join(names)})")
        values.update(zip(names, args))
        for key, value in kwargs.items():
            if key not in names:
                raise TypeError(f"MooncakeBackendOptions({', '.join(names)}): unexpected argument {key!r}")
            if key in names[:len(args)]:
                raise TypeError(f"MooncakeBackendOptions: {key!r} given twice")
            values[key] = value
        if first is None and not args:
            raise TypeError("MooncakeBackendOptions needs max_group_size or an active_ranks tensor")
        self.active_ranks: Optional[torch.Tensor] = values.get("active_ranks")
        max_group_size = int(values["max_group_size"])
        self.max_group_size = max_group_size if max_group_size > 0 else -1
        self.auto_deactivate_on_failure = bool(values.get("auto_deactivate_on_failure", True))
        self.auto_sync_on_failure = bool(values.get("auto_sync_on_failure", True))
        super().__init__(is_extension=bool(values["is_extension"]))

    def __repr__(self):
        mask = "" if self.active_ranks is None else f"active_ranks=<{tuple(self.active_ranks.shape)}>, "
        return (f"MooncakeBackendOptions({mask}max_group_size={self.max_group_size}, "
                f"is_extension={self.is_extension}, auto_deactivate_on_failure={self.auto_deactivate_on_failure}, "
                f"auto_sync_on_failure={self.auto_sync_on_failure})")

    def _create(self, dist_opts):
        size, rank = dist_opts.group_size, dist_opts.group_rank
        capacity = self.max_group_size if self.max_group_size > 0 else size
        if not size <= capacity <= MOONCAKE_PG_MAX_RANKS:
            raise InvalidArgument(f"max_group_size must be in [group_size, {MOONCAKE_PG_MAX_RANKS}]: "
                                  f"got {capacity} for a group of {size}")
        if self.auto_sync_on_failure and not self.auto_deactivate_on_failure:
            raise InvalidArgument("auto_sync_on_failure requires auto_deactivate_on_failure=true")
        mask = self.active_ranks
        if mask is not None:
            if mask.dtype != torch.int32:
                raise InvalidArgument("active_ranks must have dtype int32")
            if not mask.is_contiguous():
                raise InvalidArgument("active_ranks must be contiguous")
            if mask.numel() < capacity:
                raise InvalidArgument("active_ranks is smaller than max_group_size")
            if mask.device.type not in ("cpu", "cuda"):
                raise InvalidArgument("active_ranks must be on a CPU or CUDA device")
        backend = _C.EpBackend(dist_opts.store, rank, capacity, dist_opts.timeout, extension=self.is_extension,
                               initial_size=0 if capacity == size else size)
        if mask is not None and mask.device.type == "cpu":
            backend.mirror_mask(mask)  # the worker writes it at every membership change
        elif mask is not None:
            _mirrors[id(backend)] = [backend, mask, None]
            _refresh(backend)
        if capacity == size:
            return backend
        # The group is as large as it can grow: a ProcessGroup of `capacity` ranks over the backend,
        # returned to torch in place of the one of `size` ranks it made for the call.
        group = dist.ProcessGroup(dist_opts.store, rank, capacity)
        for device in ("cpu", "cuda"):
            group._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, backend)
        group._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
        return group


# ---- the group behind an argument, and the active_ranks mirrors ----

_mirrors = {}  # id(backend) -> [backend, the user's CUDA active_ranks tensor, epoch copied]; CPU: the worker
_masks = {}  # id(backend) -> (backend, the CPU tensor get_active_ranks returns, updated by the worker)


def _resolve(backend):
    """(ProcessGroup, EpBackend) for a ProcessGroup, an EpBackend or None (WORLD)."""
    if backend is None:
        backend = dist.distributed_c10d._get_default_group()
    if isinstance(backend, _C.EpBackend):
        try:
            return moelink._group_of(backend), backend
        except ValueError as e:
            raise InvalidArgument(f"moelink.compat.mooncake.pg: {e}") from None
    if isinstance(backend, dist.ProcessGroup):
        try:
            return backend, moelink.get_backend(backend)
        except ValueError as e:
            raise InvalidArgument(f"moelink.compat.mooncake.pg: {e} (create it with backend='ep')") from None
    raise TypeError(f"expected a ProcessGroup of backend 'ep' (e.g. dist.group.WORLD), got {type(backend).__name__}")


def _refresh(backend) -> None:
    """Copies the group's mask into the user's CUDA active_ranks tensor when the membership
    changed since the last copy (CPU mirrors the worker writes itself). Between changes the
    tensor is the user's and the EP kernels': a rank whose timeout_us expired stays 0 in it."""
    held = _mirrors.get(id(backend))
    if held is None or held[0] is not backend or held[2] == backend.epoch:
        return
    held[2] = backend.epoch
    target = held[1]
    mask = torch.tensor(backend.active_mask(), dtype=torch.int32, device="cpu")
    target[:mask.numel()].copy_(mask, non_blocking=True)
    if target.numel() > mask.numel():
        target[mask.numel():].zero_()


def _ranks(ranks: Iterable[int], size: int, what: str) -> List[int]:
    out = [int(r) for r in ranks]
    bad = [r for r in out if not 0 <= r < size]
    if bad:
        raise InvalidArgument(f"{what}: rank(s) {bad} are outside the group of size {size}")
    return out


# ---- local queries ----

def get_active_ranks(backend) -> torch.Tensor:
    """The group's active-rank mask: a CPU int32 [group size] tensor, the same one at every call,
    which the group keeps up to date."""
    _, ep = _resolve(backend)
    held = _masks.get(id(ep))
    if held is None or held[0] is not ep:
        held = _masks[id(ep)] = (ep, torch.zeros(ep.size(), dtype=torch.int32, device="cpu"))
        ep.mirror_mask(held[1])
    _refresh(ep)
    return held[1]


def get_num_synced_ranks(backend) -> int:
    _, ep = _resolve(backend)
    _refresh(ep)
    return int(ep.num_synced_ranks())


def get_peer_state(backend, ranks) -> List[bool]:
    """Per rank, as this rank sees it: active, or a replacement process waits to be readmitted
    and answers. Local (Mooncake's is too): survivors may poll it independently."""
    _, ep = _resolve(backend)
    _refresh(ep)
    return [bool(v) for v in ep.peer_state(_ranks(ranks, ep.size(), "get_peer_state"))]


def get_current_epoch(backend) -> int:
    _, ep = _resolve(backend)
    _refresh(ep)
    return int(ep.epoch)


# ---- membership changes ----

def recover_ranks(backend, ranks) -> ProposeViewUpdateResponse:
    """Collective over the active ranks: readmits the replacement processes of ``ranks``."""
    group, ep = _resolve(backend)
    ranks = _ranks(ranks, ep.size(), "recover_ranks")
    try:
        moelink.recover_ranks(ranks, group)
    except ValueError as e:  # the ranks agreed that one is not waiting: nothing changed anywhere
        _refresh(ep)
        return ProposeViewUpdateResponse(ProposalStatus.Rejected, ep.epoch, reject_reason=str(e))
    _refresh(ep)
    return ProposeViewUpdateResponse(ProposalStatus.Applied, ep.epoch)


activate_ranks = recover_ranks


def extend_group_size_to(backend, size: int) -> None:
    """Collective over the active ranks: readmits every inactive rank below ``size`` once each
    has a process waiting (moelink.extend_group_size_to)."""
    group, ep = _resolve(backend)
    moelink.extend_group_size_to(int(size), group)
    _refresh(ep)


def deactivate_ranks(backend, ranks) -> ProposeViewUpdateResponse:
    """``[own rank]``: this rank leaves (its backend shuts down; destroy the group next). Ranks
    that failed: masked out by agreement, a collective over the active ranks that call it. A
    live rank cannot be evicted: ``Rejected``."""
    group, ep = _resolve(backend)
    ranks = _ranks(ranks, ep.size(), "deactivate_ranks")
    me = ep.rank()
    if me in ranks:
        if len(set(ranks)) > 1:
            return ProposeViewUpdateResponse(ProposalStatus.Rejected, ep.epoch,
                                             reject_reason="a rank can deactivate itself alone, or other ranks")
        epoch = ep.epoch
        _refresh(ep)
        ep.shutdown()  # its peers find it gone at their next op and agree on a mask without it
        return ProposeViewUpdateResponse(ProposalStatus.Applied, epoch)
    held = moelink._still_held(ranks, group)  # a failed rank in the mask is agreed out on the way
    _refresh(ep)
    alive = sorted({r for r, h in zip(ranks, held) if h})
    if alive:
        return ProposeViewUpdateResponse(
            ProposalStatus.Rejected, ep.epoch,
            reject_reason=f"rank(s) {alive} are alive and active: moelink masks a rank out when it has failed "
                          "(agreed by the survivors), never a live one")
    return ProposeViewUpdateResponse(ProposalStatus.Applied, ep.epoch)


def join_group(backend) -> None:
    """The replacement's side of readmission. moelink readmitted this process inside
    init_process_group (with is_extension=True); this checks that it is active."""
    _, ep = _resolve(backend)
    _refresh(ep)
    if not ep.active_mask()[ep.rank()]:
        raise RuntimeError(f"moelink join_group: rank {ep.rank()} is not active in this group: the group masked "
                           "this process out, and moelink readmits a new process only (start one with "
                           "MooncakeBackendOptions(max_group_size, True) and have the active ranks call recover_ranks)")


def sync_after_failure(backend) -> SyncAfterFailureResponse:
    """Collective over the active ranks: a barrier, through which a failed rank is agreed out."""
    group, ep = _resolve(backend)
    epoch = ep.epoch
    try:
        dist.barrier(group=group)
    except RuntimeError as e:
        _refresh(ep)
        return SyncAfterFailureResponse(SyncAfterFailureStatus.Rejected, str(e))
    _refresh(ep)
    return SyncAfterFailureResponse(SyncAfterFailureStatus.Reconciled if ep.epoch != epoch
                                    else SyncAfterFailureStatus.NoPending)


# ---- per-op results ----

def _settled(work) -> Optional[list]:
    """The ranks `work` lost once it completed (None: not a work of backend 'ep')."""
    if _C.failed_ranks(work) is None:
        return None
    try:
        work.get_future().wait()
    except Exception:  # noqa: BLE001  a failed op: its lost ranks are still recorded
        pass
    return list(_C.failed_ranks(work))


def get_failed_ranks_hint(work) -> Optional[torch.Tensor]:
    """int32 [group size]: 1 for each rank the op of ``work`` lost (None for another backend's work)."""
    lost = _settled(work)
    if lost is None:
        return None
    hint = torch.zeros(int(_C.work_group_size(work)), dtype=torch.int32, device="cpu")
    for r in lost:
        hint[r] = 1
    return hint


def get_local_success(work) -> bool:
    """True iff this rank's part of the op succeeded with every peer it involved."""
    lost = _settled(work)
    if lost is None:
        return False
    try:
        failed = work.exception() is not None
    except Exception:  # noqa: BLE001
        failed = True
    return not failed and not lost


# ---- process-wide settings ----

def set_host_ip(host: str) -> None:
    """The address this process's tcp transport announces (MOELINK_HOST_IP), for groups created afterwards."""
    os.environ["MOELINK_HOST_IP"] = str(host)


def set_collective_timeout_us(us: int) -> None:
    """How long a silent peer is probed before it counts as failed (MOELINK_FAILURE_PROBE_MS),
    for groups created afterwards. An op's own deadline is the group's timeout."""
    us = int(us)
    if us <= 0:
        raise InvalidArgument(f"set_collective_timeout_us: a positive number of microseconds, got {us}")
    os.environ["MOELINK_FAILURE_PROBE_MS"] = str(max(1, (us + 999) // 1000))


def set_p2p_timeout_us(us: int) -> None:
    raise RuntimeError("moelink has no separate P2P timeout: send/recv use the group's timeout "
                       "(init_process_group(timeout=...)) and failure detection (set_collective_timeout_us)")


def set_fault_reconciliation_window_us(us: int) -> None:
    raise RuntimeError("moelink has no fault reconciliation window: the survivors agree on a failed rank inside the "
                       "op that finds it (no coordinator that waits for reports)")


def set_device_filter(filters) -> None:
    """The RDMA device the EP buffer's IBGDA uses (MOELINK_IBGDA_DEVICE, the first of ``filters``
    present here). moelink's collectives do not use RDMA."""
    filters = [str(f) for f in filters]
    status = moelink.ibgda_status()
    present = [f for f in filters if f in status["devices"]]
    if not status["devices"]:
        raise RuntimeError(f"set_device_filter({filters}): this machine has no RDMA device "
                           f"({status['reason']}); moelink's collectives do not use RDMA")
    if not present:
        raise InvalidArgument(f"set_device_filter: none of {filters} is an RDMA device here "
                              f"(devices: {status['devices']})")
    os.environ["MOELINK_IBGDA_DEVICE"] = present[0]


def set_transfer_engine(engine) -> None:
    if engine is None:
        return  # the default: moelink's own transport
    raise RuntimeError("moelink does not run over Mooncake's TransferEngine: its collectives and EP buffer bring "
                       "their own transport (shm, tcp, NVLink, IBGDA)")

