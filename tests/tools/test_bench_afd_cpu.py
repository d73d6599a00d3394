"""scripts/bench_afd_cpu.py's report of per-round ratios (their arithmetic: test_paired_rounds.py), its layouts
(xAyF flags and cores) and the planner's prediction beside a ratio (pure functions; no servers)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import afd_plan
import bench_afd_cpu
from afd_harness.afd import AFDDeployment, pinned_cpus
from bench_afd_cpu import OTHER_JOBS, Target



def test_the_report_drops_loaded_rounds_and_prints_halves():
    one, two = (Target(f"AFD {k} stage{'s' * (k > 1)}", "", {}, num_stages=k) for k in (1, 2))
    plain = Target("plain 1 core", "", {})
    loads = [0.0, 0.1, 2.0, 0.2, 0.0]
    for target, rates_ in ((plain, [100.0] * 5), (one, [80.0] * 5), (two, [100.0, 100.0, 40.0, 104.0, 104.0])):
        target.tok_s[8] = rates_
        target.windows[8] = [(0, 1)] * 5
        target.cpu[8] = [{OTHER_JOBS: load} for load in loads]

    text = "\n".join(bench_afd_cpu.report([plain, one, two], [8], "title", min_tokens_per_stage=4,
                                          max_other_cores=0.5))

    # Kept rounds 0, 1, 3, 4: 2 ÷ 1 is 1.25, 1.25, 1.30, 1.30 (median 1.275), halves 1.25 and 1.30; 2 ÷ plain 1.02.
    assert "| 8 | 100.0 | 80.0 | 100.0 | 1.27 (—) | 0.80 | 1.02 | 4/5 |" in text
    assert "| AFD 2 stages ÷ AFD 1 stage | 8 | 1.275 | 1.25–1.30 | 1.250 | 1.300 | 3.8 % | 1.250 | 1 |" in text


# ---- layouts and the planner's prediction ---------------------------------------------------------

PROFILES = Path(bench_afd_cpu.__file__).resolve().parent / "afd_planner" / "profiles"
PROFILE = PROFILES / "cpu-qwen3-moe-1k-4l-measured.json"


def test_the_default_layout_is_todays_1a1f_against_plain_on_one_core():
    layout = bench_afd_cpu.parse_layout("1A1F")

    assert layout == bench_afd_cpu.Layout(1, 1) and layout.name == "1A1F"
    assert (layout.afd_fields(), layout.attention_args(), layout.ffn_args()) == ({}, [], [])
    assert (layout.attention_cpus, layout.ffn_cpus, layout.plain_cpus) == ("1", "0", "0")
    assert layout.plain_args(False) == [] and layout.plain_label(False) == "plain 1 core"
    assert not layout.expert_parallel and not layout.oversubscribes(2)


def test_2a1f_takes_the_flags_of_the_attention_dp_e2e_test_and_plain_dp_2():
    layout = bench_afd_cpu.parse_layout("2a1f")

    assert layout.afd_fields() == {"num_attention_ranks": 2, "num_ffn_ranks": 1}
    assert layout.attention_args() == ["--data-parallel-size", "2"] and layout.ffn_args() == []
    assert (layout.attention_cpus, layout.ffn_cpus) == ("1|1", "0")  # tests/e2e/test_afd_cpu.py's dp2 case
    assert layout.plain_args(False) == ["--data-parallel-size", "2"] and layout.plain_cpus == "0|1"
    assert layout.plain_args(True) == ["--data-parallel-size", "2", "--enable-expert-parallel"]
    assert layout.plain_label(False) == "plain DP 2" and not layout.expert_parallel
    assert layout.oversubscribes(2) and not layout.oversubscribes(3)


def test_2a2f_takes_the_flags_of_the_ffn_pool_e2e_test_with_expert_parallelism():
    layout = bench_afd_cpu.parse_layout("2A2F")

    assert layout.afd_fields() == {"num_attention_ranks": 2, "num_ffn_ranks": 2}
    assert layout.attention_args() == ["--data-parallel-size", "2"]
    assert layout.ffn_args() == ["--data-parallel-size", "2", "--enable-expert-parallel"]
    assert (layout.attention_cpus, layout.ffn_cpus) == ("1|1", "0|0")  # tests/e2e/test_afd_pool_healing.py's
    assert layout.expert_parallel and layout.plain_label(True) == "plain DP 2 + EP"
    assert layout.ranks == 4 and layout.oversubscribes(2)


@pytest.mark.parametrize("text", ["1A2F", "3A1F", "3A3F", "0A0F", "2A0F", "2A", "AF", "2x1", ""])
def test_a_layout_outside_the_rule_or_the_two_cores_is_a_parser_error(text, capsys):
    with pytest.raises(SystemExit) as exited:
        bench_afd_cpu.main(["--layout", text])

    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --layout" in err and "expected xAyF with 1 <= y <= x <= 2 (1A1F, 2A1F or 2A2F)" in err


def test_plain_expert_parallelism_needs_a_plain_of_several_ranks(capsys):
    with pytest.raises(SystemExit):
        bench_afd_cpu.main(["--plain-expert-parallel"])

    assert "--plain-expert-parallel needs a plain baseline of several DP ranks" in capsys.readouterr().err


def test_a_bad_profile_is_a_parser_error_before_any_server(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    profile.write_text('{"schema": "afd-profile", "version": 1}')

    with pytest.raises(SystemExit):
        bench_afd_cpu.main(["--predict", str(profile)])

    assert f"--predict {profile}:" in capsys.readouterr().err


def test_a_role_of_several_ranks_is_pinned_to_the_union_of_its_cores(tmp_path):
    assert [pinned_cpus(c) for c in ("1", "1|1", "0|0", "0|1", "0-1")] == ["1", "1", "0", "0,1", "0-1"]
    afd = AFDDeployment("model", python="python", log_dir=tmp_path, attention_cpus="1|1", ffn_cpus="0|0",
                        pin_processes=True)

    assert afd.attention.argv[:3] == ["taskset", "-c", "1"] and afd.ffn.argv[:3] == ["taskset", "-c", "0"]
    assert afd.attention.env["VLLM_CPU_OMP_THREADS_BIND"] == "1|1"


def predict_step_ms(capsys, *flags: str) -> float:
    """The step `afd_plan.py predict` prints for `flags` (the profile, 4 layers, context 28)."""
    afd_plan.main(["predict", str(PROFILE), "--num-layers", "4", "--context", "28", *flags])
    return float(re.match(r"step ([0-9.]+) ms", capsys.readouterr().out).group(1))


@pytest.mark.parametrize("layout, batch, stages", [("1A1F", 8, 2), ("2A1F", 16, 1), ("2A1F", 16, 2), ("2A2F", 8, 3),
                                                   ("2A2F", 9, 1)])
def test_the_prediction_is_predicts_colocated_step_over_its_afd_step_at_the_batch_per_attention_rank(
        capsys, layout, batch, stages):
    shape = bench_afd_cpu.parse_layout(layout)
    model = bench_afd_cpu.planner_model(PROFILE, 4)
    per_rank = str(-(-batch // shape.attention_ranks))

    ratio = bench_afd_cpu.predicted_ratios(model, shape, [batch], [stages], 28, 1)[(stages, batch)]

    plain = predict_step_ms(capsys, "--attention-ranks", str(shape.attention_ranks), "--ffn-ranks", "0",
                            "--batch", per_rank)
    afd = predict_step_ms(capsys, "--attention-ranks", str(shape.attention_ranks), "--ffn-ranks",
                          str(shape.ffn_ranks), "--stages", str(stages), "--batch", per_rank)
    assert ratio == pytest.approx(plain / afd, rel=2e-3)  # predict prints 3 decimals


def test_a_batch_too_small_to_split_is_predicted_as_the_one_stage_it_runs():
    model = bench_afd_cpu.planner_model(PROFILE, 4)
    ratios = bench_afd_cpu.predicted_ratios(model, bench_afd_cpu.Layout(2, 1), [4, 16], [1, 2], 28, 4)

    assert ratios[(2, 4)] == ratios[(1, 4)]  # 2 rows per attention rank < 2 x 4
    assert ratios[(2, 16)] != ratios[(1, 16)]  # 8 rows: 2 stages of 4


def test_a_link_is_predicts_link():
    profile_wire = bench_afd_cpu.planner_model(PROFILE, 4)
    ethernet = bench_afd_cpu.planner_model(PROFILE, 4, "eth")

    assert profile_wire.link is None and profile_wire.collective_link.name == "nvlink"
    assert ethernet.link.name == ethernet.collective_link.name == "eth"
    with pytest.raises(ValueError, match="expected one of"):
        bench_afd_cpu.planner_model(PROFILE, 4, "carrier-pigeon")


def test_the_report_prints_the_planners_ratio_beside_the_measured_one():
    one = Target("AFD 1 stage", "", {}, num_stages=1)
    plain = Target("plain DP 2", "", {})
    for target, rates_ in ((plain, [100.0] * 3), (one, [80.0] * 3)):
        target.tok_s[8] = rates_
        target.windows[8] = [(0, 1)] * 3
        target.cpu[8] = [{OTHER_JOBS: 0.0}] * 3

    text = "\n".join(bench_afd_cpu.report([plain, one], [8, 16], "AFD 2A1F vs plain DP 2", min_tokens_per_stage=4,
                                          planned={(1, 8): 0.9712}, planned_note="what the planner compares"))

    assert "| batch | plain DP 2 tok/s | AFD 1 stage tok/s | 1 ÷ plain DP 2 (planner) | rounds kept |" in text
    assert "| 8 | 100.0 | 80.0 | 0.80 (0.97) | 3/3 |" in text
    assert "| 16 | nan | nan | nan (—) | 0/0 |" in text
    assert "\nwhat the planner compares\n" in text
