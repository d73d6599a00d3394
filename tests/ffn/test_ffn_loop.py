"""The FFN loop and the FFN worker's refusals (docs/ffn.md#ffn-loop, docs/ffn.md#worker-surface-and-refusals).

The runner here is a recording stand-in for `AFDFFNModelRunner` (an overlay class, not a
vLLM one): it serves a scripted list of payloads and records what the loop asked of it.
"""

from __future__ import annotations

import queue
import threading

import pytest

pytest.importorskip("vllm")

from vllm_afd.ffn.loop import THREAD_NAME, FFNLoop  # noqa: E402
from vllm_afd.ffn.worker import FFNWorkerMixin  # noqa: E402
from vllm_afd.wire.errors import AFDPeerLostError, AFDRendezvousTimeout, AFDStepTimeoutError  # noqa: E402


class RecordingRunner:
    """Hands out payloads from a queue; None ends the loop like a closed connector."""

    def __init__(self, fail_on: object = None):
        self.payloads: queue.Queue = queue.Queue()
        self.calls: list[str] = []
        self.steps: list[object] = []
        self.fail_on = fail_on
        self.reform_error: BaseException | None = None
        self.shut_down = threading.Event()

    def init_connector(self) -> None:
        self.calls.append("init_connector")

    def next_step(self) -> object:
        return self.payloads.get(timeout=10)

    def run_step(self, payload: object) -> None:
        if isinstance(payload, BaseException):
            raise payload
        if payload == self.fail_on:
            raise ValueError(f"step {payload} broke")
        self.steps.append(payload)

    def reform(self, cause: BaseException) -> None:
        self.calls.append(f"reform after {type(cause).__name__}")
        if self.reform_error is not None:
            raise self.reform_error

    def close_connector(self) -> None:
        self.calls.append("close_connector")

    def shutdown(self) -> None:
        self.calls.append("shutdown")
        self.shut_down.set()
        self.payloads.put(None)  # like closing the connector: the blocked receive returns


def test_loop_runs_one_step_per_payload_on_its_daemon_thread():
    runner = RecordingRunner()
    loop = FFNLoop(runner, terminate_on_error=False)
    for payload in ("p0", "p1", "p2"):
        runner.payloads.put(payload)

    loop.start()
    names = {thread.name for thread in threading.enumerate()}
    loop.stop()

    assert THREAD_NAME in names
    assert runner.calls[0] == "init_connector" and "shutdown" in runner.calls
    assert runner.steps == ["p0", "p1", "p2"] and loop.num_steps == 3
    assert loop.error is None


def test_the_loop_thread_asks_for_the_cpu_kernels_tile_state_before_its_first_step(monkeypatch):
    """docs/failures.md#24-amx-on-stage-threads: the FFN's MoE kernel died of SIGILL on this thread without it."""
    import vllm_afd.ffn.loop as loop_module

    runner = RecordingRunner()
    asked: list[tuple[str, int]] = []
    monkeypatch.setattr(loop_module, "prepare_compute_thread",
                        lambda: asked.append((threading.current_thread().name, len(runner.steps))))
    loop = FFNLoop(runner, terminate_on_error=False)
    runner.payloads.put("p0")

    loop.start()
    loop.stop()

    assert asked == [(THREAD_NAME, 0)] and runner.steps == ["p0"]


def test_a_step_error_is_stored_and_reraised_chained_by_stop():
    runner = RecordingRunner(fail_on="bad")
    loop = FFNLoop(runner, terminate_on_error=False)
    runner.payloads.put("ok")
    runner.payloads.put("bad")

    loop.start()
    for _ in range(100):
        if loop.error is not None:
            break
        threading.Event().wait(0.05)

    with pytest.raises(RuntimeError, match="AFD FFN worker loop failed") as info:
        loop.raise_if_failed()
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(RuntimeError, match="AFD FFN worker loop failed"):
        loop.stop()
    assert runner.steps == ["ok"]


def wait_until(condition) -> None:
    for _ in range(200):
        if condition():
            return
        threading.Event().wait(0.05)


@pytest.mark.parametrize("lost", [AFDPeerLostError("AFD peer lost: x"), AFDStepTimeoutError("AFD step 3 ...")])
def test_a_lost_attention_is_handed_to_reform_and_the_loop_goes_on(lost):
    runner = RecordingRunner()
    loop = FFNLoop(runner, terminate_on_error=False)
    for payload in ("p0", lost, "p1"):
        runner.payloads.put(payload)

    loop.start()
    wait_until(lambda: runner.steps == ["p0", "p1"])
    loop.stop()

    assert runner.steps == ["p0", "p1"] and loop.error is None
    assert runner.calls[:2] == ["init_connector", f"reform after {type(lost).__name__}"]
    assert (loop.num_steps, loop.num_reformations) == (2, 1)


def test_a_failed_re_formation_is_a_loop_error():
    runner = RecordingRunner()
    runner.reform_error = AFDRendezvousTimeout("AFD ffn rank 0: the attention did not return within "
                                               "reform_timeout_s=1 ...")
    loop = FFNLoop(runner, terminate_on_error=False)
    runner.payloads.put(AFDPeerLostError("AFD peer lost: x"))

    loop.start()
    wait_until(lambda: loop.error is not None)

    with pytest.raises(RuntimeError, match="AFD FFN worker loop failed") as info:
        loop.stop()
    assert isinstance(info.value.__cause__, AFDRendezvousTimeout)


def test_stop_is_safe_before_start_and_twice():
    runner = RecordingRunner()
    loop = FFNLoop(runner, terminate_on_error=False)

    loop.stop()
    loop.stop()

    assert runner.calls == ["shutdown", "shutdown"]


class Worker(FFNWorkerMixin):
    """The mixin over a base of our own: only the refusals are under test here."""


@pytest.mark.parametrize("call, message", [
    (lambda w: w.execute_model(None), "AFD FFN workers are connector-driven; scheduler-driven "
                                      "execute_model() is not supported."),
    (lambda w: w.sample_tokens(None), "FFN runners do not sample tokens"),
])
def test_ffn_worker_refuses_scheduler_work(call, message):
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call(Worker())


def test_ffn_worker_reports_no_kv_cache():
    worker = Worker()

    assert worker.get_kv_cache_spec() == {}
    assert worker.determine_available_memory() == 0
