"""Every wait of the control plane is bounded (docs/connection.md#liveness): a store call to a stopped host,
a stalled watchdog thread, device work that never finishes, a stuck start-up, a failure callback that hangs.

The stopped host is real: a TCPStore served by a child process that the test SIGSTOPs (torch's client ignores
its own timeout then). The device is a recording fake with the ``torch.cuda.Event`` surface.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch.distributed import TCPStore

from vllm_afd.wire.errors import AFDPeerLostError, AFDStepTimeoutError, AFDWatchdogStalledError
from vllm_afd.wire.failure import NOTIFY_JOIN_S, FailureLatch
from vllm_afd.wire.placement import Placement
from vllm_afd.wire.refusal import leave_refused_store
from vllm_afd.wire.progress import NULL_PROGRESS, DeviceProgress, make_progress
from vllm_afd.wire.rendezvous import Rendezvous, RendezvousSpec
from vllm_afd.wire.store import call_within, rank_key
from vllm_afd.wire.watchdog import STARTUP_DONE_KEY, Watchdog, WatchdogSpec

from tests.connectors._harness import QueueTransport, make_connector, make_placement, make_spec, new_wire
from tests.wire.test_rendezvous import free_port


def place(role: str, rank: int = 0) -> Placement:
    return Placement(role, rank, 1, 1, 1, 1)


def wait_for(predicate, timeout_s: float) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, "condition not reached in time"
        time.sleep(0.01)
    return time.monotonic() - started


class MemoryStore:
    """The store surface the heartbeat uses, in memory; its peers' counters move while ``beating``."""

    def __init__(self, startup_done: int = 0) -> None:
        self.values: dict[str, int] = {STARTUP_DONE_KEY: startup_done}
        self.beating = True

    def add(self, key: str, amount: int) -> int:
        if key.startswith("afd/heartbeat/") and self.beating:
            amount = max(amount, 1)  # every peer beats each time it is read
        self.values[key] = self.values.get(key, 0) + amount
        return self.values[key]


class FakeEvent:
    """``torch.cuda.Event``'s surface: done once the fake device got past it."""

    def __init__(self, device: FakeDevice) -> None:
        self.device, self.position = device, None

    def record(self) -> None:
        self.device.recorded += 1
        self.position = self.device.recorded

    def query(self) -> bool:
        return self.position is not None and self.position <= self.device.finished


class FakeDevice:
    def __init__(self) -> None:
        self.recorded = self.finished = 0
        self.created = 0
        self.capturing = False

    def new_event(self) -> FakeEvent:
        self.created += 1
        return FakeEvent(self)


# ---- store calls under a deadline ----------------------------------------------------------------


def test_call_within_returns_raises_or_expires_on_time():
    assert call_within(lambda: 7, 1.0, lambda: AssertionError("expired")) == 7
    with pytest.raises(KeyError):
        call_within(lambda: {}["x"], 1.0, lambda: AssertionError("expired"))
    release = threading.Event()
    started = time.monotonic()
    with pytest.raises(AFDPeerLostError, match="stopped"):
        call_within(release.wait, 0.3, lambda: AFDPeerLostError("stopped"))
    release.set()
    assert 0.3 <= time.monotonic() - started < 1.5


