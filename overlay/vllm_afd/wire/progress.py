"""Device progress (docs/connection.md#liveness): an event recorded on the device's stream per step, polled
by the watchdog, so a device-side wait that never ends (an NCCL receive, a CUDA IPC flag, a replayed graph)
is a step timeout within ``step_timeout_s``, as torch's NCCL watchdog does for collectives.

A connector call only enqueues device work, so the host-side step clock cannot see such a wait.  The
connector records an event when a step opens (it completes once everything enqueued before it, the previous
step or graph replay, has run) and when an eager step's last exchange is enqueued (the step's own device
work).  The watchdog thread polls the oldest pending event (``query()`` never blocks) and reports it once
it is older than the bound; before its first poll it leaves the global capture mode (``prepare_thread``),
since a poll while another thread captures a graph would otherwise invalidate that capture.  A replayed
graph is covered by the next step's event only: a host that blocks in a sync on a hung replay opens no next
step (docs/failures.md#21-device-side-waits-and-the-step-timeout).
On CPU there is nothing to wait for: ``NULL_PROGRESS``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["NULL_PROGRESS", "DeviceProgress", "NullProgress", "make_progress"]

logger = logging.getLogger(__name__)

# Events pending at most; while this many are, a step records none (the oldest already bounds the wait).
MAX_PENDING = 8


class Event(Protocol):
    """What a device event offers (``torch.cuda.Event``)."""

    def record(self) -> None: ...

    def query(self) -> bool: ...


class NullProgress:
    """No device to watch (CPU, or before pairing): nothing is recorded, nothing is overdue."""

    def record(self, step_seq: int | None) -> None:
        pass

    def overdue(self, now: float, bound_s: float) -> tuple[int | None, float] | None:
        return None


NULL_PROGRESS = NullProgress()


class DeviceProgress:
    """Events recorded per step (main thread), polled by the watchdog thread; see the module docstring.

    The two threads share two deques (append and popleft are atomic): ``_pending`` holds (event, step, when
    recorded) oldest first, ``_free`` the events that completed, reused by later steps.
    """

    def __init__(self, new_event: Callable[[], Event], *, capturing: Callable[[], bool] = lambda: False,
                 prepare_thread: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.monotonic,
                 max_pending: int = MAX_PENDING) -> None:
        self._new_event = new_event
        # Called once on each thread that polls, before its first query.
        self._prepare_thread = prepare_thread
        self._prepared = threading.local()
        # True while the current stream captures a graph: an event recorded then would be a graph node.
        self._capturing = capturing
        self._clock = clock
        self._max_pending = max_pending
        self._pending: collections.deque[tuple[Event, int | None, float]] = collections.deque()
        self._free: collections.deque[Event] = collections.deque()

    def record(self, step_seq: int | None) -> None:
        """Step ``step_seq`` opens: mark the stream here (skipped while capturing or while ``max_pending`` wait)."""
        if len(self._pending) >= self._max_pending or self._capturing():
            return
        event = self._free.popleft() if self._free else self._new_event()
        event.record()
        self._pending.append((event, step_seq, self._clock()))

    def overdue(self, now: float, bound_s: float) -> tuple[int | None, float] | None:
        """(step, seconds pending) of the oldest event still pending after ``bound_s``, else None; completed
        events are released on the way."""
        if not getattr(self._prepared, "done", False):
            self._prepared.done = True
            try:
                self._prepare_thread()
            except Exception as exc:  # noqa: BLE001 - polls still time device waits; a capture beside one is at risk
                logger.warning("AFD watchdog: could not leave the global CUDA graph capture mode on its polling thread "
                               "(%s); a poll during a graph capture may invalidate it (docs/failures.md#25)", exc)
        while self._pending:
            event, step_seq, recorded_at = self._pending[0]
            if not event.query():
                pending_s = now - recorded_at
                return (step_seq, pending_s) if pending_s > bound_s else None
            self._pending.popleft()
            self._free.append(event)
        return None


def make_progress(device: Any) -> DeviceProgress | NullProgress:
    """``DeviceProgress`` over ``torch.cuda.Event`` on a CUDA device, else ``NULL_PROGRESS``."""
    import torch

    from vllm_afd.wire.transports.cuda_driver import CudaDriver

    if torch.device(device).type != "cuda":
        return NULL_PROGRESS
    return DeviceProgress(lambda: torch.cuda.Event(enable_timing=False),
                          capturing=torch.cuda.is_current_stream_capturing,
                          prepare_thread=CudaDriver(torch.device(device)).relax_capture_mode)
