"""The clocks a timeline stamps (timeline.py): the host's, and a GPU's own global timer.

Host clock: ``time.perf_counter_ns`` (CLOCK_MONOTONIC, shared by the processes of one host), stamped
when the host reaches the mark. Right where every transfer blocks the host (gloo, the CPU path);
on a GPU it would time the enqueueing, not the work.

Device clock: one tiny kernel per mark that stores the GPU's ``%globaltimer`` (ns, one clock for
every process on the GPU) into a slot of a device buffer, on the caller's current stream: it runs
when the stream gets there, costs one launch (~2 us eager, less in a graph), takes no host
synchronisation, and is recorded into CUDA graphs like any kernel, so a replayed step stamps the
same slots again. ``seal`` copies a step's slots to pinned host memory behind that step's work on
the same stream and records an event; ``read`` answers once the event passed (never waits).
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["DeviceClock", "HostClock"]

# Pinned host buffers kept for reuse by the device clock (steps whose stamps are still in flight).
MAX_FREE_HOST_BUFFERS = 8


class HostClock:
    """Stamps ``time.perf_counter_ns()`` into the current step's slots."""

    name = "host"

    def __init__(self, capacity: int) -> None:
        self._slots = [0] * capacity

    def stamp(self, slot: int) -> None:
        self._slots[slot] = time.perf_counter_ns()

    def seal(self, num_slots: int) -> list[int]:
        return self._slots[:num_slots]

    def read(self, ticket: list[int]) -> list[int]:
        return ticket


class DeviceClock:
    """Stamps the GPU's global timer into a device buffer; see the module docstring."""

    name = "device"

    def __init__(self, capacity: int, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(
                f"AFD timeline: the device clock stamps a CUDA GPU's global timer; got device {device}. "
                "Use the host clock on CPU"
            )
        self.capacity = capacity
        self.device = device
        self._slots = torch.zeros(capacity, dtype=torch.int64, device=device)
        self._free: list[torch.Tensor] = []
        self._kernel = _stamp_kernel()

    def stamp(self, slot: int) -> None:
        if not 0 <= slot < self.capacity:
            raise IndexError(f"AFD timeline: slot {slot} outside the clock's {self.capacity} slots")
        self._kernel[(1,)](self._slots, slot)

    def seal(self, num_slots: int) -> tuple[torch.cuda.Event, torch.Tensor, int] | None:
        if torch.cuda.is_current_stream_capturing():
            return None  # nothing executed; the step's record would be garbage
        host = self._free.pop() if self._free else torch.empty(self.capacity, dtype=torch.int64, pin_memory=True)
        host[:num_slots].copy_(self._slots[:num_slots], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        # NOTE: the whole buffer travels with its length: a view made in inference mode has no `_base`
        # to pool it back by, and steps differ in length (a split step stamps more slots than a whole one).
        return event, host, num_slots

    def read(self, ticket: tuple[torch.cuda.Event, torch.Tensor, int] | None) -> list[int] | None:
        if ticket is None:
            return []
        event, host, num_slots = ticket
        if not event.query():
            return None
        stamps = host[:num_slots].tolist()
        if len(self._free) < MAX_FREE_HOST_BUFFERS:
            self._free.append(host)
        return stamps


def _stamp_kernel() -> Any:
    """``slots[slot] = %globaltimer`` as a one-thread Triton kernel (compiled on first use)."""
    import triton
    import triton.language as tl

    @triton.jit
    def stamp_globaltimer(slots_ptr, slot):
        now = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(slots_ptr + slot, now)

    return stamp_globaltimer
