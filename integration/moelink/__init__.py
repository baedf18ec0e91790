"""moelink: a c10d communication backend for MoE training and serving.

``import moelink`` registers the torch.distributed backend ``"ep"``::

    import torch.distributed as dist
    import moelink  # noqa: F401
    dist.init_process_group(backend="ep")

Settings: the ``MOELINK_*`` environment variables, read when a group (or an EP buffer) is
created; ``python3 -m moelink.settings`` lists them (the README's tables), and
``moelink.settings.value(name)`` gives one as the library reads it.

Elastic membership: see ``EpOptions``, ``get_active_ranks``, ``get_peer_state``,
``recover_ranks`` and ``failed_ranks`` (and the README's "Elastic membership").

CUDA tensors: see the README's "CUDA tensors"; ``get_backend(group).cuda_path()`` says which
route a group took, ``cuda_tuning(world)`` how its in-host kernels are tuned.
"""

from __future__ import annotations

import atexit

import torch
import torch.distributed as dist

__all__ = [
    "Buffer", "EventOverlap", "EpOptions", "get_backend", "transport_of", "reads_directly", "ibgda_status", "BACKEND_NAME",
    "get_active_ranks", "get_peer_state", "recover_ranks", "failed_ranks", "get_num_synced_ranks",
    "extend_group_size_to", "Config", "dispatch_with_grad", "combine_with_grad", "cuda_tuning",
    "cuda_sms",
]

BACKEND_NAME = "ep"


def _load_native():
    try:
        from . import _build_info
    except ImportError as e:  # pragma: no cover - only without a build
        raise ImportError(
            "moelink's native module is not built. Run `bash scripts/install.sh` "
            "(or `pip install --no-build-isolation .`) first."
        ) from e
    built = _build_info.TORCH_VERSION
    if built != torch.__version__:
        raise ImportError(
            f"moelink was built against torch {built}, but torch {torch.__version__} is "
            "installed. Rebuild it against this torch: `bash scripts/install.sh` (or "
            "`pip install --no-build-isolation --force-reinstall .`)."
        )
    from . import _C

    return _C


_C = _load_native()


class EpOptions:
    """Options of an ``"ep"`` group, passed as ``pg_options`` to ``init_process_group`` or
    ``new_group``.

    - ``on_peer_failure``: ``"continue"`` (default): when a peer dies, the survivors agree on a
      new active-rank mask and the op in flight completes over them; ``"raise"``: that op
      raises on every survivor instead (later ops run over the survivors either way).
    - ``is_extension``: this process replaces a failed rank, or takes a reserved one (same rank,
      same world size); its ``init_process_group`` returns once the active ranks have called
      ``recover_ranks`` (or ``extend_group_size_to``).
    - ``initial_world_size``: a group that will grow. ``world_size`` is the most ranks it can
      have (c10d fixes a group's size when it is created); ranks ``[0, initial_world_size)``
      create it and the others are reserved, inactive (zero-filled slots, as for a failed rank)
      until they join with ``is_extension=True`` and ``extend_group_size_to`` readmits them. The
      store must not wait for every rank (torchrun's, or ``TCPStore(wait_for_workers=False)``).
    """

    def __init__(self, is_extension: bool = False, on_peer_failure: str = "continue",
                 initial_world_size: int | None = None):
        if on_peer_failure not in ("continue", "raise"):
            raise ValueError(f"on_peer_failure must be 'continue' or 'raise', got {on_peer_failure!r}")
        if initial_world_size is not None and int(initial_world_size) < 1:
            raise ValueError(f"initial_world_size must be at least 1, got {initial_world_size}")
        self.is_extension = bool(is_extension)
        self.on_peer_failure = on_peer_failure
        self.initial_world_size = None if initial_world_size is None else int(initial_world_size)

    def __repr__(self):
        return (f"EpOptions(is_extension={self.is_extension}, on_peer_failure={self.on_peer_failure!r}, "
                f"initial_world_size={self.initial_world_size})")

    def _create(self, dist_opts):
        """The backend of one group: what the registered creator returns for these options
        (``dist_opts``: torch's _DistributedBackendOptions). A compatibility layer's options
        (moelink.compat) override it."""
        initial = self.initial_world_size or 0
        if initial > dist_opts.group_size:
            raise ValueError(f"EpOptions.initial_world_size ({initial}) exceeds the group size ({dist_opts.group_size})")
        if initial and not self.is_extension and dist_opts.group_rank >= initial:
            raise ValueError(f"rank {dist_opts.group_rank} is reserved (the group starts with ranks 0..{initial - 1}): "
                             "join with EpOptions(is_extension=True)")
        return _C.EpBackend(
            dist_opts.store, dist_opts.group_rank, dist_opts.group_size, dist_opts.timeout,
            raise_on_peer_failure=self.on_peer_failure == "raise",
            extension=self.is_extension,
            initial_size=initial,
        )


