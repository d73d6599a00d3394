"""A healing attention rank: after its FFN is lost it pairs again without a restart
(docs/connection.md#healing-attention).

vLLM's engine cannot outlive a failed step by itself; its fault tolerance can (the attention's config
hook turns it on, plugin.py).  A lost FFN reaches this rank one of two ways, and both end here:

* **during a step**: the step raises, vLLM's fault-tolerant busy loop aborts the engine's requests and
  asks its fault responders what to do; AFD's (plugin.py) answers "retry" while the outage notice
  exists, and the retry calls each worker's ``recover_after_fault`` (patch
  ``worker-sentinel-add-runner-recovery``), which calls ``heal()``: it waits for the re-formation.
* **between steps** (an idle server): no step observes the failure, so the connector's failure latch
  calls its termination fallback, which for a healing rank is ``start()``: the re-formation runs in
  the background and the engine never notices.

A re-formation waits up to ``reform_timeout_s`` for an FFN whose handshake agrees (wire/reforming.py),
then removes the outage notice, so the API server admits requests again.  If the FFN does not return
in time the notice says to restart the server, and the rank ends: by raising into the retry (the
engine stops) or, when no step was waiting, by the termination it replaced.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from vllm_afd.outage import clear_outage, outage_message, record_outage
from vllm_afd.wire.connector import AFDConnector
from vllm_afd.wire.reforming import reform_within
from vllm_afd.wire.failure import terminate_process

__all__ = ["AttentionHealer"]

logger = logging.getLogger(__name__)

GAVE_UP = ("this attention server stops serving. Restart the FFN with the attention's model and AFD settings, "
           "then restart this attention server")


class AttentionHealer:
    """Re-forms one attention rank's connector after a failure, once per failure."""

    def __init__(self, connector: AFDConnector, reform_timeout_s: float, notice_dir: str | None, *,
                 terminate: Callable[[BaseException], None] = terminate_process) -> None:
        self.connector = connector
        self.reform_timeout_s = reform_timeout_s
        self.notice_dir = notice_dir
        self._terminate = terminate
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._awaited = False  # a retry waits in heal(): it, not the termination, reports a failure
        self.heals = 0

    def start(self, cause: BaseException, *, awaited: bool = False) -> threading.Thread:
        """Begin re-forming in the background unless one already runs (the latch's fallback);
        ``awaited``: a caller will join it and report its failure (no termination then)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                self._awaited |= awaited
                return self._thread
            self._error = None
            self._awaited = awaited
            self._thread = threading.Thread(target=self._run, args=(cause,), name="afd-heal", daemon=True)
            self._thread.start()
            return self._thread

    def heal(self) -> None:
        """Re-form (or wait for the re-formation already running); raise its error.

        Called by vLLM's retry after a step observed the failure; a connector that is healthy again
        (an idle server healed already) returns at once.
        """
        with self._lock:
            running = self._thread is not None and self._thread.is_alive()
        if not running and self.connector.is_initialized:
            return
        self.start(self.connector.failure or RuntimeError("AFD connector not paired"), awaited=True).join()
        if self._error is not None:
            raise self._error

    def _run(self, cause: BaseException) -> None:
        try:
            # NOTE: the connector re-announces this rank's start-up as done: a healed rank runs no
            # profile, and a graph re-capture (attention/runner.py) is timed per exchange like a step.
            reform_within(self.connector, self.reform_timeout_s, cause, peer="the FFN", then=GAVE_UP)
        except BaseException as exc:  # noqa: BLE001 - recorded, then reported by heal() or by terminating
            self._error = exc
            logger.error("%s", exc)
            if self.notice_dir is not None:
                record_outage(self.notice_dir, outage_message(exc), replace=True)
            with self._lock:
                awaited = self._awaited
            if not awaited:
                self._terminate(exc)
            return
        self.heals += 1
        if self.notice_dir is not None:
            clear_outage(self.notice_dir)
