"""scripts/stage_model.py: the § 10 stage model against hand-computed schedules, and its stage-aware spans."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
import stage_model  # noqa: E402

from vllm_afd.wire.timeline import Mark, StepRecord  # noqa: E402

US = 1000  # ns
costs = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)


@given(a=costs, f=costs, t=costs, layers=st.integers(1, 6))
def test_one_stage_is_strictly_serial(a, f, t, layers):
    assert stage_model.simulate_layers(a, f, t, layers, 1) == pytest.approx(layers * (a + t + f))


@given(a=costs, f=costs, t=costs, layers=st.integers(1, 6), k=st.integers(2, 3))
def test_stages_are_bounded_by_each_role_and_by_one_lap(a, f, t, layers, k):
    took = stage_model.simulate_layers(a, f, t, layers, k)

    assert took >= layers * k * a - 1e-9  # the attention does every stage's work
    assert took >= layers * k * f - 1e-9
    assert took >= layers * (a + t + f) - 1e-9  # each stage laps through both roles every layer
    assert took <= layers * k * (a + t + f) + 1e-9  # never worse than running the stages one after another


def test_a_balanced_layer_overlaps_two_stages():
    # a = f = 1, t = 0, 4 layers, 2 stages of the same per-stage cost: steady state max(2a, 2f, a+f) = 2 per
    # layer, plus a fill of one stage's attention (1).
    assert stage_model.simulate_layers(1.0, 1.0, 0.0, 4, 2) == pytest.approx(4 * 2 + 1)


def test_a_line_fits_fixed_and_per_token_costs():
    fit = stage_model.fit_linear([(1, 1.5), (8, 5.0), (16, 9.0)])

    assert fit.fixed == pytest.approx(1.0) and fit.per_token == pytest.approx(0.5)
    assert fit(4) == pytest.approx(3.0)
    assert stage_model.fit_linear([(8, 2.0)]) == stage_model.Linear(2.0, 0.0)
    with pytest.raises(ValueError, match="no \\(batch, cost\\) points"):
        stage_model.fit_linear([])


def test_the_prediction_keeps_the_host_share_and_resimulates_the_layers():
    flat = stage_model.Linear(1.0, 0.0)
    fits = (flat, flat, stage_model.Linear(0.0, 0.0))

    # 1 stage: 4 layers of a + f = 2 ms, 3 ms of host share; 2 stages of the same fixed cost: 4 * 2 + 1 = 9.
    assert stage_model.predicted_step_ms(11.0, fits, 8, 4, 2) == pytest.approx(3.0 + 9.0)


def staged_step(a_us: int, f_us: int, wire_us: int, layers: int, stages: int) -> tuple[StepRecord, StepRecord]:
    """Two stages on one clock, scheduled as the E order runs them (the simulator's schedule)."""
    attention, ffn = [], []
    attention_free = ffn_free = 0
    back = [0] * stages
    for layer in range(layers):
        arrive = []
        for stage in range(stages):
            attention_free = max(attention_free, back[stage]) + a_us * US
            attention += [Mark("a2f_send_start", layer, stage, attention_free),
                          Mark("a2f_send_end", layer, stage, attention_free)]
            arrive.append(attention_free + wire_us * US // 2)
        for stage in range(stages):
            ffn += [Mark("a2f_recv_start", layer, stage, ffn_free)]
            ffn_free = max(ffn_free, arrive[stage])
            ffn += [Mark("a2f_recv_end", layer, stage, ffn_free)]
            ffn_free += f_us * US
            ffn += [Mark("f2a_send_start", layer, stage, ffn_free), Mark("f2a_send_end", layer, stage, ffn_free)]
            back[stage] = ffn_free + wire_us * US // 2
            attention.append(Mark("f2a_recv_end", layer, stage, back[stage]))
    common = dict(step_seq=7, graph_replay=False, warmup=False, profile=False, rows=8, clock="host",
                  host_syncs=0, opened_ns=0, closed_ns=0)
    return (StepRecord("attention", 0, marks=tuple(attention), **common),
            StepRecord("ffn", 0, marks=tuple(ffn), **common))


def test_spans_pair_each_stage_with_its_own_previous_layer():
    attention, ffn = staged_step(a_us=300, f_us=200, wire_us=100, layers=3, stages=2)

    costs = stage_model.exchange_costs(attention, ffn)

    assert (costs.num_layers, costs.num_stages) == (3, 2)
    assert costs.f == pytest.approx(0.200)
    # Stage 0 of layer l+1 waits for its own output of layer l, then computes 300 us: never a negative or
    # cross-stage span (slot-order pairing would pair stage 0's receive with stage 1's send).
    assert costs.a == pytest.approx(0.300)
    assert 0 < costs.ffn_busy <= 1 and 0 < costs.attention_busy <= 1
    assert costs.layers_ms == pytest.approx(
        (max(m.t_ns for m in attention.marks) - 300 * US) / 1e6)


def test_a_record_without_its_receives_is_refused_with_the_fix():
    attention, ffn = staged_step(a_us=300, f_us=200, wire_us=100, layers=2, stages=2)
    cut = StepRecord(**{**{name: getattr(attention, name) for name in (
        "role", "role_rank", "step_seq", "graph_replay", "warmup", "profile", "rows", "opened_ns", "closed_ns",
        "clock", "host_syncs")}, "marks": tuple(m for m in attention.marks if m.kind != "f2a_recv_end")})

    with pytest.raises(ValueError, match="expected one of each per exchange"):
        stage_model.exchange_costs(cut, ffn)
