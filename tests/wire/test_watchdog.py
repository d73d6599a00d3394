"""vllm_afd.wire.watchdog (docs/connection.md#liveness): sticky failure, abort, termination fallback,
heartbeats, step timeouts.

Heartbeats run against a real TCPStore on loopback; "peers" are watchdogs of other ranks in this
process, so stopping one is exactly what a dead peer looks like from the store.
"""

from __future__ import annotations

import datetime
import re
import threading
import time

import pytest
from torch.distributed import TCPStore

from vllm_afd.wire.errors import AFDPeerLostError, AFDStepTimeoutError
from vllm_afd.wire.placement import Placement
from vllm_afd.wire.store import rank_key
from vllm_afd.wire.failure import FailureLatch
from vllm_afd.wire.watchdog import NULL_WATCHDOG, STARTUP_DONE_KEY, Watchdog, WatchdogSpec


class Recorder:
    """Records abort and terminate calls (with the calling thread) instead of acting."""

    def __init__(self) -> None:
        self.aborts: list[str] = []
        self.terminated: list[BaseException] = []
        self.terminate_event = threading.Event()

    def abort(self) -> None:
        self.aborts.append(threading.current_thread().name)

    def terminate(self, cause: BaseException) -> None:
        self.terminated.append(cause)
        self.terminate_event.set()


def wait_for(predicate, timeout_s: float) -> float:
    """Seconds until ``predicate()`` held; fails the test at the timeout."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, "condition not reached in time"
        time.sleep(0.01)
    return time.monotonic() - started


def test_first_failure_is_sticky_and_raised_by_every_check():
    recorder = Recorder()
    latch = FailureLatch(recorder.abort, recorder.terminate, grace_s=5.0)
    first, second = AFDPeerLostError("first"), AFDPeerLostError("second")

    assert latch.fail(first) is first
    assert latch.fail(second) is first

    for _ in range(2):
        with pytest.raises(AFDPeerLostError, match="first"):
            latch.check()
    latch.join(2.0)
    assert recorder.aborts and recorder.aborts[0] != threading.current_thread().name
    assert recorder.terminated == []


def test_unobserved_failure_terminates_after_the_grace():
    recorder = Recorder()
    latch = FailureLatch(recorder.abort, recorder.terminate, grace_s=0.3)
    started = time.monotonic()

    latch.fail(AFDPeerLostError("gone"))

    assert recorder.terminate_event.wait(3.0)
    assert 0.25 <= time.monotonic() - started < 2.0
    assert [str(cause) for cause in recorder.terminated] == ["gone"]
    assert latch.terminated


def test_observed_or_closed_failures_do_not_terminate():
    for finish in ("check", "close", "observed"):
        recorder = Recorder()
        latch = FailureLatch(recorder.abort, recorder.terminate, grace_s=0.2)

        latch.fail(AFDPeerLostError("gone"), observed=finish == "observed")
        if finish == "check":
            with pytest.raises(AFDPeerLostError):
                latch.check()
        elif finish == "close":
            latch.close()
        latch.join(3.0)

        assert recorder.terminated == [], finish


def test_a_blocking_abort_never_blocks_the_failing_thread():
    release = threading.Event()
    latch = FailureLatch(lambda: release.wait(10.0), None, grace_s=0.1, abort_join_s=0.2)
    started = time.monotonic()

    latch.fail(AFDPeerLostError("gone"))

    assert time.monotonic() - started < 0.1
    latch.join(3.0)
    release.set()


def test_close_makes_later_failures_moot():
    latch = FailureLatch(lambda: None, None)
    latch.close()

    latch.fail(AFDPeerLostError("late"))

    latch.check()  # nothing recorded after an orderly close


@pytest.fixture
def store():
    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=False,
                    timeout=datetime.timedelta(seconds=5))
    yield host


def client(store: TCPStore) -> TCPStore:
    return TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=5))


def place(role, rank, num_attention=1, num_ffn=1):
    role_size = num_attention if role == "attention" else num_ffn
    return Placement(role, rank, num_attention, num_ffn, dp_size=role_size)


def make_watchdog(store, placement, *, peer_timeout_s=0.5, step_timeout_s=30.0):
    recorder = Recorder()
    latch = FailureLatch(recorder.abort, None)
    spec = WatchdogSpec(placement, peer_timeout_s=peer_timeout_s, step_timeout_s=step_timeout_s,
                        address=f"127.0.0.1:{store.port}")
    return Watchdog(client(store), spec, latch), latch


class RecordingStore:
    """A store that counts like TCPStore.add and records every key it was asked for."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}
        self.calls: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def add(self, key: str, amount: int) -> int:
        with self.lock:
            self.calls.append((key, amount))
            self.values[key] = self.values.get(key, 0) + amount
            return self.values[key]


