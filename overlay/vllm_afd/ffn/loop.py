"""The FFN loop: one iteration per attention step, on a daemon thread of the FFN worker.

Its only unbounded wait is the next control payload (an idle attention is legal); the
connector's watchdog turns a lost peer into an error there.  A lost peer or a timed-out step
goes to the runner's ``reform``: pair again with a returning attention, bounded by
``reform_timeout_s`` (docs/connection.md#re-forming).  At FFN DP > 1 the FFN DP ranks agree at each
step's start and end whether all go on or all re-form (ffn/pool.py), so none re-forms while a peer is
still inside the step's MoE collectives.  Any other loop error, or a failed
re-formation, is stored, logged, and takes the worker process down after a short grace, so
the FFN engine dies within seconds instead of serving a dead loop; `stop()` re-raises a
stored error chained to the cause.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.logger import init_logger

from vllm_afd.compute_threads import prepare_compute_thread
from vllm_afd.ffn.pool import LOCAL_POOL, REFORMABLE, DPPool, LocalPool
from vllm_afd.wire.failure import terminate_process

logger = init_logger(__name__)

THREAD_NAME = "afd-ffn-loop"
JOIN_TIMEOUT_S = 5.0


class _StoppedError(Exception):
    """The connector was closed (stop()) or the stop event set: the loop ends, no failure."""


class FFNLoop:
    """Owns the daemon thread, its stop event and the stored loop error."""

    def __init__(self, runner: Any, *, terminate_on_error: bool = True, pool: DPPool | LocalPool = LOCAL_POOL):
        self.runner = runner
        self.pool = pool
        self.terminate_on_error = terminate_on_error
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.num_steps = 0
        self.num_reformations = 0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        prepare_compute_thread()
        try:
            self.runner.init_connector()
            while not self.stop_event.is_set():
                lost = self._step()
                if lost is None:
                    self.num_steps += 1
                    continue
                if self.stop_event.is_set():
                    raise lost
                self.runner.reform(lost)  # raises when the attention does not return in time
                self.num_reformations += 1
        except _StoppedError:
            return
        except BaseException as exc:  # noqa: BLE001 - stored and re-raised by stop()
            if self.stop_event.is_set():
                return  # closing the connector unblocked a receive: not a failure
            self.error = exc
            logger.exception("AFD FFN worker loop failed")
            if self.terminate_on_error:
                # NOTE: the FFN engine comes down (SIGTERM, then a hard exit): vLLM notices the dead worker.
                self.runner.close_connector()
                terminate_process(exc)

    def _step(self) -> BaseException | None:
        """One step; returns the failure every FFN DP rank re-forms after, or None (raises once stopped)."""
        try:
            payload = self.runner.next_step()
        except REFORMABLE as exc:
            payload, lost = None, exc
        else:
            if payload is None:  # connector closed by stop()
                raise _StoppedError
            lost = None
        if self.stop_event.is_set():
            raise _StoppedError
        # NOTE: at the start too: a peer that got this step's payload would otherwise wait in the first MoE
        # collective for a rank that lost its attention before the payload came.
        lost = self.pool.agree(lost, "step start")
        if lost is not None:
            return lost
        try:
            self.runner.run_step(payload)  # at FFN DP > 1 a failed exchange finishes the step on zero rows
        except REFORMABLE as exc:
            lost = exc
        if self.stop_event.is_set():
            raise _StoppedError
        return self.pool.agree(lost, "step end")

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError("AFD FFN worker loop failed") from self.error

    def stop(self) -> None:
        """Set the event, shut the runner down (aborting a blocked receive), join."""
        self.stop_event.set()
        try:
            self.runner.shutdown()
        finally:
            thread, self._thread = self._thread, None
            if thread is not None:
                thread.join(JOIN_TIMEOUT_S)
                if thread.is_alive():
                    logger.error("AFD FFN worker loop did not stop within %.0fs",
                                 JOIN_TIMEOUT_S)
        self.raise_if_failed()