@pytest.fixture
def stopped_store_host():
    """(port, stop, cont): a TCPStore hosted by a child process, and its SIGSTOP / SIGCONT."""
    port = free_port()
    child = subprocess.Popen([sys.executable, "-c", (
        "import datetime, sys, time\nfrom torch.distributed import TCPStore\n"
        f"s = TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False, use_libuv=False, "
        "timeout=datetime.timedelta(seconds=60))\nprint('up', flush=True)\ntime.sleep(120)\n")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        yield port, lambda: os.kill(child.pid, signal.SIGSTOP), lambda: os.kill(child.pid, signal.SIGCONT)
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait()


def test_a_stopped_store_host_ends_the_rendezvous_wait_within_the_call_bound(stopped_store_host):
    """Regression: the rendezvous's store calls took torch's client timeout on trust, which a stopped host
    never honours: an attention re-forming against a SIGSTOPped FFN waited until SIGCONT."""
    port, stop, cont = stopped_store_host
    spec = RendezvousSpec(place("attention"), "127.0.0.1", port, timeout_s=60.0, call_timeout_s=0.5)
    rendezvous = Rendezvous(spec)
    rendezvous.connect()
    assert rendezvous.claim()
    stop()
    started = time.monotonic()
    with pytest.raises(AFDPeerLostError) as raised:
        rendezvous.wait_for_keys([rank_key("ready", "ffn", 0)], "waiting for the other ranks' channels")
    took = time.monotonic() - started
    rendezvous.leave()  # withdraws nothing from a store that stopped answering, and returns at once
    left = time.monotonic() - started - took

    assert 0.5 <= took < 3.0, took
    assert left < 0.5, left
    assert str(raised.value).startswith(
        f"AFD peer lost: the rendezvous store at 127.0.0.1:{port} (hosted by ffn rank 0) did not answer attention "
        "rank 0's store call within 0.5s (peer_timeout_s); ffn rank 0's process is stopped or stuck")
    cont()


def test_torch_store_client_ignores_its_timeout_against_a_stopped_host(stopped_store_host):
    """Why the bound is taken from outside: the fact the design rests on, re-measured on this torch."""
    port, stop, cont = stopped_store_host
    client = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=0.5))
    client.add("k", 1)
    stop()
    time.sleep(0.2)  # the signal is delivered
    outcome: list = []
    worker = threading.Thread(target=lambda: outcome.append(client.add("k", 1)), daemon=True)
    worker.start()
    worker.join(2.0)  # four times the client's timeout
    blocked = worker.is_alive()
    cont()
    worker.join(5.0)

    assert blocked, "torch's client now honours its timeout against a stopped host: call_within may go"
    assert outcome == [2]


# ---- the watchdog watched ------------------------------------------------------------------------


class StuckProgress:
    """Device progress whose poll blocks once ``stuck`` is set: the watchdog thread stuck in a call."""

    def __init__(self) -> None:
        self.stuck, self.release = threading.Event(), threading.Event()

    def record(self, step_seq):
        pass

    def overdue(self, now, bound_s):
        if self.stuck.is_set():
            self.release.wait()
        return None


def test_a_watchdog_thread_stuck_in_a_call_is_reported_by_its_monitor():
    progress = StuckProgress()
    latch = FailureLatch(lambda: None, None)
    watchdog = Watchdog(MemoryStore(), WatchdogSpec(place("attention"), 0.5, 30.0, "h:1"), latch, progress=progress)
    watchdog.start()
    time.sleep(1.0)  # two peer timeouts of healthy ticking
    assert latch.failure is None
    progress.stuck.set()
    elapsed = wait_for(lambda: latch.failure is not None, 5.0)
    progress.release.set()
    watchdog.stop()

    assert 0.4 <= elapsed <= 0.5 + 3 * watchdog.interval_s + 0.5, elapsed
    assert isinstance(latch.failure, AFDWatchdogStalledError)
    assert str(latch.failure).startswith(
        "AFD watchdog stalled: on attention rank 0, its watchdog thread has not ticked for ")


def test_a_failure_callback_that_hangs_delays_the_abort_by_its_bound_only():
    release, aborted = threading.Event(), threading.Event()
    latch = FailureLatch(aborted.set, None, on_failure=lambda exc: release.wait())
    started = time.monotonic()

    latch.fail(AFDPeerLostError("gone"))

    assert aborted.wait(NOTIFY_JOIN_S + 3.0)
    release.set()
    assert NOTIFY_JOIN_S - 0.1 <= time.monotonic() - started < NOTIFY_JOIN_S + 2.0


# ---- device progress -----------------------------------------------------------------------------


