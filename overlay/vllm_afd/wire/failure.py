"""The sticky failure of one connector (docs/connection.md#liveness): ``FailureLatch`` turns the first
failure into the error every later connector call raises, aborts the channels from a daemon thread, and
terminates the process when no caller picks the failure up within a grace period (the main thread is
stuck in a device sync, or the role is idle and nobody would ever look).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

__all__ = ["ABORT_JOIN_S", "NOTIFY_JOIN_S", "TERMINATE_GRACE_S", "FailureLatch", "terminate_process"]

logger = logging.getLogger(__name__)

# How long a failure may stay unobserved before the process is terminated; also how long a SIGTERM'd
# process has to shut down in order before it exits hard.
TERMINATE_GRACE_S = 2.0
# Bound on waiting for the channel abort (NCCL abort can block while graphs hold the communicator).
ABORT_JOIN_S = 5.0
# Bound on the failure callback (the outage notice, a file write): a stuck file system delays the abort and
# the termination fallback this long at most.
NOTIFY_JOIN_S = 2.0


def terminate_process(cause: BaseException) -> None:
    """SIGTERM (vLLM shuts the worker down in order), hard exit TERMINATE_GRACE_S later: the default fallback
    for a failure nobody observed, and the end of an FFN loop that cannot go on."""
    logger.error("AFD: terminating worker process %d after a failure: %s", os.getpid(), cause)
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
                self._notify(exc)
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

    def _notify(self, exc: BaseException) -> None:
        """The failure callback, waited for NOTIFY_JOIN_S at most (it runs before the abort, so a notice is in
        place before anyone sees the failure; a callback that hangs must not keep the abort from running)."""
        on_failure = self._on_failure
        assert on_failure is not None

        def run() -> None:
            try:
                on_failure(exc)
            except Exception:  # noqa: BLE001 - the failure is recorded; the notice is best effort
                logger.exception("AFD: the failure callback raised")

        notifier = threading.Thread(target=run, name="afd-notify", daemon=True)
        notifier.start()
        notifier.join(NOTIFY_JOIN_S)
        if notifier.is_alive():
            logger.error("AFD: the failure callback did not return within %.0fs; aborting the channels anyway",
                         NOTIFY_JOIN_S)

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
