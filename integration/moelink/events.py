"""The event an ``async_finish`` call of the EP buffer returns (DeepEP's EventOverlap)."""

from __future__ import annotations

from typing import Optional

import torch


class EventOverlap:
    """The CUDA event of an ``async_finish`` call (``None`` otherwise)."""

    def __init__(self, event: Optional[torch.cuda.Event] = None):
        self.event = event

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


def event(async_finish: bool) -> EventOverlap:
    """An event recorded on the current stream now when ``async_finish``, else an empty one."""
    if not async_finish:
        return EventOverlap(None)
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream())
    return EventOverlap(ev)


def noop() -> None:
    return None
