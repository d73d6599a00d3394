"""`afd_plan.py profile`: a PROFILE.json measured through the tiny Qwen3-MoE's real vLLM halves (one whole command
on a tiny grid, about 30 s on 2 cores), and every bad argument refused before anything is built.

No assertion reads a time's size: the samples are checked for the schema, their keys (the grid asked for, in
order) and being positive; only the transport's bytes grow with the batch by construction.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import afd_plan
from afd_planner import measure
from afd_planner.memory import memory_block
from afd_planner.measure import MIN_EVICTION_BYTES, CacheEvictor, Grid, last_level_cache_bytes, time_call
from afd_planner.profile import load_profile

pytest.importorskip("vllm")
pytest.importorskip("transformers")

BATCHES, CONTEXTS, TOKENS = (1, 4), (16, 64), (1, 8)


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory) -> Path:
    from afd_harness.tiny_models import build_tiny_model

    return build_tiny_model("qwen3_moe", tmp_path_factory.mktemp("plan_measure") / "qwen3_moe")


@pytest.fixture(scope="module")
def measured(tiny_qwen3_moe, tmp_path_factory) -> tuple[Path, str]:
    """The command run once, as a user runs it: up to the first MoE layer, 2 of the 3 (layer 0 is dense)."""
    out = tmp_path_factory.mktemp("plan_measure_out") / "profile.json"
    command = [sys.executable, str(Path(afd_plan.__file__)), "profile", str(tiny_qwen3_moe), "--layers", "first-moe",
               "--batches", ",".join(map(str, BATCHES)), "--contexts", ",".join(map(str, CONTEXTS)),
               "--tokens", ",".join(map(str, TOKENS)), "--warmup", "1", "--repeats", "2", "--device-gib", "24",
               "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done.stdout


def test_the_profile_reads_back_with_the_full_models_shape(measured):
    out, stdout = measured
    profile = load_profile(out)
    shape = profile.model
    assert (shape.hidden_size, shape.num_layers, shape.num_experts, shape.top_k, shape.dtype_bytes) == (128, 3, 8, 2, 2)
    assert f"wrote {out}" in stdout
    assert "2 of 3 layers built; layer 1" in profile.source
    assert "cold cache: " in profile.source  # on CPU every timed call starts with the caches evicted
    assert "median of 2 eager calls after 1 warm-up" in profile.source  # CUDA graphs are for --device cuda


def test_every_sample_of_the_grid_is_there_positive_and_in_order(measured):
    profile = load_profile(measured[0])
    assert [(s.context, s.batch) for s in profile.attention] == [(c, b) for c in CONTEXTS for b in BATCHES]
    assert [(s.tokens, s.experts) for s in profile.ffn] == [(t, 8) for t in TOKENS]
    assert [s.batch for s in profile.step] == list(BATCHES)
    assert [s.bytes for s in profile.transport] == [b * 128 * 2 for b in BATCHES]
    samples = [*profile.attention, *profile.ffn, *profile.step, *profile.transport]
    assert all(s.ms > 0 for s in samples)
    assert profile.afd_step_extra_ms > 0


def test_each_sample_is_reported_with_its_spread(measured):
    notes = [line for line in measured[1].splitlines() if line.startswith("note: ") and "note: memory" not in line]
    assert len(notes) == len(BATCHES) * len(CONTEXTS) + len(TOKENS) + 2 * len(BATCHES) + 2
    assert all(" ms (" in line and ".." in line for line in notes)


def test_the_planner_reads_the_measured_profile(measured, capsys):
    assert afd_plan.main(["predict", str(measured[0]), "--attention-ranks", "1", "--ffn-ranks", "1",
                          "--stages", "2", "--batch", "4", "--context", "16"]) == 0
    assert capsys.readouterr().out.startswith("step ")


def test_the_memory_block_counts_the_whole_models_weights_from_the_built_layers(measured):
    """Layer 0 dense (MLP 3·128·128), layers 1–2 MoE (8 experts of 3·128·64, gate 128·8), attention q/k/v/o of
    4 heads and 2 KV heads of 64, norms, embedding and head of the 512-token vocabulary; bf16.  Two of the three
    layers are built: the second MoE layer is counted from the first."""
    memory = load_profile(measured[0]).memory
    attention = 128 * 256 + 2 * 128 * 128 + 256 * 128 + 2 * 64 + 2 * 128  # q, k, v, o, q/k norms, two layer norms
    dense = 2 * 512 * 128 + 128 + 3 * attention + 3 * 128 * 128 + 2 * 128 * 8  # embed, head, final norm, MLP, gates
    assert memory.expert_weights_gib == pytest.approx(2 * 8 * 3 * 128 * 64 * 2 / 2**30, abs=1e-6)
    assert memory.dense_weights_gib == pytest.approx(dense * 2 / 2**30, abs=1e-6)
    assert memory.kv_bytes_per_token == 3 * 2 * 2 * 64 * 2  # layers x (K, V) x KV heads x head size x bf16
    assert (memory.device_gib, memory.utilization) == (24.0, 0.9)
    assert "note: memory: " in measured[1]


def test_a_model_whose_dense_layers_were_not_built_gets_no_memory_block():
    # layers 0 MoE, 1 dense (mlp_only_layers after the first MoE one): built through the first MoE layer only
    block, note = memory_block({"model.layers.0.mlp.experts.w13_weight": 10}, 4, [0], [0], 2, 80.0)
    assert block is None and "dense layers were not built" in note


def test_the_routed_experts_are_the_fused_stacks_and_the_rest_is_dense():
    loaded = {"model.embed_tokens.weight": 2**30, "model.layers.0.mlp.experts.w13_weight": 2 * 2**30,
              "model.layers.0.mlp.experts.w2_weight_scale": 2**30, "model.layers.0.mlp.shared_experts.w": 2**30,
              "model.layers.0.self_attn.o_proj.weight": 2**30}
    block, _ = memory_block(loaded, 1000, [0], [0, 1, 2], 3, 79.2)
    assert block == {"device_gib": 79.2, "dense_weights_gib": 1 + 3 * 2, "expert_weights_gib": 3 * 3,
                     "kv_bytes_per_token": 3000}


def test_deepseek_mla_is_measured_through_its_mla_attention(tmp_path):
    """DeepSeek's attention layer sits inside its MLA wrapper (`self_attn.mla_attn.mla_attn`, no `self_attn.attn`):
    the profile finds it by type and samples it on the MLA KV cache (one latent head)."""
    from afd_harness.tiny_models import build_tiny_model

    model = build_tiny_model("deepseek_v2_mla", tmp_path / "deepseek_v2_mla")
    out = tmp_path / "profile.json"
    command = [sys.executable, str(Path(afd_plan.__file__)), "profile", str(model), "--layers", "first-moe",
               "--batches", "1,4", "--contexts", "16", "--tokens", "1", "--warmup", "0", "--repeats", "1",
               "--no-transport", "--device-gib", "1", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    profile = load_profile(out)
    assert [(s.context, s.batch) for s in profile.attention] == [(16, 1), (16, 4)]
    assert all(s.ms > 0 for s in profile.attention)
    # one latent per token and layer (kv_lora_rank 512 + qk_rope 64, bf16); two MoE layers of 8 routed experts
    assert profile.memory.kv_bytes_per_token == 3 * (512 + 64) * 2
    assert profile.memory.expert_weights_gib == pytest.approx(2 * 8 * 3 * 128 * 64 * 2 / 2**30, abs=1e-6)


# --- bad arguments: refused before anything is built ---

@pytest.fixture
def nothing_built(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("measure_profile ran: a bad argument got through")

    monkeypatch.setattr(afd_plan, "measure_profile", refuse)


@pytest.mark.parametrize(("extra", "message"), [
    (["--batches", "1,x"], "--batches must be comma-separated integers, got '1,x'"),
    (["--tokens", "0,4"], "--tokens values must be >= 1"),
    (["--contexts", "4096"], "--contexts up to 4096 exceed the model's max_position_embeddings 2048"),
    (["--layers", "0"], r"--layers must be 1..3 \(the model's layers\), got 0"),
    (["--layers", "4"], r"--layers must be 1..3 \(the model's layers\), got 4"),
    (["--repeats", "0"], "--warmup must be >= 0 and --repeats >= 1"),
    (["--eager"], r"--eager is for --device cuda \(CPU samples are always eager calls\)"),
    (["--device-gib", "0"], "--device-gib must be a positive number of GiB, got 0.0"),
])
def test_a_bad_grid_or_layer_count_is_refused(nothing_built, tiny_qwen3_moe, tmp_path, extra, message):
    with pytest.raises(SystemExit, match=message):
        afd_plan.main(["profile", str(tiny_qwen3_moe), "--out", str(tmp_path / "p.json"), *extra])


@pytest.mark.parametrize(("arch", "layers"), [("qwen3_235b_a22b", 1), ("deepseek_v3", 4), ("deepseek_v2_lite_4l", 2)])
def test_first_moe_builds_the_dense_layers_and_one_moe_layer(tmp_path, arch, layers):
    """DeepSeek-V3 keeps its first three layers dense (first_k_dense_replace), V2-Lite one, Qwen3 none."""
    from afd_harness.tiny_models import build_tiny_model

    assert measure.layers_through_first_moe(build_tiny_model(arch, tmp_path / arch)) == layers


def test_layers_is_a_number_or_first_moe(nothing_built, tiny_qwen3_moe, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        afd_plan.main(["profile", str(tiny_qwen3_moe), "--out", str(tmp_path / "p.json"), "--layers", "all"])
    assert exit_info.value.code == 2
    assert "expected a number of layers or first-moe, got 'all'" in capsys.readouterr().err


def test_a_folder_without_config_json_is_refused(nothing_built, tmp_path):
    with pytest.raises(SystemExit, match=r"cannot read .*config.json .*pass a model directory"):
        afd_plan.main(["profile", str(tmp_path), "--out", str(tmp_path / "p.json")])


def test_an_out_path_in_a_missing_folder_is_refused(nothing_built, tiny_qwen3_moe, tmp_path):
    with pytest.raises(SystemExit, match="folder .*missing does not exist"):
        afd_plan.main(["profile", str(tiny_qwen3_moe), "--out", str(tmp_path / "missing" / "p.json")])


@pytest.mark.parametrize("extra", [["--device", "tpu"], ["--load-format", "pickle"]])
def test_an_unknown_device_or_load_format_is_a_usage_error(nothing_built, tiny_qwen3_moe, tmp_path, extra, capsys):
    with pytest.raises(SystemExit) as exit_info:
        afd_plan.main(["profile", str(tiny_qwen3_moe), "--out", str(tmp_path / "p.json"), *extra])
    assert exit_info.value.code == 2 and "invalid choice" in capsys.readouterr().err


# --- the timer ---

def test_time_call_times_repeats_after_warmup():
    calls = []
    timing = time_call(lambda: calls.append(1), warmup=2, repeats=5)
    assert len(calls) == 7
    assert 0 <= timing.min_ms <= timing.median_ms <= timing.max_ms


def test_before_runs_untimed_ahead_of_every_timed_call_only():
    events = []
    time_call(lambda: events.append("call"), warmup=2, repeats=3, before=lambda: events.append("before"))
    assert events == ["call", "call"] + ["before", "call"] * 3


def test_a_graph_timer_warms_up_eagerly_before_the_capture_and_replays_once_untimed(monkeypatch):
    calls = []

    def fake_graph(fn, warmup, what):  # stands in for the capture: CUDA is not on this machine
        calls.append(("eager warm-up", warmup))
        return lambda: calls.append("replay")

    monkeypatch.setattr(measure, "cuda_graph", fake_graph)
    measure.Timer(Grid((1,), (16,), (1,), warmup=5, repeats=3), graphs=True)(lambda: None, "the FFN at T 1")
    assert calls == [("eager warm-up", 5)] + ["replay"] * 4


def test_a_failed_capture_exits_with_its_own_status(monkeypatch, tiny_qwen3_moe, tmp_path, capsys):
    """The device run retries a model with --eager on this status only, not on any failure's text."""
    def capture_fails(*args, **kwargs):
        raise measure.CaptureError("profile: capturing the FFN at T 8 in a CUDA graph failed (RuntimeError: x)")

    monkeypatch.setattr(afd_plan, "measure_profile", capture_fails)
    code = afd_plan.main(["profile", str(tiny_qwen3_moe), "--out", str(tmp_path / "p.json")])
    assert code == measure.EXIT_CAPTURE_FAILED != 1
    assert "in a CUDA graph failed" in capsys.readouterr().err


