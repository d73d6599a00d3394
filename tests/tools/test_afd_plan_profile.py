"""afd_planner's PROFILE.json schema (every bad field named) and `afd_plan.py profile-from-timeline` on synthetic
timeline files of a scripted deployment (tests/tools/_stage_steps.py's schedule)."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest

import afd_plan
from afd_planner.profile import ProfileError, load_profile, parse_profile
from afd_planner.timeline import profile_from_timeline
from tests.tools._stage_steps import US, staged_step
from tests.tools.test_afd_plan import toy

PROFILES = Path(afd_plan.__file__).parent / "afd_planner" / "profiles"


# --- the schema ---

def test_a_good_profile_round_trips():
    profile = parse_profile(toy())
    assert parse_profile(profile.to_json()) == profile


@pytest.mark.parametrize("path", sorted(PROFILES.glob("*.json")), ids=lambda p: p.name)
def test_the_shipped_profiles_are_valid(path):
    profile = load_profile(path)
    assert profile.model.num_layers >= 1
    assert profile.platform == ("cpu" if path.name.startswith("cpu-") else "cuda")


def test_a_profile_without_a_platform_is_cudas():
    """Profiles written before the field: the planner's GPU commands, as before."""
    body = toy()
    body.pop("platform", None)
    assert parse_profile(body).platform == "cuda"
    assert parse_profile(toy() | {"platform": "cpu"}).to_json()["platform"] == "cpu"


def _bad(edit) -> dict:
    body = copy.deepcopy(toy())
    edit(body)
    return body


@pytest.mark.parametrize(("edit", "message"), [
    (lambda b: b.pop("model"), "model is missing"),
    (lambda b: b["model"].pop("top_k"), "model.top_k is missing"),
    (lambda b: b["model"].update(hidden_size=0), r"model.hidden_size must be an integer >= 1, got 0"),
    (lambda b: b["model"].update(dtype_bytes=True), r"model.dtype_bytes must be an integer >= 1, got True"),
    (lambda b: b["model"].update(top_k=9), r"model.top_k \(9\) exceeds model.num_experts \(8\)"),
    (lambda b: b.update(version=2), "version 2 is not supported"),
    (lambda b: b.update(schema="other"), "schema must be 'afd-profile'"),
    (lambda b: b.update(attention=[]), "attention must be a non-empty list"),
    (lambda b: b["attention"][1].update(ms=float("nan")), r"attention\[1\].ms must be a finite number of ms"),
    (lambda b: b["attention"][0].pop("context"), r"attention\[0\].context is missing"),
    (lambda b: b["ffn"][0].update(experts=9), r"ffn\[0\].experts \(9\) exceeds model.num_experts"),
    (lambda b: b["ffn"][0].update(expert=1), r"ffn\[0\] has unknown field\(s\) \['expert'\]"),
    (lambda b: b["transport"].__setitem__(0, 3), r"transport\[0\] must be an object, got 3"),
    (lambda b: b["step"][0].update(batch=0), r"step\[0\].batch must be an integer >= 1, got 0"),
    (lambda b: b.update(afd_step_extra_ms="1"), "afd_step_extra_ms must be a finite number of ms"),
    (lambda b: b.update(platform="tpu"),
     r"platform must be one of \('cuda', 'cpu'\) \(what ran the samples\), got 'tpu'"),
    (lambda b: b.update(memory={"device_gib": 0}), "memory.device_gib must be a number > 0, got 0"),
    (lambda b: b.update(memory={"device_gib": 1, "dense_weights_gib": 1, "expert_weights_gib": 1,
                                "kv_bytes_per_token": 1, "utilization": 1.5}), "memory.utilization must be"),
])
def test_a_bad_profile_names_its_field(edit, message):
    with pytest.raises(ProfileError, match=message):
        parse_profile(_bad(edit))


def test_an_unreadable_or_non_json_file_names_the_file(tmp_path):
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "missing.json")
    (tmp_path / "p.json").write_text("{")
    with pytest.raises(ProfileError, match=r"p.json is not JSON"):
        load_profile(tmp_path / "p.json")
    (tmp_path / "q.json").write_text(json.dumps(_bad(lambda b: b["model"].pop("hidden_size"))))
    with pytest.raises(ProfileError, match=r"q.json: profile: model.hidden_size is missing"):
        load_profile(tmp_path / "q.json")


# --- the converter ---

LAYERS = 4
HOST_US = 700  # the step's share outside the layers


