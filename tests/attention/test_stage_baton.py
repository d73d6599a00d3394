"""The CPU stage baton (attention/ubatch.py): k stage threads run one at a time, round-robin at every
yield, each inside its own forward context, and the caller's context is current again afterwards."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.forward_context import get_forward_context, override_forward_context

from vllm_afd.attention.ubatch import CPUStageBaton, run_stages


def staged(num_stages: int, layers_per_stage: list[int]) -> tuple[list[tuple[int, int, bool]], object]:
    """Run stages that log (stage, layer, own context current?) and yield after each layer."""
    baton = CPUStageBaton(num_stages, timeout_s=30.0)
    contexts = [SimpleNamespace(name=f"stage {j}") for j in range(num_stages)]
    outer = SimpleNamespace(name="outer")
    log: list[tuple[int, int, bool]] = []

    def forward(stage: int) -> int:
        for layer in range(layers_per_stage[stage]):
            log.append((stage, layer, get_forward_context() is contexts[stage]))
            baton.yield_stage()
        return stage * 10

    with override_forward_context(outer):
        results = run_stages(forward, contexts, baton)
        after = get_forward_context()
    assert results == [j * 10 for j in range(num_stages)]
    assert after is outer
    return log, baton


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_stages_take_turns_in_layer_stage_order_each_in_its_own_context(num_stages):
    log, _ = staged(num_stages, [3] * num_stages)

    assert log == [(stage, layer, True) for layer in range(3) for stage in range(num_stages)]


@settings(max_examples=30, deadline=None)
@given(layers=st.lists(st.integers(0, 4), min_size=1, max_size=3))
def test_a_stage_that_finishes_early_hands_on_and_the_rest_keep_their_order(layers):
    log, _ = staged(len(layers), layers)

    expected = [(stage, layer, True) for layer in range(max(layers)) for stage in range(len(layers))
                if layer < layers[stage]]
    assert log == expected


def test_an_error_in_one_stage_reaches_the_caller_after_every_stage_ended():
    baton = CPUStageBaton(2, timeout_s=30.0)
    finished = []

    def forward(stage: int) -> None:
        baton.yield_stage()
        if stage == 0:
            raise ValueError("stage 0 broke")
        baton.yield_stage()
        finished.append(stage)

    with override_forward_context(SimpleNamespace()), pytest.raises(ValueError, match="stage 0 broke"):
        run_stages(forward, [SimpleNamespace(), SimpleNamespace()], baton)
    assert finished == [1]


def test_every_stage_thread_asks_for_the_cpu_kernels_tile_state_before_its_stage(monkeypatch):
    """docs/failures.md#24-amx-on-stage-threads: vLLM's AMX attention died of SIGILL on a stage thread without it."""
    import vllm_afd.attention.ubatch as ubatch

    asked: list[str] = []
    ran: list[str] = []
    monkeypatch.setattr(ubatch, "prepare_compute_thread", lambda: asked.append(threading.current_thread().name))

    def forward(stage: int) -> int:
        ran.append(threading.current_thread().name)
        return stage

    with override_forward_context(SimpleNamespace()):
        results = run_stages(forward, [SimpleNamespace() for _ in range(3)], CPUStageBaton(3, timeout_s=30.0))
    assert results == [0, 1, 2]
    assert sorted(asked) == sorted(ran) == ["afd-stage-0", "afd-stage-1", "afd-stage-2"]


def test_yield_outside_a_stage_thread_is_refused():
    with pytest.raises(RuntimeError, match="yield_stage\\(\\) outside a stage thread"):
        CPUStageBaton(2, timeout_s=1.0).yield_stage()


def test_a_stage_that_never_hands_on_times_the_others_out():
    import threading

    baton = CPUStageBaton(2, timeout_s=0.2)
    release = threading.Event()

    def forward(stage: int) -> None:
        if stage == 0:
            release.wait(5.0)  # holds the baton past the others' bound
        baton.yield_stage()

    with override_forward_context(SimpleNamespace()), pytest.raises(RuntimeError, match="stage 1 waited 0.2s"):
        try:
            run_stages(forward, [SimpleNamespace(), SimpleNamespace()], baton)
        finally:
            release.set()
