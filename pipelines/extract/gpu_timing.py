"""What the GPU did, from CUDA events: its time in a unit's forwards, between them, and when.

The host queues work ~0.5 s ahead of the GPU, so host timers cannot tell a slow forward from an
idle GPU; events recorded on the compute stream can. Nothing is recorded on a CPU.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GpuClock:
    """An event the GPU ran at a known wall-clock time: later events' times follow from it."""

    event: torch.cuda.Event
    at: float

    @classmethod
    def start(cls, device: torch.device) -> GpuClock:
        """On an idle device (just synchronised): the event runs as soon as it is recorded."""
        event = torch.cuda.Event(enable_timing=True)
        before = time.time()
        event.record(torch.cuda.current_stream(device))
        event.synchronize()
        return cls(event, (before + time.time()) / 2)

    def wall(self, event: torch.cuda.Event) -> float:
        return self.at + self.event.elapsed_time(event) / 1e3


class GpuTimeline:
    """CUDA events around a unit's forwards (nothing on a CPU): how long the GPU spent in them and
    between them (benchmarks time their bare forwards with it too). Read only once the unit's
    copies are done (its events are then complete), so reading never stalls the forwards."""

    def __init__(self, device: torch.device | None):
        self.device = device
        self.enabled = device is not None and device.type == "cuda"
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream = torch.cuda.current_stream(self.device)  # the forward's (the model's device)
        start.record(stream)
        yield
        end.record(stream)
        self.events.append((start, end))

    @property
    def last_end(self) -> torch.cuda.Event | None:
        return self.events[-1][1] if self.events else None

    def seconds(self, previous_end: torch.cuda.Event | None) -> tuple[float, float]:
        """(in the forwards, between them): the gap before the first counts from ``previous_end``,
        the previous unit's last forward (none for a worker's first unit)."""
        forward_ms = between_ms = 0.0
        if self.events:
            self.events[-1][1].synchronize()  # done already (the copies were); cheap insurance
        for start, end in self.events:
            if previous_end is not None:
                between_ms += previous_end.elapsed_time(start)
            forward_ms += start.elapsed_time(end)
            previous_end = end
        return forward_ms / 1e3, between_ms / 1e3

    def wall_span(self, clock: GpuClock | None) -> tuple[float, float]:
        """Wall clock of the first forward's start and the last one's end on the GPU."""
        if clock is None or not self.events:
            return 0.0, 0.0
        return clock.wall(self.events[0][0]), clock.wall(self.events[-1][1])