@pytest.mark.parametrize(("placement", "label"), [
    (place("attention", 0), "ffn peer rank 0"),
    (place("attention", 3, 4, 2), "ffn peer rank 1"),
    (place("ffn", 1, 5, 2), "attention peer ranks [3 4]"),
    (place("ffn", 0, 3, 1), "attention peer ranks [0 1 2]"),
])
def test_a_step_names_the_peers_it_waits_on(placement, label):
    spec = WatchdogSpec(placement, peer_timeout_s=5.0, step_timeout_s=60.0, address="h:1")

    actual = spec.step_peer_label

    assert actual == label


def test_the_watchdog_beats_its_own_counter_and_reads_exactly_its_placements_peers():
    store = RecordingStore()
    placement = place("ffn", 1, 3, 2)  # block [2], control peer attention 1
    watchdog = Watchdog(store, WatchdogSpec(placement, 5.0, 60.0, "h:1"), FailureLatch(lambda: None, None))

    watchdog.start()
    wait_for(lambda: len(store.calls) >= 4, 3.0)
    watchdog.stop()

    read = {key for key, amount in store.calls if amount == 0}
    assert {key for key, amount in store.calls if amount == 1} == {rank_key("heartbeat", "ffn", 1)}
    assert read == {rank_key("heartbeat", role, rank) for role, rank in placement.peers} | {STARTUP_DONE_KEY}
    assert placement.peers == (("attention", 1), ("attention", 2))


def test_live_peers_keep_each_other_alive_and_a_silent_one_is_lost_in_time(store):
    attention, attention_latch = make_watchdog(store, place("attention", 0))
    ffn, ffn_latch = make_watchdog(store, place("ffn", 0))
    attention.start()
    ffn.start()

    time.sleep(1.5)  # three peer timeouts of healthy heartbeats
    assert attention_latch.failure is None and ffn_latch.failure is None
    ffn.stop()
    elapsed = wait_for(lambda: attention_latch.failure is not None, 3.0)

    assert 0.3 <= elapsed <= 1.2
    assert isinstance(attention_latch.failure, AFDPeerLostError)
    assert str(attention_latch.failure).startswith("AFD peer lost: ffn rank 0 silent for ")
    assert str(attention_latch.failure).endswith("s (peer_timeout_s=0.5)")
    # It stopped heartbeating, so its own peers learn too (the thread returns right after recording).
    wait_for(lambda: not attention.is_alive, 1.0)
    attention.stop()


def test_losing_the_store_host_is_a_lost_peer():
    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=False,
                    timeout=datetime.timedelta(seconds=5))
    port = host.port
    # A long peer timeout: the silent FFN peer must not be what fails first.
    watchdog, latch = make_watchdog(host, place("attention", 0), peer_timeout_s=30.0)
    watchdog.start()
    time.sleep(0.3)

    del host  # FFN rank 0's process would take the store server down with it
    wait_for(lambda: latch.failure is not None, 3.0)

    assert isinstance(latch.failure, AFDPeerLostError)
    assert f"the rendezvous store at 127.0.0.1:{port} (hosted by ffn rank 0) is unreachable" in str(latch.failure)
    watchdog.stop()


