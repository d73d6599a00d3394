"""Behaviour of the three fault-tolerance patches on vLLM's real classes (patched vLLM in this interpreter):
the engine core's fault responders (`engine-core-sentinel-add-fault-responders`), the runner's recovery
step in a worker retry (`worker-sentinel-add-runner-recovery`) and fault tolerance on one engine and on
CPU (`worker-sentinel-fix-dp1-and-cpu`).

The engine and worker around vLLM's sentinels are fakes holding only what the sentinels touch; the
sentinels, the busy-loop wrapper and the registry are vLLM's.  Every test unregisters what it registered.
"""

from __future__ import annotations

import queue
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

RETRY = FaultToleranceRequest(instruction="retry", params={}, request_id="test")


class FakeEngine:
    """What EngineCoreSentinel and the busy-loop wrapper read of an EngineCoreProc."""

    def __init__(self, faults: list[Exception], worker_error: Exception | None = None) -> None:
        self.engine_index = 0
        self.enable_fault_tolerance = True
        self.batch_queue = None
        self.output_queue: queue.Queue = queue.Queue()
        self.scheduler = SimpleNamespace(finish_requests=lambda ids, status: [])
        self.rpcs: list[str] = []
        self._faults = faults
        self._worker_error = worker_error

        def collective_rpc(method, args=()):
            self.rpcs.append(method)
            if self._worker_error is not None:
                raise self._worker_error

        self.model_executor = SimpleNamespace(collective_rpc=collective_rpc, is_failed=False)
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


def engine_with_sentinel(faults, worker_error=None, recovery_timeout_s: int = 0) -> FakeEngine:
    engine = FakeEngine(faults, worker_error)
    parallel = SimpleNamespace(fault_tolerance_config=SimpleNamespace(engine_recovery_timeout_sec=recovery_timeout_s))
    engine.ft_sentinel = EngineCoreSentinel(engine=engine, parallel_config=parallel)
    return engine


def test_a_responder_retries_at_once_and_the_busy_loop_resumes() -> None:
    faults: list[Exception] = []
    engine = engine_with_sentinel([RuntimeError("peer lost")])
    unregister = register_fault_responder(lambda exc: faults.append(exc) or RETRY)
    try:
        with pytest.raises(SystemExit):
            engine.run_busy_loop()
    finally:
        unregister()
        unregister()  # idempotent

    assert engine.loops == 2 and engine.rpcs == ["handle_ft_command"]
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

    assert engine.loops == 1 and engine.rpcs == []


def test_a_retry_that_fails_ends_the_recovery_with_its_error() -> None:
    engine = engine_with_sentinel([RuntimeError("peer lost")], worker_error=TimeoutError("the FFN did not return"))
    unregister = register_fault_responder(lambda exc: RETRY)
    try:
        with pytest.raises(TimeoutError, match="the FFN did not return") as info:
            engine.run_busy_loop()
    finally:
        unregister()

    assert isinstance(info.value.__context__, RuntimeError)  # the fault it answered stays in the traceback
    assert engine.loops == 1


class FakeRunner:
    """A V2 runner without requests, with or without a recovery step."""

    def __init__(self, recover=None) -> None:
        self.execute_model_state = object()
        self.req_states = SimpleNamespace(req_id_to_index={})
        if recover is not None:
            self.recover_after_fault = recover


def fake_worker(runner, *, dp_size: int = 1, backend: str = "allgather_reducescatter"):
    parallel = SimpleNamespace(data_parallel_rank=0, data_parallel_size=dp_size, data_parallel_master_ip="127.0.0.1",
                               all2all_backend=backend, world_size=1)
    return SimpleNamespace(parallel_config=parallel, model_runner=runner, use_v2_model_runner=True,
                           vllm_config=SimpleNamespace(), rank=0)


def test_one_engine_runs_fault_tolerant_with_any_all2all_backend_a_dp_group_needs_an_ft_one() -> None:
    WorkerSentinel(fake_worker(FakeRunner()))

    with pytest.raises(ValueError, match="FT-capable all2all backend"):
        WorkerSentinel(fake_worker(FakeRunner(), dp_size=2))


def test_a_retry_on_cpu_cleans_the_worker_then_runs_the_runners_recovery() -> None:
    recovered: list[object] = []
    runner = FakeRunner(recover=lambda: recovered.append(runner.execute_model_state))

    WorkerSentinel(fake_worker(runner)).retry(RETRY)  # no accelerator here: no synchronize

    assert recovered == [None]  # after the worker's own state was cleaned


def test_a_runner_without_a_recovery_step_retries_as_before_and_a_failing_one_fails_the_retry() -> None:
    WorkerSentinel(fake_worker(FakeRunner())).retry(RETRY)

    def refuse() -> None:
        raise RuntimeError("no FFN")

    with pytest.raises(RuntimeError, match="no FFN"):
        WorkerSentinel(fake_worker(FakeRunner(recover=refuse))).retry(RETRY)
