"""The event an ``async_finish`` call of the EP buffer returns (DeepEP's EventOverlap)."""

from __future__ import annotations

from typing import Optional

import torch


class EventOverlap:
    """The CUDA event of an ``async_finish`` call (``None`` otherwise). ``with event: ...`` runs
    the block and then makes the current stream wait for the event (DeepEP's overlap idiom);
    ``extra_tensors`` are kept alive as long as the object (DeepEP's and Mooncake's argument)."""

    def __init__(self, event: Optional[torch.cuda.Event] = None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        self.current_stream_wait()


def event(async_finish: bool) -> EventOverlap:
    """An event recorded on the current stream now when ``async_finish``, else an empty one."""
    if not async_finish:
        return EventOverlap(None)
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream())
    return EventOverlap(ev)


def noop() -> None:
    return None
