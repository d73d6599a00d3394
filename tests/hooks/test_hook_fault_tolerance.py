"""Behaviour of the three fault-tolerance patches on vLLM's real classes (patched vLLM in this interpreter):
the engine core's fault responders (`engine-core-sentinel-add-fault-responders`), the runner's recovery
step in a worker retry (`worker-sentinel-add-runner-recovery`) and fault tolerance on one engine and on
CPU (`worker-sentinel-fix-dp1-and-cpu`).

The engine, executor and worker around vLLM's sentinels are fakes holding only what the sentinels touch
(the fields of every release: 0.34's sentinels read more); the sentinels, the busy-loop wrapper, the
registry and, on 0.34, each round's recovery store on loopback are vLLM's.  Every test unregisters what it registered.
"""

from __future__ import annotations

import queue
import uuid
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this interpreter")
try:
    from vllm.v1.fault_tolerance.engine_core_sentinel import (
        EngineCoreSentinel,
        fault_tolerant_wrapper,
        register_fault_responder,
    )
    from vllm.v1.fault_tolerance.utils import FaultToleranceRequest
    from vllm.v1.worker.sentinel.gpu_worker_sentinel import WorkerSentinel
except ImportError as exc:
    pytest.skip(f"this interpreter's vLLM lacks the patch series ({exc})", allow_module_level=True)

pytestmark = pytest.mark.vllm


def retry_request() -> FaultToleranceRequest:
    """An operator's retry: a round of its own (0.34 writes the round's coordination into its params)."""
    return FaultToleranceRequest(instruction="retry", params={}, request_id=f"test-{uuid.uuid4().hex}")


def rounds_keyed_on_request_id() -> bool:
    """vLLM 0.34 names a recovery round by its request_id (``params["recovery_round"]``); 0.30 and 0.32 count
    rounds themselves and only echo the id in the result."""
    from vllm_afd.releases import installed

    return installed().version not in ("0.30.0", "0.32.0")


class FakeRunner:
    """A V2 runner without requests, with or without a recovery step."""

    def __init__(self, recover=None) -> None:
        self.execute_model_state = object()
        self.req_states = SimpleNamespace(req_id_to_index={})
        self.eplb_state = None  # 0.34's retry resets EPLB's async state where there is one
        if recover is not None:
            self.recover_after_fault = recover


def parallel_config(dp_size: int = 1, backend: str = "allgather_reducescatter") -> SimpleNamespace:
    """What the engine's and the worker's sentinels read of a ParallelConfig (the fields of every release)."""
    return SimpleNamespace(data_parallel_rank=0, data_parallel_size=dp_size, data_parallel_master_ip="127.0.0.1",
                           all2all_backend=backend, world_size=1, tensor_parallel_size=1,
                           prefill_context_parallel_size=1, enable_expert_parallel=False, enable_eplb=False,
                           cpu_distributed_timeout_seconds=None, cpu_distributed_timeout=None,
                           fault_tolerance_config=SimpleNamespace(engine_recovery_timeout_sec=0))


def fake_worker(runner, *, dp_size: int = 1, backend: str = "allgather_reducescatter"):
    return SimpleNamespace(parallel_config=parallel_config(dp_size, backend), model_runner=runner,
                           use_v2_model_runner=True, vllm_config=SimpleNamespace(speculative_config=None), rank=0)


class OneWorkerExecutor:
    """An executor of one worker: `collective_rpc("handle_ft_command")` reaches vLLM's WorkerSentinel, as the
    Worker's own `handle_ft_command` does; records every request it carries."""

    def __init__(self, runner: FakeRunner) -> None:
        self.is_failed = False
        self.requests: list[FaultToleranceRequest] = []
        self.worker_sentinel = WorkerSentinel(fake_worker(runner))

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        assert method == "handle_ft_command", method
        self.requests.append(args[0])
        return [self.worker_sentinel.handle_command(args[0])]

    def retries(self) -> list[FaultToleranceRequest]:
        return [request for request in self.requests if request.instruction == "retry"]


class FakeEngine:
    """What EngineCoreSentinel and the busy-loop wrapper read of an EngineCoreProc."""

    def __init__(self, faults: list[Exception], runner: FakeRunner) -> None:
        self.engine_index = 0
        self.enable_fault_tolerance = True
        self.batch_queue = None
        self.output_queue: queue.Queue = queue.Queue()
        self.scheduler = SimpleNamespace(finish_requests=lambda ids, status: [])
        self._faults = faults
        self.model_executor = OneWorkerExecutor(runner)
        self.vllm_config = SimpleNamespace()
        self.loops = 0

    def _send_abort_outputs(self, aborted) -> None:
        pass

    @fault_tolerant_wrapper
    def run_busy_loop(self) -> None:
        self.loops += 1
        if self._faults:
            raise self._faults.pop(0)
        raise SystemExit