def test_step_timeout_is_armed_only_after_startup_done(store):
    attention, latch = make_watchdog(store, place("attention", 0), peer_timeout_s=30.0, step_timeout_s=0.3)
    attention.start()
    attention.step_opened(7)

    time.sleep(0.8)  # start-up (profile, compile) may take long: no timeout yet
    assert latch.failure is None
    client(store).add(STARTUP_DONE_KEY, 1)
    wait_for(lambda: latch.failure is not None, 3.0)

    assert isinstance(latch.failure, AFDStepTimeoutError)
    message = re.sub(r"open for [0-9.]+s", "open for Ns", str(latch.failure))
    assert message == (
        "AFD step 7 (open for Ns) did not complete within step_timeout_s=0.3 (ffn peer rank 0): attention rank 0 "
        "is between exchanges: computing, stuck outside AFD (a tensor-parallel collective waiting for another "
        "rank of its server), or a payload went missing. Check that rank's log; lower step_timeout_s to "
        "surface a stall sooner")
    attention.stop()


def test_closed_steps_do_not_time_out_but_a_stuck_transfer_does(store):
    client(store).add(STARTUP_DONE_KEY, 1)
    attention, latch = make_watchdog(store, place("attention", 0), peer_timeout_s=30.0, step_timeout_s=0.3)
    attention.start()
    wait_for(lambda: attention.armed, 3.0)

    for seq in range(5):
        attention.step_opened(seq)
        time.sleep(0.1)
        attention.step_closed()
    time.sleep(0.5)
    assert latch.failure is None
    attention.transfer_started("f2a receive from ffn rank 0")  # outside any published step (a missed payload)
    wait_for(lambda: latch.failure is not None, 3.0)

    assert isinstance(latch.failure, AFDStepTimeoutError)
    assert str(latch.failure).startswith("AFD step 4 did not complete within step_timeout_s=0.3")
    assert "attention rank 0 has waited" in str(latch.failure)
    assert "in 'f2a receive from ffn rank 0'" in str(latch.failure)  # names who waits for whom
    attention.stop()


def test_step_timeouts_wait_for_every_attention_ranks_startup(store):
    attention, latch = make_watchdog(store, place("attention", 0, 2, 1), peer_timeout_s=30.0, step_timeout_s=0.3)
    attention.start()
    client(store).add(STARTUP_DONE_KEY, 1)

    time.sleep(0.8)  # one of two attention ranks is done: still unarmed
    armed_early = attention.armed
    client(store).add(STARTUP_DONE_KEY, 1)
    wait_for(lambda: attention.armed, 3.0)
    attention.stop()

    assert not armed_early and latch.failure is None