def test_device_progress_reports_the_oldest_pending_event_after_the_bound_and_reuses_events():
    device, now = FakeDevice(), [0.0]
    progress = DeviceProgress(device.new_event, clock=lambda: now[0], max_pending=3)

    progress.record(1)
    now[0] = 1.0
    progress.record(2)
    assert progress.overdue(now=1.5, bound_s=2.0) is None  # pending, within the bound
    assert progress.overdue(now=2.5, bound_s=2.0) == (1, 2.5)  # step 1's event: the oldest
    device.finished = 1  # the device got past step 1's event
    assert progress.overdue(now=2.5, bound_s=2.0) is None  # step 2's: 1.5 s pending
    assert progress.overdue(now=3.5, bound_s=2.0) == (2, 2.5)
    device.finished = 2
    assert progress.overdue(now=9.0, bound_s=2.0) is None
    for step in (3, 4, 5, 6):  # two freed events serve steps 3 and 4; the pending cap skips step 6
        progress.record(step)
    assert device.created == 3 and device.recorded == 5


def test_device_progress_records_nothing_while_a_graph_is_captured():
    device = FakeDevice()
    progress = DeviceProgress(device.new_event, capturing=lambda: device.capturing)
    device.capturing = True
    progress.record(1)
    assert device.recorded == 0 and progress.overdue(now=1e9, bound_s=0.0) is None


def test_device_progress_prepares_each_polling_thread_once_before_its_first_query():
    """The watchdog thread leaves the global capture mode before it polls (docs/failures.md#25)."""
    device, prepared = FakeDevice(), []
    progress = DeviceProgress(device.new_event, prepare_thread=lambda: prepared.append(threading.get_ident()))
    progress.record(1)

    progress.overdue(now=0.0, bound_s=1.0)
    progress.overdue(now=0.0, bound_s=1.0)
    other = threading.Thread(target=lambda: progress.overdue(now=0.0, bound_s=1.0))
    other.start()
    other.join()

    assert prepared == [threading.get_ident(), other.ident]


def test_a_thread_that_cannot_be_prepared_still_polls_and_says_so(caplog):
    device = FakeDevice()

    def refuse() -> None:
        raise OSError("libcuda.so.1: cannot open shared object file")

    progress = DeviceProgress(device.new_event, prepare_thread=refuse)
    progress.record(5)

    assert progress.overdue(now=1e9, bound_s=1.0)[0] == 5  # still timed
    assert progress.overdue(now=1e9, bound_s=1.0)[0] == 5
    warnings = [r for r in caplog.records if "could not leave the global CUDA graph capture mode" in r.message]
    assert len(warnings) == 1 and "libcuda.so.1" in warnings[0].message


def test_cpu_has_no_device_progress():
    assert make_progress(torch.device("cpu")) is NULL_PROGRESS
    NULL_PROGRESS.record(3)
    assert NULL_PROGRESS.overdue(now=1e9, bound_s=0.0) is None


def test_a_hung_device_wait_is_a_step_timeout_within_the_bound():
    """A device wait the host cannot see (an NCCL receive enqueued, a replayed graph): the step's event stays
    pending, and the watchdog reports it like a late step, naming the device."""
    device = FakeDevice()
    latch = FailureLatch(lambda: None, None)
    spec = WatchdogSpec(place("attention"), peer_timeout_s=60.0, step_timeout_s=0.5, address="h:1")
    watchdog = Watchdog(MemoryStore(startup_done=1), spec, latch, progress=DeviceProgress(device.new_event))
    watchdog.start()
    wait_for(lambda: watchdog.armed, 3.0)
    watchdog._progress.record(41)  # the host moved on: no step or transfer is open
    elapsed = wait_for(lambda: latch.failure is not None, 5.0)
    watchdog.stop()

    assert 0.5 <= elapsed <= 0.5 + 2 * watchdog.interval_s + 0.5, elapsed
    assert isinstance(latch.failure, AFDStepTimeoutError)
    assert str(latch.failure).startswith(
        "AFD step 41: the device of attention rank 0 has not finished the work enqueued before it for ")
    assert "(step_timeout_s=0.5, ffn peer rank 0)" in str(latch.failure)