def _create_backend(dist_opts, backend_opts):
    if backend_opts is None:
        backend_opts = EpOptions()
    if not isinstance(backend_opts, EpOptions):
        raise TypeError(f"backend 'ep' takes pg_options=moelink.EpOptions(...), got {type(backend_opts).__name__}")
    return backend_opts._create(dist_opts)


def _register() -> None:
    if BACKEND_NAME.upper() in dist.Backend._plugins:  # already registered in this process
        return
    dist.Backend.register_backend(
        BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"]
    )


_register()

# At interpreter exit, before Python starts tearing itself down: stop every group's worker
# threads (as destroy_process_group would), so that none of them completes an op, and with it
# runs a Python callback or drops a Python object, once the interpreter is half gone. Groups
# are unusable after this; a script that destroys its groups itself is not affected.
atexit.register(_C._shutdown_all)


def get_backend(group=None) -> "_C.EpBackend":
    """The ``EpBackend`` object behind ``group`` (default: the WORLD group)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    # A group serves both devices through one backend object; a group that shrink_group made
    # is registered for one device only (CPU, or its bound device).
    for device in ("cpu", "cuda"):
        try:
            backend = pg._get_backend(torch.device(device))
        except RuntimeError:
            continue
        if isinstance(backend, _C.EpBackend):
            return backend
    raise ValueError(f"group {pg} does not use backend 'ep'")


_cuda_masks = {}


def get_active_ranks(group=None, device="cpu") -> torch.Tensor:
    """The group's active-rank mask: int32 [group size], 1 = active. ``device="cuda"`` gives a
    CUDA tensor (one per backend and device, refreshed by each call) for the EP buffer."""
    backend = get_backend(group)
    mask = torch.tensor(backend.active_mask(), dtype=torch.int32, device="cpu")
    device = torch.device(device)
    if device.type == "cpu":
        return mask
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (id(backend), device)
    cached = _cuda_masks.get(key)
    if cached is None or cached[0] is not backend:
        cached = (backend, torch.empty_like(mask, device=device))
        _cuda_masks[key] = cached
    cached[1].copy_(mask)
    return cached[1]


def get_peer_state(ranks, group=None) -> list:
    """Collective over the active ranks of ``group``: per rank in ``ranks``, True when every
    active rank sees it active with its process alive, or sees a replacement process of it
    waiting to be readmitted and alive."""
    ranks = [int(r) for r in ranks]
    local = torch.tensor(get_backend(group).peer_state(ranks), dtype=torch.int32, device="cpu")
    dist.all_reduce(local, op=dist.ReduceOp.MIN, group=group)
    return [bool(v) for v in local.tolist()]


def _still_held(ranks, group=None) -> list:
    """Collective over the active ranks: per rank in ``ranks``, whether the group's mask still
    holds it once a death no op had found yet is agreed out (one barrier, when some rank's mask
    holds a listed rank: it may have died unseen). Decided by all_reduce, so that every rank
    gets the same answer (masks change between ops, on their own where a tcp connection breaks)."""
    backend = get_backend(group)

    def held():
        mask = backend.active_mask()
        view = torch.tensor([mask[r] for r in ranks], dtype=torch.int32, device="cpu")
        dist.all_reduce(view, op=dist.ReduceOp.MAX, group=group)
        return [bool(v) for v in view.tolist()]

    view = held()
    if any(view):
        dist.barrier(group=group)
        view = held()
    return view


def recover_ranks(ranks, group=None) -> None:
    """Collective over the active ranks of ``group``: readmits ``ranks``, whose replacement
    processes joined with ``EpOptions(is_extension=True)``. Their first op is the next op the
    active ranks issue. Raises ValueError if one is not waiting (see get_peer_state)."""
    backend = get_backend(group)
    ranks = [int(r) for r in ranks]
    bad = [r for r in ranks if not 0 <= r < backend.size()]
    if bad:
        raise ValueError(f"moelink recover_ranks: rank(s) {bad} are outside the group of size {backend.size()}")
    view = _still_held(ranks, group)
    inactive = [r for r, h in zip(ranks, view) if not h]  # active (and alive) ones need nothing
    if not inactive:
        return
    missing = [r for r, ok in zip(inactive, get_peer_state(inactive, group)) if not ok]
    if missing:
        raise ValueError(f"moelink recover_ranks: rank(s) {missing} have no replacement process waiting that "
                         "every active rank can reach (start it with EpOptions(is_extension=True) and poll "
                         "get_peer_state first)")
    backend.recover_ranks(inactive)


def get_num_synced_ranks(group=None) -> int:
    """How many ranks of ``group`` are active or have a process waiting to be readmitted (as
    this rank sees them; not collective)."""
    return int(get_backend(group).num_synced_ranks())


def extend_group_size_to(new_size: int, group=None, timeout: float | None = None) -> None:
    """Collective over the active ranks of ``group``: readmits every inactive rank below
    ``new_size`` (reserved ranks of a group created with ``EpOptions(initial_world_size=...)``,
    or failed ones), waiting up to ``timeout`` seconds (default: the group's timeout) until
    each has a process waiting. ``new_size`` cannot exceed the size the group was created with."""
    backend = get_backend(group)
    if not 1 <= int(new_size) <= backend.size():
        raise ValueError(f"moelink extend_group_size_to: {new_size} is outside 1..{backend.size()} (a group's size is "
                         "fixed when it is created: create it with the largest world_size and "
                         "EpOptions(initial_world_size=...))")
    active = get_active_ranks(group).tolist()
    ranks = [r for r in range(int(new_size)) if not active[r]]
    if not ranks:
        return
    import time

    deadline = time.monotonic() + (timeout if timeout is not None else backend.timeout.total_seconds())
    while True:
        # One collective per round decides for every active rank: all joined, or someone's
        # deadline passed (so that no rank leaves the loop alone).
        local = backend.peer_state(ranks) + [0 if time.monotonic() > deadline else 1]
        state = torch.tensor(local, dtype=torch.int32, device="cpu")
        dist.all_reduce(state, op=dist.ReduceOp.MIN, group=group)
        if all(state[:-1].tolist()):
            break
        if not state[-1]:
            missing = [r for r, ok in zip(ranks, state[:-1].tolist()) if not ok]
            raise TimeoutError(f"moelink extend_group_size_to: rank(s) {missing} did not join in time")
        time.sleep(0.05)
    backend.recover_ranks(ranks)


def failed_ranks(work) -> list:
    """The ranks that left the group while the op of ``work`` (from ``async_op=True``) ran."""
    lost = _C.failed_ranks(work)
    if lost is None:
        raise TypeError("failed_ranks takes a Work of a backend 'ep' op")
    return list(lost)


def transport_of(rank: int, group=None) -> str:
    """How this process reaches ``rank`` of ``group``: 'shm', 'tcp' or 'local'."""
    return get_backend(group).transport_of(rank)


def reads_directly(rank: int, group=None) -> bool:
    """Whether ``rank`` of ``group`` reads this process's large collective payloads straight from
    its memory (one copy, same host; ``MOELINK_SHM_PULL=0`` turns it off) rather than out of
    shared-memory slots (two copies). False for ranks on other hosts and for this rank itself."""
    return get_backend(group).reads_directly(rank)


def ibgda_status() -> dict:
    """What this machine offers for IBGDA (GPU-initiated RDMA on mlx5 NICs), probed at run time:
    ``{"usable": bool, "reason": str, "verbs_library": bool, "devices": [...], "mlx5_devices": [...],
    "gpudirect": bool, "plugin": bool}``. ``usable``: an mlx5 device is there and the IBGDA plugin
    (moelink_ibgda.so, built where rdma-core's headers were found) loads, so the EP buffer will try
    IBGDA for peers on other hosts (whether GPU memory registers shows only then); otherwise they
    take the CPU proxy and ``reason`` names what is missing first (no rdma-core, no RDMA device, no
    mlx5 device, or the plugin)."""
    return dict(_C.ibgda_status())


def cuda_tuning(world: int) -> dict:
    """How the in-host CUDA collectives of a group of ``world`` ranks are tuned: the
    ``MOELINK_CUDA_*`` settings where set, else the defaults of the group size's row (docs/PERF.md,
    "Defaults by group size"): ``{"lamport_bytes", "lamport_two_shot_bytes", "one_shot_bytes",
    "blocks", "round_bytes", "split", "lamport_narrow_bytes", "lamport_threads",
    "defaults_measured_on"}``. ``one_shot_bytes`` None: allreduce and broadcast are one exchange at
    every size; above ``one_shot_bytes`` a broadcast over more than 2 ranks is forwarded (the root
    sends each rank its block, which that rank passes on to the others as it lands, in one
    launch), and an all_reduce that the two-shot Lamport kernel does not take is a reduce-scatter
    and an all-gather in one launch (each rank's reduced pieces go on to the peers as they are
    reduced);
    ``defaults_measured_on`` None: no machine of this size has measured the row (groups of 5-8
    ranks so far). Raises ValueError for a setting that does not fit
    or a size outside 1-8."""
    return dict(_C.cuda_tuning(world))


def cuda_sms(op: str, world: int, nbytes: int) -> int:
    """The most SMs one rank's kernel holds for a collective on the in-host CUDA path (route
    ``nvlink``) in a group of ``world`` ranks tuned as ``cuda_tuning(world)``: ``op`` one of
    all_reduce, all_gather, reduce_scatter, all_to_all and broadcast, ``nbytes`` its largest tensor
    (all_gather's output, reduce_scatter's and all_to_all's input, the buffer of all_reduce and
    broadcast), reductions of float32 and even all_to_all pairs. The kernel holds them for the
    op's duration; NCCL's equivalent is its channel count."""
    return int(_C.cuda_sms(op, world, nbytes))


from .buffer import Buffer  # noqa: E402
from .events import EventOverlap  # noqa: E402
from .normal import Config, combine_with_grad, dispatch_with_grad  # noqa: E402


def _group_of(backend: "_C.EpBackend"):
    """The live process group served by ``backend`` (ValueError if none: destroyed)."""
    for pg in list(dist.distributed_c10d._world.pg_map):
        try:
            if get_backend(pg) is backend:
                return pg
        except (ValueError, RuntimeError):
            continue
    raise ValueError("this backend belongs to no live process group (destroyed?)")


def _ep_buffer(self, num_max_dispatch_tokens_per_rank=128, hidden=7168, num_experts=256):
    """The EP buffer of this backend's group (a collective call, as moelink.Buffer)."""
    return Buffer(_group_of(self), num_max_dispatch_tokens_per_rank, hidden, num_experts)


_C.EpBackend.ep_buffer = _ep_buffer