class StuckStore(RecordingStore):
    """A store whose calls block, once ``freeze`` is set, until ``thaw`` is (a stopped store host)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = threading.Event()
        self.thawed = threading.Event()

    def add(self, key: str, amount: int) -> int:
        if self.frozen.is_set():
            self.thawed.wait()
        return super().add(key, amount)


def test_a_store_that_stops_answering_is_a_lost_peer_in_time_and_steps_still_time_out():
    """Regression: the watchdog judged only between store calls, so a store call that did not return (a
    stopped FFN rank 0, a starved store host) silenced its step timeouts and peer checks for minutes."""
    store = StuckStore()
    store.values[STARTUP_DONE_KEY] = 1
    latch = FailureLatch(lambda: None, None)
    spec = WatchdogSpec(place("attention", 0), peer_timeout_s=1.0, step_timeout_s=30.0, address="h:1")
    watchdog = Watchdog(store, spec, latch)
    peer_beat = threading.Event()

    def ffn_beats() -> None:  # the FFN's heartbeat while the store answers
        while not peer_beat.wait(0.1):
            store.add(rank_key("heartbeat", "ffn", 0), 1)

    threading.Thread(target=ffn_beats, daemon=True).start()
    watchdog.start()
    wait_for(lambda: watchdog.armed, 3.0)
    time.sleep(1.5)
    assert latch.failure is None
    store.frozen.set()
    frozen_at = time.monotonic()
    elapsed = wait_for(lambda: latch.failure is not None, 5.0)
    peer_beat.set()
    store.thawed.set()
    watchdog.stop()

    assert 0.9 <= elapsed <= 1.0 + 2 * watchdog.interval_s + 0.5, elapsed
    assert isinstance(latch.failure, AFDPeerLostError)
    assert str(latch.failure).startswith(
        "AFD peer lost: the rendezvous store at h:1 (hosted by ffn rank 0) has not answered attention rank 0's "
        "heartbeat for ")
    assert time.monotonic() - frozen_at < 5.0


def test_a_stuck_step_is_reported_on_time_while_the_store_is_stuck():
    store = StuckStore()
    store.values[STARTUP_DONE_KEY] = 2
    latch = FailureLatch(lambda: None, None)
    spec = WatchdogSpec(place("ffn", 0, 2, 1), peer_timeout_s=60.0, step_timeout_s=0.5, address="h:1")
    watchdog = Watchdog(store, spec, latch)
    watchdog.start()
    wait_for(lambda: watchdog.armed, 3.0)
    store.frozen.set()  # from now on no store call returns: the judgement must not need one

    watchdog.step_opened(3)
    time.sleep(0.2)
    watchdog.transfer_started("a2f receive from attention rank 1")
    started = time.monotonic()
    elapsed = wait_for(lambda: latch.failure is not None, 5.0)
    store.thawed.set()
    watchdog.stop()

    assert elapsed <= 0.5 + 2 * watchdog.interval_s + 0.2, elapsed
    message = str(latch.failure)
    assert isinstance(latch.failure, AFDStepTimeoutError)
    assert message.startswith("AFD step 3 (open for ")
    assert "(attention peer ranks [0 1]): ffn rank 0 has waited " in message
    # The numbers are right: the transfer waited about as long as the test saw, the step a little longer.
    waited = float(re.search(r"has waited ([0-9.]+)s", message).group(1))
    opened = float(re.search(r"open for ([0-9.]+)s", message).group(1))
    assert abs(waited - (time.monotonic() - started)) < 0.5
    assert opened >= waited + 0.15
    assert "in 'a2f receive from attention rank 1'" in message


def test_a_peer_that_has_not_beaten_yet_is_starting_not_silent():
    """Regression: in a re-formation under load the FFN's watchdog declared a slow attention rank lost before
    that rank's first heartbeat, and the FFN, still inside init, ended its process."""
    store = RecordingStore()
    latch = FailureLatch(lambda: None, None)
    watchdog = Watchdog(store, WatchdogSpec(place("ffn", 0), 0.5, 30.0, "h:1"), latch)
    watchdog.start()

    time.sleep(1.5)  # three peer timeouts before the attention's first beat
    assert latch.failure is None
    store.add(rank_key("heartbeat", "attention", 0), 1)  # its first beat, then silence
    elapsed = wait_for(lambda: latch.failure is not None, 3.0)
    watchdog.stop()

    assert 0.3 <= elapsed <= 1.5
    assert str(latch.failure).startswith("AFD peer lost: attention rank 0 silent for ")


def test_the_null_watchdog_times_nothing_and_stops_at_once():
    started = time.monotonic()

    NULL_WATCHDOG.step_opened(3)
    NULL_WATCHDOG.transfer_started("a2f receive from attention rank 0")
    NULL_WATCHDOG.transfer_finished()
    NULL_WATCHDOG.step_closed()
    NULL_WATCHDOG.stop(5.0)

    assert not NULL_WATCHDOG.armed
    assert time.monotonic() - started < 0.1
