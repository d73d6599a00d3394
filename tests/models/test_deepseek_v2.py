"""DeepSeek specifics: FP16 dense scaling once on the FFN, MLA, noaux_tc bias, V3.2 refusal."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from models_support import MLA_OFF, afd, random_hidden  # noqa: E402
from safetensors import safe_open  # noqa: E402
from vllm.model_executor.models import deepseek_v2 as ds  # noqa: E402

from vllm_afd.models.deepseek_v2 import (  # noqa: E402
    AFDDeepseekV2ForCausalLM,
    AFDDeepseekV3ForCausalLM,
)
from vllm_afd.models.base import RemoteDenseProxy  # noqa: E402

FP16 = {"dtype": "float16"}


@pytest.fixture(scope="module")
def fp16_pair(build, tiny_model_dirs):
    """Native and FFN half of the V3 checkpoint (routed_scaling_factor 2.5) in float16."""
    model_dir = tiny_model_dirs["deepseek_v3"]
    native = build(model_dir, env=MLA_OFF, **FP16)
    ffn = build(model_dir, AFDDeepseekV3ForCausalLM, afd("ffn"), env=MLA_OFF, **FP16)
    attention = build(model_dir, AFDDeepseekV3ForCausalLM, afd("attention"), env=MLA_OFF, **FP16)
    return native, ffn, attention


def test_fp16_dense_output_is_scaled_once_on_the_ffn(fp16_pair):
    native, ffn, attention = fp16_pair
    scale = 1.0 / native.config.model_config.hf_config.routed_scaling_factor
    assert scale == pytest.approx(0.4)

    hidden = random_hidden(4, 128, torch.float16, seed=0)
    mlp = native.model.model.layers[0].mlp
    assert isinstance(mlp, ds.DeepseekV2MLP)
    # The native decoder scales a DeepseekV2MLP's output after calling it.
    expected = native.run(lambda: mlp(hidden)) * scale
    actual = ffn.run(lambda: ffn.model.compute_ffn_output(hidden, 0))

    assert torch.equal(actual, expected)
    # The attention side's dense slot is no DeepseekV2MLP: its inherited forward does not scale again.
    assert type(attention.model.model.layers[0].mlp) is RemoteDenseProxy


def test_fp16_moe_output_is_left_to_the_block(fp16_pair):
    native, ffn, _ = fp16_pair
    hidden = random_hidden(4, 128, torch.float16, seed=1)

    for idx in ffn.model.get_experts_layer_indices():
        layer = native.model.model.layers[idx]
        expected = native.run(lambda: layer.mlp(hidden))
        assert torch.equal(ffn.run(lambda: ffn.model.compute_ffn_output(hidden, idx)), expected)


def test_bf16_dense_output_is_not_scaled(build, tiny_model_dirs):
    native = build(tiny_model_dirs["deepseek_v3"], env=MLA_OFF)
    ffn = build(tiny_model_dirs["deepseek_v3"], AFDDeepseekV3ForCausalLM, afd("ffn"), env=MLA_OFF)
    hidden = random_hidden(4, 128, torch.bfloat16, seed=2)

    expected = native.run(lambda: native.model.model.layers[0].mlp(hidden))

    assert torch.equal(ffn.run(lambda: ffn.model.compute_ffn_output(hidden, 0)), expected)


@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_mla_attention_half_keeps_native_mla(build, tiny_model_dirs, gate_on_attention):
    model_dir = tiny_model_dirs["deepseek_v2_mla"]
    native = build(model_dir)
    assert native.config.model_config.use_mla
    attention = build(model_dir, AFDDeepseekV2ForCausalLM, afd("attention", gate_on_attention))
    ffn = build(model_dir, AFDDeepseekV2ForCausalLM, afd("ffn", gate_on_attention))

    for layer in attention.model.model.layers:
        assert isinstance(layer.self_attn, ds.DeepseekV2MLAAttention)
    assert attention.param_names() | ffn.param_names() == native.param_names()
    if not gate_on_attention:
        hidden = random_hidden(3, 128, torch.bfloat16, seed=4)
        for idx, layer in enumerate(native.model.model.layers):
            expected = native.run(lambda: layer.mlp(hidden))
            assert torch.equal(ffn.run(lambda: ffn.model.compute_ffn_output(hidden, idx)), expected)


def test_mla_disabled_attention_half_uses_the_mha_formulation(build, tiny_model_dirs):
    attention = build(tiny_model_dirs["deepseek_v2"], AFDDeepseekV2ForCausalLM, afd("attention"),
                      env=MLA_OFF)

    assert all(type(layer.self_attn) is ds.DeepseekV2Attention
               for layer in attention.model.model.layers)


def test_noaux_correction_bias_is_loaded_on_both_roles_with_the_gate_on_attention(build, tiny_model_dirs):
    model_dir = tiny_model_dirs["deepseek_v3"]
    halves = [build(model_dir, AFDDeepseekV3ForCausalLM, afd(role, True), env=MLA_OFF)
              for role in ("attention", "ffn")]
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    with safe_open(str(model_dir / "model.safetensors"), "pt") as checkpoint:
        expected = checkpoint.get_tensor(name).float()
    assert expected.abs().sum() > 0

    for half in halves:
        assert torch.equal(dict(half.model.named_parameters())[name], expected)
    experts_block = halves[1].model.model.layers[1].mlp
    router = experts_block.experts.router
    assert router.e_score_correction_bias is experts_block.gate.e_score_correction_bias


def test_mtp_layers_in_the_checkpoint_are_dropped(build, tiny_model_dirs):
    model_dir = tiny_model_dirs["deepseek_v3"]
    with safe_open(str(model_dir / "model.safetensors"), "pt") as checkpoint:
        assert any(".layers.3." in key for key in checkpoint.keys())

    for role in ("attention", "ffn"):
        half = build(model_dir, AFDDeepseekV3ForCausalLM, afd(role), env=MLA_OFF)
        assert not any(".layers.3." in name for name in half.param_names())


def test_v3_alias_is_a_v3_model_with_the_v2_machinery():
    assert issubclass(AFDDeepseekV3ForCausalLM, ds.DeepseekV3ForCausalLM)
    assert issubclass(AFDDeepseekV3ForCausalLM, AFDDeepseekV2ForCausalLM)
    assert AFDDeepseekV3ForCausalLM.packed_modules_mapping is not ds.DeepseekV3ForCausalLM.packed_modules_mapping


def test_sparse_attention_checkpoints_are_refused(build, tiny_model_dirs):
    with pytest.raises(ValueError, match=r"sparse-attention checkpoints \(index_topk=64"):
        build(tiny_model_dirs["deepseek_v2"], AFDDeepseekV2ForCausalLM, afd("attention"),
              env=MLA_OFF, hf_overrides={"index_topk": 64})