@pytest.mark.parametrize(("files", "expected"), [
    ({"index0": "48K", "index2": "1024K", "index3": "32768K"}, 32 << 20),
    ({"index0": "32K", "index1": "2M"}, 2 << 20),
    ({"index0": "512"}, 512),
    ({}, None),
])
def test_the_last_level_cache_is_the_largest_sysfs_cache(tmp_path, files, expected):
    for index, size in files.items():
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert last_level_cache_bytes(tmp_path) == expected


def test_the_evictor_writes_at_least_twice_the_last_level_cache():
    evictor = CacheEvictor()
    assert evictor.num_bytes >= max(MIN_EVICTION_BYTES, 2 * (last_level_cache_bytes() or 0))
    evictor()
    assert CacheEvictor(4096).num_bytes == 4096


def test_the_control_payload_round_trip_is_timed():
    timing = measure.control_payload_ms(32, Grid((32,), (16,), (1,), warmup=0, repeats=3))
    assert timing.median_ms > 0


def test_the_shipped_measured_profile_is_valid():
    path = Path(afd_plan.__file__).parent / "afd_planner" / "profiles" / "cpu-qwen3-moe-1k-4l-measured.json"
    profile = load_profile(path)
    assert profile.model.name == "qwen3_moe_1k_4l" and "afd_plan.py profile" in profile.source
    assert json.loads(path.read_text())["schema"] == "afd-profile"