def engine_with_sentinel(faults, runner: FakeRunner | None = None) -> FakeEngine:
    engine = FakeEngine(faults, FakeRunner() if runner is None else runner)
    engine.ft_sentinel = EngineCoreSentinel(engine=engine, parallel_config=parallel_config())
    return engine


def test_a_responder_retries_at_once_and_the_busy_loop_resumes() -> None:
    faults: list[Exception] = []
    recovered: list[str] = []
    engine = engine_with_sentinel([RuntimeError("peer lost")], FakeRunner(recover=lambda: recovered.append("ok")))
    unregister = register_fault_responder(lambda exc: faults.append(exc) or retry_request())
    try:
        with pytest.raises(SystemExit):
            engine.run_busy_loop()
    finally:
        unregister()
        unregister()  # idempotent

    assert engine.loops == 2 and recovered == ["ok"] and len(engine.model_executor.retries()) == 1
    assert [str(f) for f in faults] == ["peer lost"]
    assert engine.ft_sentinel.resumed.is_set()


def test_without_an_answering_responder_the_fault_waits_for_the_operator_then_raises() -> None:
    engine = engine_with_sentinel([RuntimeError("a bug")])
    with pytest.raises(RuntimeError, match="a bug"):
        unregister = register_fault_responder(lambda exc: None)
        try:
            engine.run_busy_loop()
        finally:
            unregister()

    assert engine.loops == 1 and engine.model_executor.retries() == []


def test_a_retry_that_fails_ends_the_recovery_with_its_error() -> None:
    def refuse() -> None:
        raise TimeoutError("the FFN did not return")

    engine = engine_with_sentinel([RuntimeError("peer lost")], FakeRunner(recover=refuse))
    unregister = register_fault_responder(lambda exc: retry_request())
    try:
        with pytest.raises(TimeoutError, match="the FFN did not return") as info:
            engine.run_busy_loop()
    finally:
        unregister()

    assert isinstance(info.value.__context__, RuntimeError)  # the fault it answered stays in the traceback
    assert engine.loops == 1


def test_each_afd_retry_is_a_recovery_round_of_its_own_that_vllm_completes(tmp_path, monkeypatch) -> None:
    from vllm_afd import plugin
    from vllm_afd.metrics import METRICS_DIR_ENV, PROMETHEUS_DIR_ENV
    from vllm_afd.outage import record_outage

    monkeypatch.delenv(PROMETHEUS_DIR_ENV, raising=False)
    monkeypatch.setenv(METRICS_DIR_ENV, str(tmp_path))
    record_outage(str(tmp_path), "AFD attention server unavailable: its FFN peer was lost")
    recovered: list[str] = []
    engine = engine_with_sentinel([RuntimeError("AFD peer lost: 1"), RuntimeError("AFD peer lost: 2")],
                                  FakeRunner(recover=lambda: recovered.append("ok")))
    unregister = register_fault_responder(plugin.retry_after_afd_outage)
    try:
        with pytest.raises(SystemExit):
            engine.run_busy_loop()
    finally:
        unregister()

    rounds = engine.model_executor.retries()
    ids = [request.request_id for request in rounds]
    assert len(ids) == 2 and len(set(ids)) == 2 and all(i.startswith("afd-heal-") for i in ids), ids
    assert engine.loops == 3 and recovered == ["ok", "ok"] and engine.ft_sentinel.resumed.is_set()
    results = [engine.output_queue.get_nowait() for _ in range(engine.output_queue.qsize())]
    assert [r[1].utility_output.result.result["status"] for r in results][-1] == "healthy"
    if rounds_keyed_on_request_id():  # each round's rendezvous (its recovery store) is named by its own id
        assert [request.params["recovery_round"] for request in rounds] == ids


def test_one_engine_runs_fault_tolerant_with_any_all2all_backend_a_dp_group_needs_an_ft_one() -> None:
    WorkerSentinel(fake_worker(FakeRunner()))

    with pytest.raises(ValueError, match="FT-capable all2all backend"):
        WorkerSentinel(fake_worker(FakeRunner(), dp_size=2))


def test_a_retry_on_cpu_cleans_the_worker_then_runs_the_runners_recovery() -> None:
    recovered: list[object] = []
    runner = FakeRunner(recover=lambda: recovered.append(runner.execute_model_state))

    engine_with_sentinel([], runner).ft_sentinel.retry(retry_request())  # no accelerator here: no synchronize

    assert recovered == [None]  # after the worker's own state was cleaned


def test_a_runner_without_a_recovery_step_retries_as_before_and_a_failing_one_fails_the_retry() -> None:
    engine_with_sentinel([], FakeRunner()).ft_sentinel.retry(retry_request())

    def refuse() -> None:
        raise RuntimeError("no FFN")

    with pytest.raises(RuntimeError, match="no FFN"):
        engine_with_sentinel([], FakeRunner(recover=refuse)).ft_sentinel.retry(retry_request())
