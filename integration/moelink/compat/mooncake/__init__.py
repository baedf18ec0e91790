"""Mooncake's Python API (``mooncake.pg``, ``mooncake.mooncake_ep_buffer``, ``mooncake.ep``)
served by moelink. Migration::

    from mooncake import pg                                  ->  from moelink.compat.mooncake import pg
    from mooncake.mooncake_ep_buffer import Buffer           ->  from moelink.compat.mooncake.mooncake_ep_buffer import Buffer
    dist.init_process_group("mooncake" | "mooncake-cpu")     ->  dist.init_process_group("ep")

Names, arguments, defaults and return types are Mooncake's (its wheel 0.3.14 and its HEAD agree
on them). Where moelink's semantics differ (a group that is as large as it can grow from the
start, agreed masks, admission at ``init_process_group``), the README's "Coming from Mooncake"
table says how. What moelink does not serve (Mooncake's KV-cache store, its transfer engine,
non-NVIDIA GPUs) raises ImportError or RuntimeError naming the reason.
"""

from __future__ import annotations

import importlib

_NOT_SERVED = {
    "store": "Mooncake's KV-cache store (mooncake.store, MooncakeDistributedStore) is a storage service, not a "
             "communication library: moelink does not provide it; keep Mooncake's wheel for it",
    "engine": "Mooncake's TransferEngine (mooncake.engine) is not part of moelink: moelink's collectives and EP "
              "buffer bring their own transport (shm, tcp, NVLink, IBGDA)",
    "mooncake_elastic_buffer": "use moelink.compat.mooncake.mooncake_ep_buffer.Buffer.create_elastic",
}

__all__ = ["pg", "mooncake_ep_buffer", "ep"]


def __getattr__(name: str):
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _NOT_SERVED:
        raise ImportError(f"moelink.compat.mooncake.{name}: {_NOT_SERVED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
