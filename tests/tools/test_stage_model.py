"""scripts/stage_model.py: the § 10 stage model against hand-computed schedules, and its stage-aware spans."""

from __future__ import annotations


import pytest
from hypothesis import given
from hypothesis import strategies as st

import stage_model
from tests.tools._stage_steps import staged_step

from vllm_afd.wire.timeline import StepRecord

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


@given(a=costs, f=costs, t=costs, layers=st.integers(1, 6), k=st.integers(1, 3))
def test_one_shared_device_runs_every_stages_compute_of_both_roles_in_turn(a, f, t, layers, k):
    shared = stage_model.simulate_layers(a, f, t, layers, k, shared_device=True)

    assert shared >= layers * k * (a + f) - 1e-9  # no compute of one role overlaps the other's
    assert shared >= stage_model.simulate_layers(a, f, t, layers, k) - 1e-9  # never faster than two devices
    assert shared <= layers * k * (a + t + f) + 1e-9
    if k == 1:
        assert shared == pytest.approx(layers * (a + t + f))


def test_a_shared_device_hides_only_the_wire():
    # a = 1, f = 2, t = 0.2, 2 layers, 2 stages: the device runs A0 A1 F0 F1 per layer (12 ms of compute); the
    # wire to the FFN hides behind the second stage's attention, only the last way back shows (0.1).
    assert stage_model.simulate_layers(1.0, 2.0, 0.2, 2, 2, shared_device=True) == pytest.approx(12.1)
    assert stage_model.simulate_layers(1.0, 2.0, 0.2, 2, 2) < 12.1


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


def test_the_bench_report_prints_each_ratio_next_to_its_prediction(tmp_path):
    """scripts/bench_afd_cpu.py's table from scripted timelines: the prediction comes from the 1-stage costs."""
    import json

    import bench_afd_cpu

    targets = [bench_afd_cpu.Target("plain 1 core", "", {}),
               bench_afd_cpu.Target("AFD 1 stage", "", {}, num_stages=1, timeline=tmp_path / "1"),
               bench_afd_cpu.Target("AFD 2 stages", "", {}, num_stages=2, timeline=tmp_path / "2")]
    for target, rate, stages in zip(targets, (100.0, 80.0, 100.0), (None, 1, 2)):
        for batch in (4, 8):
            target.tok_s[batch] = [rate * batch / 8]
            target.windows[batch] = [(-1, 1)]
            target.cpu[batch] = [{"attention/VLLM::Worker": 0.5}]
        if stages is not None:
            target.timeline.mkdir()
            for role, index in (("attention", 0), ("ffn", 1)):
                lines = []
                for batch in (4, 8):
                    record = staged_step(a_us=100 * batch // stages, f_us=50 * batch // stages, wire_us=100,
                                         layers=3, stages=stages)[index].to_json()
                    lines.append(json.dumps({**record, "rows": batch, "step_seq": batch}))
                (target.timeline / f"{role}-0.jsonl").write_text("\n".join(lines) + "\n")

    text = "\n".join(bench_afd_cpu.report(targets, [4, 8], "title", min_tokens_per_stage=4))

    # Batch 4 never splits with 4 tokens per stage (predicted 1.00); batch 8 does: its 100 ms step keeps its host
    # share and re-simulates 3 layers at 4 tokens per stage (3.9 -> 3.1 ms), a prediction of 1.01.
    assert "| 4 | 50.0 | 40.0 | 50.0 | 1.25 (1.00) | 0.80 | 1.00 |" in text
    assert "| 8 | 100.0 | 80.0 | 100.0 | 1.25 (1.01) | 0.80 | 1.00 |" in text
    assert "a = 0.000 + 0.1000·n, f = 0.000 + 0.0500·n, t = 0.100 + 0.0000·n" in text
    # A schedule the simulator would produce is measured back as its own prediction, staged or not.
    detail = [line.split(" | ") for line in text.splitlines() if line.startswith(("| 4 | ", "| 8 | ")) and "(" in line
              and "÷" not in line and line.count("|") > 9]
    assert len(detail) == 4
    for cells in detail:
        measured, predicted = cells[7].rstrip(")").split(" (")
        assert measured == predicted, cells


def test_a_batchs_costs_come_from_its_measured_decode_steps_only():
    """The selection bench_afd_cpu.py and the H200 run share: rows, request windows, no warm-up, joined FFN step."""
    import dataclasses

    def step(seq, rows, opened_ns, a_us, **flags):
        attention, ffn = staged_step(a_us=a_us, f_us=200, wire_us=100, layers=3, stages=1)
        fields = dict(step_seq=seq, rows=rows, opened_ns=opened_ns, **flags)
        return dataclasses.replace(attention, **fields), dataclasses.replace(ffn, **fields)

    measured = [step(1, 8, 150, a_us=300), step(2, 8, 160, a_us=300)]
    decoys = [step(3, 8, 50, a_us=900),  # before the window: a warm-up request
              step(4, 16, 170, a_us=900),  # another row count (a prefill chunk, another batch)
              step(5, 8, 180, a_us=900, warmup=True)]
    attention = [a for a, _ in measured + decoys]
    ffn = [f for _, f in measured + decoys]

    costs = stage_model.batch_costs(attention, ffn, 8, [(100, 200)])

    assert costs.a == pytest.approx(0.300) and costs.f == pytest.approx(0.200) and costs.t == pytest.approx(0.100)
    assert stage_model.batch_costs(attention, ffn[1:], 8, [(145, 155)]) is None  # step 1 without its FFN record
    assert stage_model.batch_costs(attention, ffn, 8, []) is None


def test_the_bench_report_prints_each_stage_counts_timeline_step_against_one_stages(tmp_path):
    """The decode step from the timeline (next step's opening minus this one's), 1 stage's ÷ k stages': the
    reproducible figure at long context, where T(N) − T(1) carries the prefill's noise."""
    import json

    import bench_afd_cpu

    targets = [bench_afd_cpu.Target(f"AFD {k} stage", "", {}, num_stages=k, timeline=tmp_path / str(k))
               for k in (1, 2)]
    for target, step_ns in zip(targets, (10_000_000, 8_000_000)):
        target.tok_s[8], target.windows[8], target.cpu[8] = [1.0], [(-1, 3 * step_ns)], [{}]
        target.timeline.mkdir()
        for role, index in (("attention", 0), ("ffn", 1)):
            record = staged_step(a_us=100, f_us=50, wire_us=100, layers=3, stages=target.num_stages)[index].to_json()
            lines = [json.dumps({**record, "step_seq": seq, "opened_ns": seq * step_ns}) for seq in (0, 1)]
            (target.timeline / f"{role}-0.jsonl").write_text("\n".join(lines) + "\n")

    detail = [line.split(" | ") for line in bench_afd_cpu.report(targets, [8], "title", min_tokens_per_stage=4)
              if line.startswith("| 8 | ") and line.count("|") > 9]

    assert [(cells[1], cells[8], cells[9]) for cells in detail] == [("1", "10.00", "1.000"), ("2", "8.00", "1.250")]
