"""moelink: a c10d communication backend for MoE training and serving.

``import moelink`` registers the torch.distributed backend ``"ep"``::

    import torch.distributed as dist
    import moelink  # noqa: F401
    dist.init_process_group(backend="ep")

Environment variables (read when a group is created):

- ``MOELINK_TRANSPORT``: ``auto`` (default: shared memory between ranks on one host,
  tcp otherwise), ``tcp`` or ``shm``.
- ``MOELINK_HOST_IP``: the address peers use to reach this rank over tcp (default: the
  first non-loopback IPv4 address).
- ``MOELINK_HOST_ID``: overrides the same-host test (default: hostname + boot id).
- ``MOELINK_CHUNK_BYTES`` (default 524288): mailbox slot size; large ops are pipelined
  through slots of this size.
- ``MOELINK_MAILBOX_DEPTH`` (default 4): slots per peer pair.
- ``MOELINK_CHAIN_BROADCAST_BYTES`` (default 1 MiB in groups that use tcp, else off): above,
  broadcast is a pipelined chain from the root.
- ``MOELINK_ALLREDUCE_SMALL_BYTES`` (default 65536): at or below, allreduce sends every
  rank's data to every rank (one round); above, reduce-scatter + allgather.
- ``MOELINK_WORKER_SPIN`` (default 256, or 0 when the host has fewer cores than local
  ranks): busy-wait iterations before the worker sleeps on its doorbell.

CUDA tensors (read at a group's first CUDA op; see the README's "CUDA tensors"):

- ``MOELINK_CUDA_BLOCKS`` (default 64), ``MOELINK_CUDA_ROUND_BYTES`` (default 8 MiB),
  ``MOELINK_CUDA_ONESHOT_BYTES`` (default 1 MiB): the in-host exchange kernel's shape; the same
  on every rank.
- ``MOELINK_RANKS_PER_HOST``: virtual hosts of this many ranks; a group they split takes the
  host-staged route. ``get_backend(group).cuda_path()`` says which route a group took.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Buffer", "EventOverlap", "get_backend", "transport_of", "ibgda_status", "BACKEND_NAME"]

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


def _create_backend(dist_opts, backend_opts):
    return _C.EpBackend(
        dist_opts.store, dist_opts.group_rank, dist_opts.group_size, dist_opts.timeout
    )


def _register() -> None:
    if BACKEND_NAME.upper() in dist.Backend._plugins:  # already registered in this process
        return
    dist.Backend.register_backend(
        BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"]
    )


_register()


def get_backend(group=None) -> "_C.EpBackend":
    """The ``EpBackend`` object behind ``group`` (default: the WORLD group)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    backend = pg._get_backend(torch.device("cpu"))
    if not isinstance(backend, _C.EpBackend):
        raise ValueError(f"group {pg} does not use backend 'ep' for CPU tensors")
    return backend


def transport_of(rank: int, group=None) -> str:
    """How this process reaches ``rank`` of ``group``: 'shm', 'tcp' or 'local'."""
    return get_backend(group).transport_of(rank)


def ibgda_status() -> dict:
    """What this machine offers for IBGDA (GPU-initiated RDMA on mlx5 NICs), probed at run time:
    ``{"usable": bool, "reason": str, "verbs_library": bool, "devices": [...], "mlx5_devices": [...],
    "gpudirect": bool, "plugin": bool}``. ``usable``: an mlx5 device is there and the IBGDA plugin
    (moelink_ibgda.so, built where rdma-core's headers were found) loads, so the EP buffer will try
    IBGDA for peers on other hosts (whether GPU memory registers shows only then); otherwise they
    take the CPU proxy and ``reason`` names what is missing first (no rdma-core, no RDMA device, no
    mlx5 device, or the plugin)."""
    return dict(_C.ibgda_status())


from .buffer import Buffer, EventOverlap  # noqa: E402


def _ep_buffer(self, num_max_dispatch_tokens_per_rank=128, hidden=7168, num_experts=256):
    """The EP buffer of this backend's group (a collective call, as moelink.Buffer)."""
    for pg in dist.distributed_c10d._world.pg_map:
        try:
            if pg._get_backend(torch.device("cpu")) is self:
                return Buffer(pg, num_max_dispatch_tokens_per_rank, hidden, num_experts)
        except RuntimeError:
            continue
    raise ValueError("this backend belongs to no live process group")


_C.EpBackend.ep_buffer = _ep_buffer