def write_timeline(directory: Path, batches: dict[int, tuple[int, int, int]], steps: int = 5, stages: int = 1,
                   replay: bool = True) -> None:
    """`steps` consecutive steps per batch: {rows: (a_us, f_us, wire_us)}, one clock, period = layers + host."""
    attention, ffn, seq, t0 = [], [], 0, 0
    for rows, (a_us, f_us, wire_us) in batches.items():
        for _ in range(steps):
            pair = staged_step(a_us, f_us, wire_us, LAYERS, stages)
            shifted = []
            for record in pair:
                marks = tuple(replace(m, t_ns=m.t_ns + t0) for m in record.marks)
                shifted.append(replace(record, step_seq=seq, rows=rows, marks=marks, opened_ns=t0,
                                       closed_ns=t0, graph_replay=replay))
            attention.append(shifted[0])
            ffn.append(shifted[1])
            t0 += (LAYERS * (a_us + f_us + wire_us) + HOST_US) * US
            seq += 1
        seq += 1  # a gap between batches: no period spans two batch sizes
    directory.mkdir(parents=True, exist_ok=True)
    for name, records in (("attention-0", attention), ("ffn-0", ffn)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(r.to_json()) + "\n" for r in records))


def write_model(directory: Path, **overrides) -> Path:
    config = {"hidden_size": 1024, "num_hidden_layers": LAYERS, "num_experts": 16, "num_experts_per_tok": 2,
              "torch_dtype": "bfloat16", **overrides}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return directory


def test_the_converter_reads_each_batch_size_back(tmp_path):
    """The scripted costs come back as samples: attention a, FFN f, transport = wire, host share per step."""
    write_timeline(tmp_path / "tl", {2: (100, 200, 40), 8: (300, 500, 60)})
    body, notes = profile_from_timeline(tmp_path / "tl", write_model(tmp_path / "m"), context=512, device="cpu",
                                        platform="cpu")
    assert body["platform"] == "cpu"
    assert body["model"] == {"name": "m", "hidden_size": 1024, "num_layers": LAYERS, "num_experts": 16,
                             "top_k": 2, "dtype_bytes": 2}
    assert body["attention"] == [{"batch": 2, "context": 512, "ms": 0.1}, {"batch": 8, "context": 512, "ms": 0.3}]
    assert body["ffn"] == [{"tokens": 2, "experts": 16, "ms": 0.2}, {"tokens": 8, "experts": 16, "ms": 0.5}]
    assert body["transport"] == [{"bytes": 2 * 2048, "ms": pytest.approx(0.04)},
                                 {"bytes": 8 * 2048, "ms": pytest.approx(0.06)}]
    assert [s["ms"] for s in body["step"]] == pytest.approx([HOST_US / 1000] * 2)
    assert "1A:1F graph replays" in notes[0]
    assert parse_profile(body).model.hidden_size == 1024


def test_the_cli_writes_a_profile_the_planner_reads(tmp_path, capsys):
    write_timeline(tmp_path / "tl", {1: (50, 60, 30), 4: (80, 90, 30), 16: (200, 220, 40)}, replay=False)
    out = tmp_path / "p.json"
    assert afd_plan.main(["profile-from-timeline", str(tmp_path / "tl"), str(write_model(tmp_path / "m")),
                          "--out", str(out), "--context", "256", "--num-layers", "48"]) == 0
    assert "eager steps" in capsys.readouterr().out
    assert load_profile(out).model.num_layers == 48
    assert afd_plan.main(["plan", str(out), "--gpus", "2"]) == 0
    assert "(baseline)" in capsys.readouterr().out


def test_staged_steps_are_left_out_and_none_left_is_an_error(tmp_path):
    write_timeline(tmp_path / "tl", {8: (100, 100, 10)}, stages=2)
    with pytest.raises(ProfileError, match="no measured one-stage steps"):
        profile_from_timeline(tmp_path / "tl", write_model(tmp_path / "m"), context=0)


def test_one_batch_size_says_the_costs_are_flat(tmp_path):
    write_timeline(tmp_path / "tl", {8: (100, 100, 10)})
    _, notes = profile_from_timeline(tmp_path / "tl", write_model(tmp_path / "m"), context=0)
    assert any("one batch size only" in n for n in notes)


def test_a_dense_model_config_is_refused_naming_the_keys(tmp_path):
    write_timeline(tmp_path / "tl", {8: (100, 100, 10)})
    with pytest.raises(ProfileError, match="lacks num_experts or n_routed_experts, num_experts_per_tok"):
        profile_from_timeline(tmp_path / "tl", write_model(tmp_path / "m", num_experts=None,
                                                           num_experts_per_tok=None), context=0)


def test_deepseek_names_are_read(tmp_path):
    write_timeline(tmp_path / "tl", {8: (100, 100, 10)})
    body, _ = profile_from_timeline(tmp_path / "tl", write_model(tmp_path / "m", num_experts=None,
                                                                 n_routed_experts=64, num_experts_per_tok=6,
                                                                 torch_dtype="float32"), context=0)
    assert (body["model"]["num_experts"], body["model"]["top_k"], body["model"]["dtype_bytes"]) == (64, 6, 4)