# ---- start-up bound ------------------------------------------------------------------------------


def test_before_steps_are_timed_a_stuck_step_meets_the_startup_bound():
    """Regression: before every attention rank flagged start-up done nothing timed a step, so a peer stuck
    during profiling or capture hung this rank for good."""
    latch = FailureLatch(lambda: None, None)
    spec = WatchdogSpec(place("ffn"), peer_timeout_s=60.0, step_timeout_s=0.1, address="h:1", startup_timeout_s=0.6)
    watchdog = Watchdog(MemoryStore(startup_done=0), spec, latch)
    watchdog.start()
    watchdog.step_opened(0)
    watchdog.transfer_started("a2f receive from attention rank 0")
    elapsed = wait_for(lambda: latch.failure is not None, 5.0)
    watchdog.stop()

    assert not watchdog.armed
    assert 0.6 <= elapsed <= 0.6 + 2 * watchdog.interval_s + 0.5, elapsed
    assert isinstance(latch.failure, AFDStepTimeoutError)
    message = str(latch.failure)
    assert "did not complete within startup_timeout_s=0.6, before step timeouts are armed" in message
    assert message.endswith("lower startup_timeout_s to surface a stall sooner")


def test_a_process_resumed_from_sigstop_finds_no_stall_of_its_own():
    """Regression: after SIGCONT the FFN's monitor saw its watchdog thread 15 s behind by the clock (the whole
    process had been stopped) and failed the FFN. Stalls are counted in the threads' own loops."""
    offset = [0.0]
    latch = FailureLatch(lambda: None, None)
    spec = WatchdogSpec(place("ffn"), peer_timeout_s=0.5, step_timeout_s=30.0, address="h:1")
    watchdog = Watchdog(MemoryStore(startup_done=1), spec, latch, clock=lambda: time.monotonic() + offset[0])
    watchdog.start()
    time.sleep(0.3)
    offset[0] = 15.0  # what every thread's clock says once the process runs again
    time.sleep(1.0)  # two peer timeouts of running after the jump
    watchdog.stop()

    assert latch.failure is None, latch.failure


def test_a_late_error_of_the_old_channels_fails_the_pairing_it_belongs_to():
    """Regression: after a thaw the old gloo send timed out while the healing re-formation ran; it failed the
    new pairing's latch, so the re-formation gave up and the attention stopped serving."""
    placement = make_placement("attention", 0, 1, 1)
    connector = make_connector(make_spec(free_port()), placement, transport=QueueTransport(new_wire()))
    old_latch = connector._latch
    new_latch = FailureLatch(lambda: None, None)

    def send_while_a_reformation_swaps_the_latch():
        connector._latch = new_latch  # what reform() does on the healing thread
        raise RuntimeError("Timed out waiting 15000ms for send operation to complete")

    with pytest.raises(AFDPeerLostError, match="control send to ffn rank 0 failed"):
        connector._call("control send to ffn rank", 0, send_while_a_reformation_swaps_the_latch)

    assert isinstance(old_latch.failure, AFDPeerLostError)
    assert new_latch.failure is None
    old_latch.close()


# ---- the store calls outside the rendezvous's own ---------------------------------------------------------


def test_call_within_polls_for_a_failure_while_it_waits():
    release, failure = threading.Event(), AFDPeerLostError("the watchdog saw the peer stop")
    polls: list[float] = []

    def poll() -> None:
        polls.append(time.monotonic())
        if len(polls) == 3:
            raise failure

    started = time.monotonic()
    with pytest.raises(AFDPeerLostError) as raised:
        call_within(release.wait, 30.0, lambda: AssertionError("expired"), poll=poll)
    release.set()

    assert raised.value is failure
    assert time.monotonic() - started < 2.0


