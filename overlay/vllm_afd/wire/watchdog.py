"""Liveness (docs/connection.md#liveness): heartbeats, step timeouts, sticky failure, termination.

Goal: a dead or stuck peer is an error within seconds, never a hang. ``Watchdog`` is a daemon thread
with its own store client: it bumps this rank's heartbeat counter every ``peer_timeout_s / 5`` (at
most every 0.5 s, so peers with shorter timeouts than ours never starve) and
declares a peer lost when its counter stays unchanged for ``peer_timeout_s`` on the local monotonic
clock (no cross-host clocks) or when the store connection breaks (FFN rank 0, its host, is gone).
Once every attention rank has flagged "start-up done", it also fails a step or a single transfer
that runs longer than ``step_timeout_s``. ``FailureLatch`` turns the first failure into the sticky
error every later connector call raises, aborts the channels from a daemon thread, and terminates
the process when no caller picks the failure up within a grace period (the main thread is stuck in
a device sync, or the role is idle and nobody would ever look).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_afd.wire.errors import AFDPeerLostError, AFDStepTimeoutError
from vllm_afd.wire.placement import Placement

__all__ = [
    "ABORT_JOIN_S",
    "STARTUP_DONE_KEY",
    "TERMINATE_GRACE_S",
    "FailureLatch",
    "Watchdog",
    "WatchdogSpec",
    "terminate_process",
]

logger = logging.getLogger(__name__)

# Store counter: each attention rank adds 1 once its profile, warm-up and capture are over.
STARTUP_DONE_KEY = "afd/startup_done"
# How long a failure may stay unobserved before the process is terminated.
TERMINATE_GRACE_S = 2.0
# Bound on waiting for the channel abort (NCCL abort can block while graphs hold the communicator).
ABORT_JOIN_S = 5.0
# Heartbeat period cap: peers may run with other peer_timeout_s values than ours, so beat at least
# this often whatever our own timeout says (one store add per period: negligible).
MAX_HEARTBEAT_INTERVAL_S = 0.5


def terminate_process(cause: BaseException) -> None:
    """Default termination: SIGTERM (vLLM shuts the worker down in order), hard exit 2 s later."""
    logger.error("AFD: terminating worker process %d after an unobserved failure: %s", os.getpid(), cause)
    timer = threading.Timer(TERMINATE_GRACE_S, os._exit, args=(1,))
    timer.daemon = True
    timer.start()
    os.kill(os.getpid(), signal.SIGTERM)


class FailureLatch:
    """The sticky failure of one connector, with the abort and termination fallback
    (docs/connection.md#liveness)."""

    def __init__(
        self,
        abort: Callable[[], None],
        terminate: Callable[[BaseException], None] | None = terminate_process,
        *,
        grace_s: float = TERMINATE_GRACE_S,
        abort_join_s: float = ABORT_JOIN_S,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._abort = abort
        self._terminate = terminate
        # Told the first failure synchronously, before anyone can observe it (the attention's outage notice).
        self._on_failure = on_failure
        self._grace_s = grace_s
        self._abort_join_s = abort_join_s
        self._lock = threading.Lock()
        self._failure: BaseException | None = None
        # Set when a caller saw the failure (check() raised it) or when close() made it moot.
        self._observed = threading.Event()
        self._closed = False
        self._handler: threading.Thread | None = None
        self.terminated = False

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def fail(self, exc: BaseException, *, observed: bool = False) -> BaseException:
        """Record ``exc`` unless a failure is already recorded; returns the sticky failure.

        ``observed=True`` when the caller raises it to the main thread right away (transport errors).
        """
        with self._lock:
            first = self._failure is None and not self._closed
            if first:
                self._failure = exc
        if observed:
            self._observed.set()
        if first:
            logger.error("AFD connector failed: %s", exc)
            if self._on_failure is not None:
                try:
                    self._on_failure(exc)
                except Exception:  # noqa: BLE001 - the failure is recorded; the notice is best effort
                    logger.exception("AFD: the failure callback raised")
            self._handler = threading.Thread(target=self._handle, name="afd-failure", daemon=True)
            self._handler.start()
        return self._failure if self._failure is not None else exc

    def check(self) -> None:
        """Raise the sticky failure, marking it observed (so no termination follows)."""
        failure = self._failure
        if failure is not None:
            self._observed.set()
            raise failure

    def close(self) -> None:
        """Orderly shutdown: later failures are ignored and a pending termination is cancelled."""
        with self._lock:
            self._closed = True
        self._observed.set()

    def join(self, timeout_s: float) -> None:
        """Wait for the failure handler (tests)."""
        handler = self._handler
        if handler is not None:
            handler.join(timeout_s)

    def _handle(self) -> None:
        failed_at = time.monotonic()
        aborter = threading.Thread(target=self._run_abort, name="afd-abort", daemon=True)
        aborter.start()
        aborter.join(self._abort_join_s)
        if aborter.is_alive():
            logger.error("AFD: aborting the channels did not finish within %.0fs", self._abort_join_s)
        remaining = self._grace_s - (time.monotonic() - failed_at)
        if self._observed.wait(max(0.0, remaining)) or self._terminate is None:
            return
        with self._lock:
            if self._closed:
                return
            self.terminated = True
        self._terminate(self._failure if self._failure is not None else RuntimeError("AFD failure"))

    def _run_abort(self) -> None:
        try:
            self._abort()
        except Exception:  # noqa: BLE001 - the failure is already recorded; abort is best effort
            logger.exception("AFD: aborting the channels after a failure raised")


@dataclass(frozen=True, slots=True)
class WatchdogSpec:
    """What one rank watches."""

    # This rank; its data and control peers are the ones whose heartbeats count.
    placement: Placement
    peer_timeout_s: float
    step_timeout_s: float
    # "host:port" of the store, for messages.
    address: str

    @property
    def step_peer_label(self) -> str:
        """Who a step waits on, for messages, e.g. "ffn peer rank 0"."""
        p = self.placement
        if p.role == "attention":
            return f"ffn peer rank {p.subgroup}"
        return f"attention peer ranks [{' '.join(map(str, p.attention_peers))}]"


class Watchdog:
    """Heartbeat and timeout thread of one rank; see the module docstring."""

    def __init__(
        self,
        store: object,
        spec: WatchdogSpec,
        latch: FailureLatch,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store  # a client of its own: never shared with the main thread
        self.spec = spec
        self._latch = latch
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.armed = False
        # (step_seq, opened_at) of the open step, or None.
        self._step: tuple[int | None, float] | None = None
        # Start of the transport call in flight and what it waits for ("a2f receive from attention
        # rank 1"), or None.
        self._transfer_since: float | None = None
        self._transfer_what = ""
        self._last_step_seq: int | None = None

    # ---- main-thread interface --------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="afd-watchdog", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

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

    # ---- thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        from vllm_afd.wire.rendezvous import rank_key

        spec = self.spec
        own_key = rank_key("heartbeat", spec.placement.role, spec.placement.role_rank)
        peer_keys = [rank_key("heartbeat", role, rank) for role, rank in spec.placement.peers]
        last_values: list[int | None] = [None] * len(peer_keys)
        started = self._clock()
        last_change = [started] * len(peer_keys)
        interval = min(spec.peer_timeout_s / 5.0, MAX_HEARTBEAT_INTERVAL_S)
        while True:
            try:
                self._store.add(own_key, 1)
                values = [self._store.add(key, 0) for key in peer_keys]
                if not self.armed:
                    self.armed = self._store.add(STARTUP_DONE_KEY, 0) >= spec.placement.num_attention_ranks
            except RuntimeError as exc:  # DistNetworkError / DistStoreError: the store host is gone
                if not self._stop.is_set():
                    self._latch.fail(self._store_lost(exc))
                return
            now = self._clock()
            for i, value in enumerate(values):
                if value != last_values[i]:
                    last_values[i], last_change[i] = value, now
            failure = self._peer_failure(now, last_change) or self._timeout_failure(now)
            if failure is not None and not self._stop.is_set():
                # NOTE: the thread ends here, so this rank stops heartbeating and its peers learn too.
                self._latch.fail(failure)
                return
            if self._stop.wait(interval):
                return

    def _peer_failure(self, now: float, last_change: Sequence[float]) -> AFDPeerLostError | None:
        spec = self.spec
        for (role, rank), changed_at in zip(spec.placement.peers, last_change):
            silent_s = now - changed_at
            if silent_s >= spec.peer_timeout_s:
                return AFDPeerLostError(
                    f"AFD peer lost: {role} rank {rank} silent for {silent_s:.1f}s "
                    f"(peer_timeout_s={spec.peer_timeout_s:g})"
                )
        return None

    def _timeout_failure(self, now: float) -> AFDStepTimeoutError | None:
        if not self.armed:
            return None
        spec = self.spec
        step, transfer_since = self._step, self._transfer_since
        started = [t for t in (step[1] if step else None, transfer_since) if t is not None]
        if not started or now - min(started) <= spec.step_timeout_s:
            return None
        step_seq = step[0] if step else self._last_step_seq
        shown = "?" if step_seq is None else step_seq
        if transfer_since is not None:
            # NOTE: name who waits for whom: the missing rank is the one this transfer waits on.
            waiting = (f"{spec.placement.label} has waited {now - transfer_since:.1f}s in "
                       f"'{self._transfer_what or 'a transfer'}'")
        else:
            waiting = f"{spec.placement.label} is between exchanges (computing, or a payload went missing)"
        return AFDStepTimeoutError(
            f"AFD step {shown} did not complete within step_timeout_s={spec.step_timeout_s:g} "
            f"({spec.step_peer_label}): {waiting}. Check that rank's log; lower step_timeout_s to "
            "surface a stall sooner"
        )

    def _store_lost(self, exc: BaseException) -> AFDPeerLostError:
        from vllm_afd.wire.rendezvous import store_lost_error

        return store_lost_error(self.spec.address, self.spec.placement.role, self.spec.placement.role_rank, exc)
