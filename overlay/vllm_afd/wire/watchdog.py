"""Liveness (docs/connection.md#liveness): heartbeats, step timeouts, sticky failure, termination.

Goal: a dead or stuck peer is an error within seconds, never a hang. ``Watchdog`` runs two daemon
threads over its own store client. The heartbeat thread bumps this rank's counter every
``peer_timeout_s / 5`` (at most every 0.5 s, so peers with shorter timeouts than ours never starve)
and reads its peers'. The watchdog thread does no I/O: it declares a peer lost when no heartbeat round
saw its counter change for ``peer_timeout_s`` (local monotonic clock, no cross-host clocks), when a
round has not returned for ``peer_timeout_s`` (FFN rank 0, the store's host, is frozen or cut off) or
when the store connection breaks (it is gone); once every attention rank has flagged "start-up done",
it also fails a step or a single transfer that runs longer than ``step_timeout_s`` — on time whatever
the store does. Before that (profile, warm-up, capture, the first pairing) the same clocks run against the
generous ``startup_timeout_s``. With a device (CUDA) it also polls the event each step recorded
(wire/progress.py): device work pending longer than the bound is a step timeout, so a device-side wait is
timed too. A third thread, the monitor (``afd-watchdog-monitor``), and the watchdog thread watch each other:
one that has not ticked for ``peer_timeout_s`` (stuck in a call, or dead) is a failure the other reports.
A failure goes to the connector's ``FailureLatch`` (wire/failure.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm_afd.wire.errors import AFDPeerLostError, AFDStepTimeoutError, AFDWatchdogStalledError
from vllm_afd.wire.failure import FailureLatch
from vllm_afd.role import Role
from vllm_afd.wire.placement import Placement
from vllm_afd.wire.progress import NULL_PROGRESS, DeviceProgress, NullProgress
from vllm_afd.wire.store import rank_key, store_lost_error

__all__ = ["NULL_WATCHDOG", "STARTUP_DONE_KEY", "NullWatchdog", "Watchdog", "WatchdogSpec"]

logger = logging.getLogger(__name__)

# Store counter: each attention rank adds 1 once its profile, warm-up and capture are over.
STARTUP_DONE_KEY = "afd/startup_done"
# Heartbeat period cap: peers may run with other peer_timeout_s values than ours, so beat at least
# this often whatever our own timeout says (one store add per period: negligible).
MAX_HEARTBEAT_INTERVAL_S = 0.5


@dataclass(frozen=True, slots=True)
class WatchdogSpec:
    """What one rank watches."""

    # This rank; its data and control peers are the ones whose heartbeats count.
    placement: Placement
    peer_timeout_s: float
    step_timeout_s: float
    # "host:port" of the store, for messages.
    address: str
    # Bound on a step, a transfer or device work before step timeouts are armed (profile, warm-up, capture).
    startup_timeout_s: float = 1800.0

    @property
    def step_peer_label(self) -> str:
        """Who a step waits on, for messages, e.g. "ffn peer rank 0"."""
        p = self.placement
        if p.role is Role.ATTENTION:
            return f"ffn peer rank {p.subgroup}"
        return f"attention peer ranks [{' '.join(map(str, p.attention_peers))}]"


class NullWatchdog:
    """The watchdog of a connector that watches nothing (before init, after release): every call does nothing."""

    # Never armed: no step or transfer is timed.
    armed = False

    def step_opened(self, step_seq: int | None) -> None:
        pass

    def step_closed(self) -> None:
        pass

    def transfer_started(self, what: str = "") -> None:
        pass

    def transfer_finished(self) -> None:
        pass

    def stop(self, timeout_s: float = 2.0) -> None:
        pass


# Stateless, so one instance serves every connector that is not watching.
NULL_WATCHDOG = NullWatchdog()


class Watchdog:
    """Heartbeat and timeout threads of one rank; see the module docstring.

    Two threads, so that a store call that does not return cannot silence the judgement: the heartbeat
    thread (``afd-heartbeat``) does every store call of a round and records what it saw and when; the
    watchdog thread (``afd-watchdog``) never does I/O and judges from those records and the step and
    transfer clocks, so a step timeout, a silent peer and a store that stopped answering are each
    reported on time whatever the store does. A third, the monitor (``afd-watchdog-monitor``), only counts
    loops: it and the watchdog thread each report the other stuck or dead.
    """

    def __init__(
        self,
        store: object,
        spec: WatchdogSpec,
        latch: FailureLatch,
        *,
        progress: DeviceProgress | NullProgress = NULL_PROGRESS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store  # a client of its own: never shared with the main thread
        self.spec = spec
        self._latch = latch
        self._progress = progress
        self._clock = clock
        self._stop = threading.Event()
        # Set when this watchdog recorded a failure: both threads end, so this rank stops heartbeating.
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self._beat_thread: threading.Thread | None = None
        self._monitor_thread: threading.Thread | None = None
        # Loops run by the watchdog thread and by the monitor; each counts its own loops that saw the other's
        # count unchanged. Counted in loops, not seconds: a process stopped as a whole (SIGSTOP) stops both, and
        # must not find its own threads stalled when it resumes.
        self._judge_ticks = self._monitor_ticks = 0
        # The watchdog thread's loop count when the heartbeat round in flight began (same reason; heartbeat-written).
        self._round_start_tick = 0
        self.armed = False
        self.interval_s = min(spec.peer_timeout_s / 5.0, MAX_HEARTBEAT_INTERVAL_S)
        # (step_seq, opened_at) of the open step, or None.
        self._step: tuple[int | None, float] | None = None
        # Start of the transport call in flight and what it waits for ("a2f receive from attention
        # rank 1"), or None.
        self._transfer_since: float | None = None
        self._transfer_what = ""
        self._last_step_seq: int | None = None
        # Written by the heartbeat thread only: when its store round in flight began (None between
        # rounds), each peer's last counter value and when a round last saw it change.
        self._round_since: float | None = None
        self._peer_values: list[int | None] = [None] * len(spec.placement.peers)
        self._peer_changed: list[float] = []
        self._round_ended = 0.0

    # ---- main-thread interface --------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._round_ended = self._clock()
            self._peer_changed = [self._round_ended] * len(self.spec.placement.peers)
            self._beat_thread = threading.Thread(target=self._beat, name="afd-heartbeat", daemon=True)
            self._thread = threading.Thread(target=self._run, name="afd-watchdog", daemon=True)
            self._monitor_thread = threading.Thread(target=self._monitor, name="afd-watchdog-monitor", daemon=True)
            self._beat_thread.start()
            self._thread.start()
            self._monitor_thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the three threads; a heartbeat blocked in a store call is left to its daemon thread."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in (self._thread, self._monitor_thread, self._beat_thread):
            if thread is not None and thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def step_opened(self, step_seq: int | None) -> None:
        self._last_step_seq = step_seq
        self._step = (step_seq, self._clock())

    def step_closed(self) -> None:
        self._step = None

    def transfer_started(self, what: str = "") -> None:
        self._transfer_what = what
        self._transfer_since = self._clock()

    def transfer_finished(self) -> None:
        self._transfer_since = None

    # ---- threads --------------------------------------------------------------------------------

    def _beat(self) -> None:
        """Heartbeat thread: one store round per interval (bump ours, read the peers', the start-up count)."""
        spec = self.spec
        own_key = rank_key("heartbeat", spec.placement.role, spec.placement.role_rank)
        peer_keys = [rank_key("heartbeat", role, rank) for role, rank in spec.placement.peers]
        while not (self._stop.is_set() or self._halt.is_set()):
            self._round_start_tick, self._round_since = self._judge_ticks, self._clock()
            try:
                self._store.add(own_key, 1)
                values = [self._store.add(key, 0) for key in peer_keys]
                if not self.armed:
                    self.armed = self._store.add(STARTUP_DONE_KEY, 0) >= spec.placement.num_attention_ranks
            except RuntimeError as exc:  # DistNetworkError / DistStoreError: the store host is gone
                if not self._stop.is_set():
                    self._fail(self._store_lost(exc))
                return
            now = self._clock()
            for i, value in enumerate(values):
                if value != self._peer_values[i]:
                    self._peer_values[i], self._peer_changed[i] = value, now
            self._round_ended, self._round_since = now, None
            if self._stop.wait(self.interval_s):
                return

    def _run(self) -> None:
        """Watchdog thread: judge every interval from the heartbeat's records, the step clocks and the device's
        events; no I/O."""
        seen, unchanged = -1, 0
        while not (self._stop.is_set() or self._halt.is_set()):
            now = self._clock()
            self._judge_ticks += 1
            seen, unchanged = (seen, unchanged + 1) if self._monitor_ticks == seen else (self._monitor_ticks, 0)
            failure = (self._store_failure(now) or self._peer_failure(now) or self._timeout_failure(now)
                       or self._device_failure(now) or self._stalled(unchanged, "its monitor"))
            if failure is not None:
                if not self._stop.is_set():
                    self._fail(failure)
                return
            if self._stop.wait(self.interval_s):
                return

    def _monitor(self) -> None:
        """Monitor thread: the watchdog thread must tick every interval; one stuck for ``peer_timeout_s`` (a
        call that does not return) or dead is a failure, since nothing would be timed any more."""
        seen, unchanged = -1, 0
        while not (self._stop.is_set() or self._halt.is_set()):
            self._monitor_ticks += 1
            seen, unchanged = (seen, unchanged + 1) if self._judge_ticks == seen else (self._judge_ticks, 0)
            thread = self._thread
            dead = thread is not None and not thread.is_alive() and not self._halt.is_set()
            failure = self._stalled(unchanged, "its watchdog thread", dead=dead)
            if failure is not None:
                if not self._stop.is_set():
                    self._fail(failure)
                return
            if self._stop.wait(self.interval_s):
                return

    def _fail(self, failure: BaseException) -> None:
        # NOTE: both threads end, so this rank stops heartbeating and its peers learn too.
        self._halt.set()
        self._latch.fail(failure)

    # ---- judgement ------------------------------------------------------------------------------

    def _store_failure(self, now: float) -> AFDPeerLostError | None:
        """A store round that has not returned for ``peer_timeout_s``, by the clock and by this thread's own loops
        (a process resumed from SIGSTOP finds its round old by the clock only): FFN rank 0 is frozen or cut off."""
        spec = self.spec
        since = self._round_since
        if since is None or now - since < spec.peer_timeout_s:
            return None
        if (self._judge_ticks - self._round_start_tick) * self.interval_s < spec.peer_timeout_s:
            return None
        return AFDPeerLostError(
            f"AFD peer lost: the rendezvous store at {spec.address} (hosted by ffn rank 0) has not answered "
            f"{spec.placement.label}'s heartbeat for {now - since:.1f}s (peer_timeout_s={spec.peer_timeout_s:g}); "
            "ffn rank 0's process is stopped or stuck, or the network to its host is cut. Check ffn rank 0's log "
            "and process state; restart it if it does not recover (docs/operations.md)"
        )

    def _peer_failure(self, now: float) -> AFDPeerLostError | None:
        """A peer whose counter no round saw change for ``peer_timeout_s`` (judged as of the last round
        that returned: a round in flight is the store's delay, not the peer's silence)."""
        spec = self.spec
        seen = self._round_ended
        for (role, rank), value, changed_at in zip(spec.placement.peers, self._peer_values, self._peer_changed):
            if not value:
                # NOTE: a peer that has not beaten yet is still starting (a slow rank of a re-formation);
                # init's bounded waits cover it, and it beats before it announces its channels ready.
                continue
            silent_s = seen - changed_at
            if silent_s >= spec.peer_timeout_s:
                return AFDPeerLostError(
                    f"AFD peer lost: {role} rank {rank} silent for {silent_s:.1f}s "
                    f"(peer_timeout_s={spec.peer_timeout_s:g})"
                )
        return None

    @property
    def bound_s(self) -> float:
        """What a step, a transfer and device work may take now: ``step_timeout_s`` once armed, else
        ``startup_timeout_s``."""
        return self.spec.step_timeout_s if self.armed else self.spec.startup_timeout_s

    def _bound_text(self) -> str:
        spec = self.spec
        if self.armed:
            return f"step_timeout_s={spec.step_timeout_s:g}"
        return f"startup_timeout_s={spec.startup_timeout_s:g}, before step timeouts are armed"

    def _stalled(self, unchanged: int, who: str, *, dead: bool = False) -> AFDWatchdogStalledError | None:
        """A liveness thread (``who``) dead, or silent for ``peer_timeout_s`` worth of the caller's own loops:
        nothing is timed any more."""
        spec = self.spec
        silent_s = unchanged * self.interval_s
        if not dead and silent_s < spec.peer_timeout_s:
            return None
        state = "ended" if dead else f"has not ticked for {silent_s:.1f}s (peer_timeout_s={spec.peer_timeout_s:g})"
        return AFDWatchdogStalledError(
            f"AFD watchdog stalled: on {spec.placement.label}, {who} {state}; a call it made does not return "
            "(a blocked log handler, a stuck file system) or the process is starved, so no peer or step would be "
            "timed. Check this rank's log and stacks (py-spy dump); the rank re-forms or restarts as after a lost peer"
        )

    def _device_failure(self, now: float) -> AFDStepTimeoutError | None:
        """Device work enqueued before a step still pending after the bound (wire/progress.py)."""
        late = self._progress.overdue(now, self.bound_s)
        if late is None:
            return None
        step_seq, pending_s = late
        shown = "?" if step_seq is None else step_seq
        return AFDStepTimeoutError(
            f"AFD step {shown}: the device of {self.spec.placement.label} has not finished the work enqueued "
            f"before it for {pending_s:.1f}s ({self._bound_text()}, {self.spec.step_peer_label}); a device-side "
            "wait does not end (an NCCL transfer, a CUDA IPC flag, a replayed graph): the peer's device stopped "
            "or never sent. Check that rank's log and nvidia-smi"
        )

    def _timeout_failure(self, now: float) -> AFDStepTimeoutError | None:
        spec = self.spec
        bound_s = self.bound_s
        step, transfer_since = self._step, self._transfer_since
        step_s = None if step is None else now - step[1]
        transfer_s = None if transfer_since is None else now - transfer_since
        if max(step_s or 0.0, transfer_s or 0.0) <= bound_s:
            return None
        step_seq = step[0] if step else self._last_step_seq
        shown = "?" if step_seq is None else step_seq
        opened = "" if step_s is None else f" (open for {step_s:.1f}s)"
        if transfer_s is not None:
            # NOTE: name who waits for whom: the missing rank is the one this transfer waits on.
            waiting = (f"{spec.placement.label} has waited {transfer_s:.1f}s in "
                       f"'{self._transfer_what or 'a transfer'}'")
        else:
            waiting = (f"{spec.placement.label} is between exchanges: computing, stuck outside AFD (a "
                       "tensor-parallel collective waiting for another rank of its server), or a payload went "
                       "missing")
        lower = "step_timeout_s" if self.armed else "startup_timeout_s"
        return AFDStepTimeoutError(
            f"AFD step {shown}{opened} did not complete within {self._bound_text()} "
            f"({spec.step_peer_label}): {waiting}. Check that rank's log; lower {lower} to "
            "surface a stall sooner"
        )

    def _store_lost(self, exc: BaseException) -> AFDPeerLostError:
        return store_lost_error(self.spec.address, self.spec.placement.role, self.spec.placement.role_rank, exc)