def test_a_refusal_against_a_stopped_store_host_counts_the_store_as_gone_within_the_call_bound(stopped_store_host):
    """Regression: a refused rank waited in ``store.check`` for FFN rank 0 to drop the store; a store host that
    stopped answering instead held it until SIGCONT."""
    port, stop, cont = stopped_store_host
    client = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=0.5))
    stop()
    started = time.monotonic()

    leave_refused_store(client, False, 2, time.monotonic, time.sleep, lambda: None, lambda: None, 0.5)

    assert 0.5 <= time.monotonic() - started < 3.0
    cont()


def test_the_start_up_flag_against_a_stopped_store_host_is_a_lost_peer_within_peer_timeout(stopped_store_host):
    """Regression: the attention's start-up flag (``mark_startup_done``, after warm-up) was a bare store call: a
    store host that stopped answering then hung the attention's start-up."""
    port, stop, cont = stopped_store_host
    connector = make_connector(make_spec(port, peer_timeout_s=0.5), make_placement("attention", 0, 1, 1),
                               transport=QueueTransport(new_wire()))
    connector._store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                timeout=datetime.timedelta(seconds=0.5))
    stop()
    started = time.monotonic()

    with pytest.raises(AFDPeerLostError, match="did not answer attention rank 0's start-up flag within 0.5s") as raised:
        connector._flag_startup_done()

    assert 0.5 <= time.monotonic() - started < 3.0
    assert connector.failure is raised.value  # the store is lost: the pairing is, and heals where it can
    cont()
    connector.close()


class BlockedOpenTransport(QueueTransport):
    """A transport whose channel creation waits on the store forever (gloo's, against a stopped host)."""

    def __init__(self, wire) -> None:
        super().__init__(wire)
        self.opening, self.release = threading.Event(), threading.Event()

    def open(self, store, placement, timeout_s) -> None:
        self.opening.set()
        self.release.wait()
        super().open(store, placement, timeout_s)


def initialising(connector) -> tuple[threading.Thread, list]:
    raised: list = []

    def run() -> None:
        try:
            connector.init()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            raised.append((time.monotonic(), exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, raised


@pytest.mark.parametrize("ending", ["peer lost meanwhile", "deadline"])
def test_channel_creation_that_waits_on_the_store_ends_at_a_lost_peer_or_the_deadline(monkeypatch, ending):
    """Regression: ``init()`` opened the channels with a bare call; a healing attention whose FFN stopped while
    the gloo groups were created waited for it for good. Now the call is bounded by the rendezvous's deadline and
    polls the latch, where the watchdog records a stopped peer within peer_timeout_s."""
    from vllm_afd.wire import connector as connector_module
    from vllm_afd.wire.errors import AFDRendezvousTimeout

    monkeypatch.setattr(connector_module, "CHANNEL_OPEN_MARGIN_S", 0.5)
    spec, wire = make_spec(free_port(), rendezvous_timeout_s=4.0 if ending == "deadline" else 60.0), new_wire()
    transport = BlockedOpenTransport(wire)
    ffn = make_connector(spec, make_placement("ffn", 0, 1, 1), transport=QueueTransport(wire))
    attention = make_connector(spec, make_placement("attention", 0, 1, 1), transport=transport)
    ffn_thread, _ = initialising(ffn)
    thread, raised = initialising(attention)
    assert transport.opening.wait(30.0), "the attention never reached channel creation"
    lost = AFDPeerLostError("AFD peer lost: ffn rank 0 has not answered attention rank 0's heartbeat")
    failed_at = time.monotonic()
    if ending == "peer lost meanwhile":
        attention._latch.fail(lost)  # what the watchdog does once the heartbeat round gets no answer
    thread.join(15.0)
    transport.release.set()
    ffn.close()
    ffn_thread.join(30.0)

    assert raised, "init() still waits in channel creation"
    ended_at, error = raised[0]
    if ending == "peer lost meanwhile":
        # NOTE: the poll ends it within a poll interval; 10 s leaves room for a loaded 2-core machine and still
        # tells "ended at the failure" from "ended at the 60 s deadline".
        assert error is lost and ended_at - failed_at < 10.0
    else:
        assert isinstance(error, AFDRendezvousTimeout)
        assert "creating the data and control channels" in str(error)
    attention.close()
