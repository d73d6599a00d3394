"""Tiny checkpoints: CPU-kernel shapes, byte-stable builds, reuse, tokenizer, weight scale."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from afd_harness import tiny_models  # noqa: E402
from afd_harness.tiny_models import (  # noqa: E402
    RECIPE_FILE,
    TINY_ARCHS,
    build_tiny_model,
    is_complete,
    read_recipe,
    serve_env,
)

# vLLM 0.30.0 CPU kernels (VLLM_SEAMS.md 7.1): CPU_ATTN head sizes; CPU_MLA latent head only 576.
CPU_ATTN_HEAD_SIZES = {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}
CPU_MLA_HEAD_SIZE = 576
CPU_MOE_ALIGN = 32


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(arch, root / arch) for arch in TINY_ARCHS}


def _config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_written_config_satisfies_cpu_kernel_constraints(built, arch):
    config = _config(built[arch])

    if config["model_type"] == "qwen3_moe":
        assert config["head_dim"] in CPU_ATTN_HEAD_SIZES
    elif serve_env(built[arch]).get("VLLM_MLA_DISABLE") == "1":
        assert config["qk_nope_head_dim"] + config["qk_rope_head_dim"] in CPU_ATTN_HEAD_SIZES
    else:  # MLA: the latent head
        assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == CPU_MLA_HEAD_SIZE
    assert config["hidden_size"] % CPU_MOE_ALIGN == 0
    assert config["moe_intermediate_size"] % CPU_MOE_ALIGN == 0
    assert config["intermediate_size"] % CPU_MOE_ALIGN == 0
    assert config["hidden_act"] == "silu"
    assert config["tie_word_embeddings"] is False
    assert config["dtype"] == "bfloat16"


def test_qwen3_moe_has_one_dense_layer_then_moe_layers(built):
    config = _config(built["qwen3_moe"])

    moe_layers = [i for i in range(config["num_hidden_layers"]) if i not in config["mlp_only_layers"]]

    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["mlp_only_layers"] == [0]
    assert len(moe_layers) >= 1
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 64)
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (8, 2)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v2_mla"])
def test_deepseek_has_dense_first_layer_shared_experts_and_one_group(built, arch):
    config = _config(built[arch])

    assert config["architectures"] == ["DeepseekV2ForCausalLM"]
    assert config["first_k_dense_replace"] == 1 < config["num_hidden_layers"]
    assert config["n_shared_experts"] == 1
    assert (config["n_group"], config["topk_group"], config["topk_method"]) == (1, 1, "greedy")
    assert config["q_lora_rank"] is None


def test_the_planners_real_shapes_keep_their_routing_and_dense_layers(built):
    """DeepSeek-V3's grouped sigmoid routing and three dense layers; Qwen3-235B-A22B's 128 experts, top 8."""
    v3, qwen = _config(built["deepseek_v3"]), _config(built["qwen3_235b_a22b"])

    assert v3["architectures"] == ["DeepseekV3ForCausalLM"] and v3["num_hidden_layers"] == 61
    assert (v3["first_k_dense_replace"], v3["n_routed_experts"], v3["num_experts_per_tok"]) == (3, 256, 8)
    assert (v3["n_group"], v3["topk_group"], v3["topk_method"], v3["scoring_func"]) == (8, 4, "noaux_tc", "sigmoid")
    assert (v3["hidden_size"], v3["moe_intermediate_size"], v3["q_lora_rank"]) == (7168, 2048, 1536)
    assert (qwen["num_hidden_layers"], qwen["hidden_size"], qwen["moe_intermediate_size"]) == (94, 4096, 1536)
    assert (qwen["num_local_experts"], qwen["num_experts_per_tok"], qwen["mlp_only_layers"]) == (128, 8, [])


def test_only_the_mha_deepseek_needs_mla_disabled(built):
    assert serve_env(built["deepseek_v2"]) == {"VLLM_MLA_DISABLE": "1"}
    assert serve_env(built["deepseek_v2_mla"]) == {}
    assert serve_env(built["qwen3_moe"]) == {}


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_models_stay_small(built, arch):
    num_bytes = sum(p.stat().st_size for p in built[arch].iterdir())

    assert num_bytes < 8 * 2**20


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_building_twice_gives_identical_bytes(built, tmp_path, arch):
    again = build_tiny_model(arch, tmp_path / arch)

    names = sorted(p.name for p in built[arch].iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    assert "tokenizer.json" in names
    # A config-only recipe (real shapes, served with --load-format dummy) writes no weights.
    assert ("model.safetensors" in names) is TINY_ARCHS[arch].weights
    assert read_recipe(again)["serve_args"] == ([] if TINY_ARCHS[arch].weights else ["--load-format", "dummy"])
    for name in names:
        assert (built[arch] / name).read_bytes() == (again / name).read_bytes(), name


def test_another_seed_gives_other_weights_same_tokenizer(built, tmp_path):
    other = build_tiny_model("qwen3_moe", tmp_path / "q", seed=1)

    assert (other / "model.safetensors").read_bytes() != (built["qwen3_moe"] / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (built["qwen3_moe"] / "tokenizer.json").read_bytes()
    assert read_recipe(other)["recipe_hash"] != read_recipe(built["qwen3_moe"])["recipe_hash"]


def test_complete_build_is_reused_untouched(tmp_path):
    out = build_tiny_model("deepseek_v2", tmp_path / "d")
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}

    again = build_tiny_model("deepseek_v2", out)

    assert again == out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes


def test_damaged_build_is_detected_and_rebuilt(tmp_path):
    out = build_tiny_model("deepseek_v2", tmp_path / "d")
    good = (out / "model.safetensors").read_bytes()
    recipe_hash = read_recipe(out)["recipe_hash"]
    (out / "model.safetensors").write_bytes(good[:-8])

    damaged_is_complete = is_complete(out, recipe_hash)
    build_tiny_model("deepseek_v2", out)

    assert not damaged_is_complete
    assert (out / "model.safetensors").read_bytes() == good
    assert is_complete(out, recipe_hash)


def test_foreign_directory_is_replaced_only_with_overwrite(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")

    with pytest.raises(FileExistsError, match=r"not empty and holds no afd_tiny_recipe\.json.*overwrite=True"):
        build_tiny_model("qwen3_moe", out)
    assert (out / "notes.txt").read_text() == "keep me"

    build_tiny_model("qwen3_moe", out, overwrite=True)
    assert not (out / "notes.txt").exists()
    assert (out / RECIPE_FILE).is_file()


def test_unknown_arch_lists_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown arch 'mixtral'; expected one of \['deepseek_v2'"):
        build_tiny_model("mixtral", tmp_path / "m")


def test_cli_builds_and_names_the_serving_env(tmp_path, capsys):
    code = tiny_models.main(["--arch", "deepseek_v2", "--out", str(tmp_path / "d")])

    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("OK: deepseek_v2 in ")
    assert "serve with VLLM_MLA_DISABLE=1" in out
    assert is_complete(tmp_path / "d", read_recipe(tmp_path / "d")["recipe_hash"])


@pytest.fixture(scope="module")
def tokenizer(built):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(built["qwen3_moe"])


def test_tokenizer_has_special_tokens_at_fixed_ids(tokenizer, built):
    config = _config(built["qwen3_moe"])

    assert len(tokenizer) == config["vocab_size"] == tiny_models.VOCAB_SIZE
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert (config["pad_token_id"], config["bos_token_id"], config["eos_token_id"]) == (0, 1, 2)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200))
def test_tokenizer_round_trips_any_text_after_bos(tokenizer, text):
    ids = tokenizer(text)["input_ids"]

    assert ids[0] == tokenizer.bos_token_id
    assert all(0 <= i < tiny_models.VOCAB_SIZE for i in ids)
    assert tokenizer.decode(ids[1:], skip_special_tokens=False) == text


def test_tokenizer_compresses_corpus_english(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]

    assert len(ids) < len(text.encode()) / 2


def test_chat_template_renders_roles_and_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]

    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    assert rendered == "<|bos|><|system|>Be brief.<|eos|><|user|>Hi<|eos|><|assistant|>"


def _fraction_of_changed_greedy_tokens(model_dir: Path, mutate) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.randint(3, tiny_models.VOCAB_SIZE, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits.argmax(-1)
        for name, param in model.named_parameters():
            mutate(name, param)
        after = model(ids).logits.argmax(-1)
    return (before != after).float().mean().item()


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_zeroing_moe_experts_changes_many_greedy_tokens(built, arch):
    """The FFN must matter: an AFD bug that drops the MoE output has to change tokens."""

    def zero_experts(name, param):
        if ".mlp.experts." in name or ".mlp.shared_experts." in name:
            param.zero_()

    assert _fraction_of_changed_greedy_tokens(built[arch], zero_experts) > 0.4


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_rotating_router_rows_changes_many_greedy_tokens(built, arch):
    """Routing must matter: sending tokens to the wrong experts has to change tokens."""

    def rotate_router(name, param):
        if name.endswith(".mlp.gate.weight"):
            param.copy_(param.roll(1, dims=0))

    assert _fraction_of_changed_greedy_tokens(built[arch], rotate_router) > 0.3


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_greedy_tokens_vary_across_prompts(built, arch):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(built[arch], dtype=torch.float32)
    ids = torch.arange(3, 3 + 32).reshape(4, 8)
    with torch.no_grad():
        next_ids = model(ids).logits[:, -1].argmax(-1)

    assert len(set(next_ids.tolist())) >= 3
