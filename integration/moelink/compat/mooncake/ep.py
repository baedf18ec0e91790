"""``mooncake.ep`` served by moelink: ``get_ep_buffer_size_hint``. Mooncake's native runtime
classes behind it (its ``Buffer`` runtime, ``EventHandle``) are internal to Mooncake's buffer:
use ``moelink.compat.mooncake.mooncake_ep_buffer.Buffer``."""

from __future__ import annotations

from .mooncake_ep_buffer import Buffer

__all__ = ["get_ep_buffer_size_hint"]


def get_ep_buffer_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                            num_experts: int) -> int:
    return Buffer.get_ep_buffer_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)


def __getattr__(name: str):
    raise AttributeError(f"moelink.compat.mooncake.ep has no {name!r}: Mooncake's native EP runtime is internal to its "
                         "Buffer; use moelink.compat.mooncake.mooncake_ep_buffer.Buffer")
