"""Device progress on a real GPU (wire/progress.py, docs/connection.md#liveness): ``torch.cuda.Event`` marks a
stream that is still busy, the watchdog reports it as a step timeout, and nothing is recorded into a graph.

Marked ``gpu``; skipped where CUDA is absent (CI). ``torch.cuda._sleep`` spins the stream for a number of clock
cycles: the stand-in for a device-side wait that does not end (an NCCL receive, a CUDA IPC flag).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from vllm_afd.wire.errors import AFDStepTimeoutError
from vllm_afd.wire.failure import FailureLatch
from vllm_afd.wire.placement import Placement
from vllm_afd.wire.progress import DeviceProgress, make_progress
from vllm_afd.wire.transports.cuda_driver import CudaDriver
from vllm_afd.wire.watchdog import STARTUP_DONE_KEY, Watchdog, WatchdogSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SPIN_CYCLES = 4_000_000_000  # ~2 s at an H200's ~2 GHz


class Store:
    """The heartbeat's store: the peer beats on every read."""

    def __init__(self) -> None:
        self.values = {STARTUP_DONE_KEY: 1}

    def add(self, key: str, amount: int) -> int:
        self.values[key] = self.values.get(key, 0) + (max(amount, 1) if key.startswith("afd/heartbeat/") else amount)
        return self.values[key]


def test_an_event_behind_a_busy_stream_is_overdue_until_the_stream_gets_past_it():
    progress = make_progress(torch.device("cuda"))
    assert isinstance(progress, DeviceProgress)
    torch.cuda._sleep(SPIN_CYCLES)
    progress.record(7)
    recorded_at = time.monotonic()

    late = progress.overdue(now=recorded_at + 10.0, bound_s=5.0)
    torch.cuda.synchronize()
    done = progress.overdue(now=recorded_at + 10.0, bound_s=0.0)

    assert late is not None and late[0] == 7 and late[1] >= 10.0
    assert done is None


def test_the_watchdog_reports_a_device_wait_that_outlives_the_step_timeout():
    latch = FailureLatch(lambda: None, None)
    spec = WatchdogSpec(Placement("attention", 0, 1, 1, 1, 1), peer_timeout_s=60.0, step_timeout_s=0.5, address="h:1")
    watchdog = Watchdog(Store(), spec, latch, progress=make_progress(torch.device("cuda")))
    watchdog.start()
    deadline = time.monotonic() + 5.0
    while not watchdog.armed:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    torch.cuda._sleep(SPIN_CYCLES)
    watchdog._progress.record(3)  # the connector records when a step opens
    started = time.monotonic()
    while latch.failure is None and time.monotonic() - started < 5.0:
        time.sleep(0.01)
    elapsed = time.monotonic() - started
    watchdog.stop()
    torch.cuda.synchronize()

    assert isinstance(latch.failure, AFDStepTimeoutError), latch.failure
    assert str(latch.failure).startswith("AFD step 3: the device of attention rank 0 has not finished")
    assert 0.5 <= elapsed < 1.5, elapsed


def test_nothing_is_recorded_into_a_captured_graph():
    progress = make_progress(torch.device("cuda"))
    x = torch.zeros(8, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x.add_(1)  # warm-up on a side stream, as capture requires
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
        progress.record(1)
    graph.replay()
    torch.cuda.synchronize()

    assert progress.overdue(now=time.monotonic() + 1e6, bound_s=0.0) is None
    assert x[0].item() == 2.0


def _capture_while_polled(progress: DeviceProgress) -> tuple[torch.Tensor, int]:
    """Capture a long graph in global mode (torch's and vLLM's default) on a side stream while another thread polls
    an event recorded behind a spinning default stream, so still pending throughout; replay it; return the tensor
    and how many polls the poller finished while the capture ran.

    NOTE: ``capture_begin`` directly: ``torch.cuda.graph`` synchronizes the device first, which would complete the
    event and let the poller drop it before the capture starts."""
    x, stream = torch.zeros(8, device="cuda"), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x.add_(1)  # warm-up on the side stream, as capture requires
    torch.cuda.synchronize()
    x.zero_()
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN_CYCLES)  # ~2 s on the default stream: the event below stays pending through the capture
    progress.record(1)
    polls, stop = [0], threading.Event()

    def poll() -> None:
        while not stop.is_set():
            progress.overdue(time.monotonic(), bound_s=1e9)
            polls[0] += 1
            time.sleep(0)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    while polls[0] == 0:
        time.sleep(0.001)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="global")
            try:
                before = polls[0]
                for _ in range(10000):  # ~0.1 s: the poller's queries land inside the capture
                    x.add_(1)
                during = polls[0] - before
            finally:
                graph.capture_end()
    finally:
        stop.set()
        poller.join(5.0)
        torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        graph.replay()
    torch.cuda.synchronize()
    return x, during


def test_the_watchdogs_poll_from_its_own_thread_leaves_a_graph_capture_intact():
    """Regression (docs/failures.md#25): the FFN's capture failed with 'operation not permitted when stream is
    capturing' when the watchdog thread queried a pending step event in the middle of it."""
    x, polls_during_capture = _capture_while_polled(make_progress(torch.device("cuda")))

    assert polls_during_capture > 0  # the event was queried while the capture ran
    assert x[0].item() == 10000.0


def test_without_leaving_the_global_capture_mode_the_same_poll_invalidates_the_capture():
    """The CUDA fact the fix rests on: if this passes no more, the thread's capture mode is no longer needed."""
    progress = DeviceProgress(lambda: torch.cuda.Event(enable_timing=False),
                              capturing=torch.cuda.is_current_stream_capturing)

    with pytest.raises(RuntimeError, match="captur"):
        _capture_while_polled(progress)
    CudaDriver(torch.device("cuda")).synchronize()  # the device still works
