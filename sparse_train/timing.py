"""Wall-clock marks for timing phases of a step, on the device that runs them.

One helper for every timer in the project (the module's attention profile, the Lightning
``StepTimer`` callback, the benchmarks under ``scripts/bench``):

* on a CUDA device a mark is a ``torch.cuda.Event`` recorded on the current stream. Recording does
  not wait for the device, so marking phases does not serialise the host with the GPU; the time
  between two marks is read once the later event has completed (``elapsed_ms`` waits for it).
* elsewhere a mark is ``time.perf_counter()``: CPU kernels run synchronously, so the host clock is
  the device clock.
"""

from __future__ import annotations

import time
from collections.abc import Hashable

import torch

__all__ = ["Stamp", "stamp", "stage_events", "elapsed_ms", "Marks", "PhaseTimer"]

Stamp = float | torch.cuda.Event


def stamp(device: torch.device | str) -> Stamp:
    """The current time on ``device``: a recorded CUDA event, or ``perf_counter`` seconds."""
    if torch.device(device).type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def stage_events(count: int) -> list[torch.cuda.Event]:
    """``count`` CUDA events not yet recorded, for code that records its own stage boundaries (the backward
    launcher's ``stage_events``); read the time between two of them with :func:`elapsed_ms`."""
    return [torch.cuda.Event(enable_timing=True) for _ in range(count)]


def elapsed_ms(start: Stamp, stop: Stamp) -> float:
    """Milliseconds from ``start`` to ``stop`` (two stamps of the same kind). For CUDA events this
    waits until ``stop`` has completed on the device."""
    if isinstance(start, float):
        return (stop - start) * 1e3
    stop.synchronize()
    return float(start.elapsed_time(stop))


class Marks:
    """Named stamps on one device: ``mark(name)``, then ``ms(a, b)`` between two of them.

    Args:
        device: Where the timed work runs (CUDA events there, ``perf_counter`` elsewhere).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.stamps: dict[Hashable, Stamp] = {}

    def mark(self, name: Hashable) -> None:
        """Record (or re-record) the mark ``name`` now."""
        self.stamps[name] = stamp(self.device)

    def ms(self, start: Hashable, stop: Hashable) -> float | None:
        """Milliseconds from mark ``start`` to mark ``stop``; None when either was not recorded."""
        if start not in self.stamps or stop not in self.stamps:
            return None
        return elapsed_ms(self.stamps[start], self.stamps[stop])


class PhaseTimer:
    """Start and stop marks per named phase, each on the device of its own call (the attention
    module's profile: one module may see CPU and CUDA inputs), read together and lazily."""

    def __init__(self) -> None:
        self.marks: dict[str, list[Stamp | None]] = {}

    def mark(self, name: str, which: int, device: torch.device | str) -> None:
        """Record the start (``which=0``) or the stop (``which=1``) of phase ``name``."""
        self.marks.setdefault(name, [None, None])[which] = stamp(device)

    def elapsed_ms(self) -> dict[str, float]:
        """``{"time/<phase>_ms": ms}`` for every phase with both marks (waits for CUDA stops)."""
        return {
            f"time/{name}_ms": elapsed_ms(start, stop)
            for name, (start, stop) in self.marks.items()
            if start is not None and stop is not None
        }
