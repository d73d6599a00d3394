"""Layer classification and the weight-role table (docs/models.md): pure, no torch, no vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from vllm_afd.models import AFD_MODEL_ALIASES, alias_for
from vllm_afd.models.split import (
    SUPPORTED_ARCHITECTURES,
    check_architecture,
    filter_weights,
    is_moe_layer,
    layer_kinds,
    moe_layer_indices,
    num_routed_experts,
    weight_role,
)

QWEN = "Qwen3MoeForCausalLM"
DSV2 = "DeepseekV2ForCausalLM"
DSV3 = "DeepseekV3ForCausalLM"


def qwen_config(num_layers=4, mlp_only_layers=(0,), decoder_sparse_step=1, num_experts=8):
    return SimpleNamespace(
        num_hidden_layers=num_layers, mlp_only_layers=list(mlp_only_layers),
        decoder_sparse_step=decoder_sparse_step, num_experts=num_experts,
    )


def deepseek_config(num_layers=4, first_k_dense_replace=1, moe_layer_freq=1, n_routed_experts=8):
    return SimpleNamespace(
        num_hidden_layers=num_layers, first_k_dense_replace=first_k_dense_replace,
        moe_layer_freq=moe_layer_freq, n_routed_experts=n_routed_experts,
    )


# ---- architectures and aliases ----------------------------------------------------------

def test_supported_architectures_are_the_three_split_ones():
    assert SUPPORTED_ARCHITECTURES == (DSV2, DSV3, QWEN)
    assert all(check_architecture(arch) == arch for arch in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("arch", ["DeepseekForCausalLM", "DeepseekV32ForCausalLM",
                                  "GlmMoeDsaForCausalLM", "LlamaForCausalLM", ""])
def test_unsupported_architecture_is_refused_with_the_supported_list(arch):
    with pytest.raises(ValueError) as info:
        check_architecture(arch)

    assert str(info.value).startswith(
        f"architecture {arch} is not supported by AFD; supported: "
        "DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, Qwen3MoeForCausalLM."
    )
    with pytest.raises(ValueError, match="is not supported by AFD"):
        alias_for(arch)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_alias_for_maps_each_architecture_to_its_lazy_alias(arch):
    alias = alias_for(arch)

    assert alias == "AFD" + arch
    module, _, cls = AFD_MODEL_ALIASES[alias].partition(":")
    assert module.startswith("vllm_afd.models.") and cls == alias
    assert alias_for(alias) == alias


# ---- layer classification -------------------------------------------------------------------

@pytest.mark.parametrize("config, expected", [
    (qwen_config(), "DMMM"),
    (qwen_config(mlp_only_layers=()), "MMMM"),
    (qwen_config(mlp_only_layers=(1, 3)), "MDMD"),
    (qwen_config(mlp_only_layers=(), decoder_sparse_step=2), "DMDM"),
    (qwen_config(num_experts=0), "DDDD"),
    (SimpleNamespace(num_hidden_layers=2, decoder_sparse_step=1, num_experts=4), "MM"),
])
def test_qwen3_moe_layer_kinds_follow_mlp_only_layers_and_sparse_step(config, expected):
    assert layer_kinds(config, QWEN) == expected


@pytest.mark.parametrize("arch", [DSV2, DSV3])
@pytest.mark.parametrize("config, expected", [
    (deepseek_config(), "DMMM"),
    (deepseek_config(first_k_dense_replace=0), "MMMM"),
    (deepseek_config(first_k_dense_replace=3), "DDDM"),
    (deepseek_config(first_k_dense_replace=1, moe_layer_freq=2), "DDMD"),
    (deepseek_config(n_routed_experts=None), "DDDD"),
    (SimpleNamespace(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=4), "DMM"),
])
def test_deepseek_layer_kinds_follow_first_k_dense_and_frequency(arch, config, expected):
    assert layer_kinds(config, arch) == expected


@given(num_layers=st.integers(1, 12), first_k=st.integers(0, 12), freq=st.integers(1, 4))
@example(num_layers=1, first_k=0, freq=1)
def test_layer_kinds_agree_with_moe_layer_indices(num_layers, first_k, freq):
    config = deepseek_config(num_layers, first_k, freq)

    kinds = layer_kinds(config, DSV2)
    indices = moe_layer_indices(config, DSV2)

    assert len(kinds) == num_layers
    assert indices == tuple(i for i, kind in enumerate(kinds) if kind == "M")
    assert all(is_moe_layer(config, DSV2, i) == (kinds[i] == "M") for i in range(num_layers))


def test_num_routed_experts_reads_each_family_field():
    assert num_routed_experts(qwen_config(num_experts=128)) == 128
    assert num_routed_experts(deepseek_config(n_routed_experts=256)) == 256
    assert num_routed_experts(deepseek_config(n_routed_experts=None)) == 0


# ---- weight-role table (docs/models.md#weight-loading) --------------------------------------------------------------

# (checkpoint name, role with the gate on the FFN, role with the gate on attention)
QWEN_TABLE = [
    ("model.embed_tokens.weight", "attention", "attention"),
    ("model.norm.weight", "attention", "attention"),
    ("lm_head.weight", "attention", "attention"),
    ("model.layers.0.input_layernorm.weight", "attention", "attention"),
    ("model.layers.1.post_attention_layernorm.weight", "attention", "attention"),
    ("model.layers.1.self_attn.q_proj.weight", "attention", "attention"),
    ("model.layers.1.self_attn.q_norm.weight", "attention", "attention"),
    ("model.layers.1.self_attn.k_proj.k_scale", "attention", "attention"),
    ("model.layers.0.mlp.gate_proj.weight", "ffn", "attention"),  # dense (mlp_only_layers)
    ("model.layers.0.mlp.down_proj.weight", "ffn", "attention"),
    ("model.layers.1.mlp.gate.weight", "ffn", "attention"),  # router
    ("model.layers.1.mlp.experts.7.up_proj.weight", "ffn", "ffn"),
    ("model.layers.1.mlp.experts.7.up_proj.weight_scale", "ffn", "ffn"),
    ("model.layers.2.mlp.shared_expert.gate_proj.weight", "ffn", "ffn"),
    ("model.layers.2.mlp.shared_expert_gate.weight", "ffn", "ffn"),
    ("model.layers.4.mlp.experts.0.up_proj.weight", "drop", "drop"),  # past num_hidden_layers
]
DEEPSEEK_TABLE = [
    ("model.embed_tokens.weight", "attention", "attention"),
    ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "attention", "attention"),
    ("model.layers.2.self_attn.q_a_layernorm.weight", "attention", "attention"),
    ("model.layers.0.mlp.gate_proj.weight", "ffn", "attention"),  # dense (first_k_dense)
    ("model.layers.0.mlp.up_proj.weight_scale_inv", "ffn", "attention"),
    ("model.layers.1.mlp.gate.weight", "ffn", "attention"),
    ("model.layers.1.mlp.gate.e_score_correction_bias", "ffn", "both"),
    ("model.layers.3.mlp.experts.255.down_proj.weight", "ffn", "ffn"),
    ("model.layers.3.mlp.shared_experts.down_proj.weight", "ffn", "ffn"),
    ("model.layers.4.enorm.weight", "drop", "drop"),  # MTP layer
    ("model.layers.4.mlp.gate.weight", "drop", "drop"),
    ("model.layers.4.shared_head.head.weight", "drop", "drop"),
]


@pytest.mark.parametrize("gate_on_attention", [False, True])
@pytest.mark.parametrize("name, on_ffn, on_attention", QWEN_TABLE)
def test_qwen3_moe_weight_roles(name, on_ffn, on_attention, gate_on_attention):
    expected = on_attention if gate_on_attention else on_ffn

    assert weight_role(name, qwen_config(), QWEN, gate_on_attention) == expected


@pytest.mark.parametrize("arch", [DSV2, DSV3])
@pytest.mark.parametrize("gate_on_attention", [False, True])
@pytest.mark.parametrize("name, on_ffn, on_attention", DEEPSEEK_TABLE)
def test_deepseek_weight_roles(name, on_ffn, on_attention, gate_on_attention, arch):
    expected = on_attention if gate_on_attention else on_ffn

    assert weight_role(name, deepseek_config(), arch, gate_on_attention) == expected


def test_layer_segment_is_matched_whole_not_as_a_substring():
    config = deepseek_config(num_layers=2)

    assert weight_role("model.sublayers.9.mlp.gate.weight", config, DSV2, False) == "attention"
    assert weight_role("model.layers.1.mlp_norm.weight", config, DSV2, False) == "attention"
    assert weight_role("model.layers.12.mlp.gate.weight", config, DSV2, False) == "drop"


# ---- the one-shot filter ---------------------------------------------------------------------

ALL_NAMES = [name for name, _, _ in DEEPSEEK_TABLE]


class RecordingSource:
    """A checkpoint iterator that records how far it was pulled."""

    def __init__(self, names):
        self.names = list(names)
        self.num_pulled = 0

    def __iter__(self):
        for name in self.names:
            self.num_pulled += 1
            yield name, f"tensor:{name}"


@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_filter_passes_each_role_its_weights_in_checkpoint_order(gate_on_attention):
    config = deepseek_config()

    halves = {role: [name for name, _ in filter_weights(
        RecordingSource(ALL_NAMES), role, config, DSV3, gate_on_attention)]
        for role in ("attention", "ffn")}

    for role, names in halves.items():
        expected = [n for n in ALL_NAMES
                    if weight_role(n, config, DSV3, gate_on_attention) in (role, "both")]
        assert names == expected
    kept = set(halves["attention"]) | set(halves["ffn"])
    assert kept == {n for n in ALL_NAMES if weight_role(n, config, DSV3, gate_on_attention) != "drop"}
    shared = set(halves["attention"]) & set(halves["ffn"])
    assert shared == ({"model.layers.1.mlp.gate.e_score_correction_bias"} if gate_on_attention else set())


def test_filter_is_lazy_and_one_shot():
    source = RecordingSource(ALL_NAMES)

    filtered = filter_weights(source, "ffn", deepseek_config(), DSV2, False)

    assert source.num_pulled == 0
    first = next(filtered)
    assert first == ("model.layers.0.mlp.gate_proj.weight", "tensor:model.layers.0.mlp.gate_proj.weight")
    assert source.num_pulled == 4  # three attention names skipped, then the first FFN one
    assert iter(filtered) is filtered
    rest = list(filtered)
    assert len(rest) == 5 and list(filtered) == []


def test_filter_rejects_a_wrong_role_before_pulling_anything():
    source = RecordingSource(ALL_NAMES)

    with pytest.raises(ValueError, match=r"role must be one of \('attention', 'ffn'\), got 'both'"):
        filter_weights(source, "both", deepseek_config(), DSV2, False)

    assert source.num_pulled == 0


@given(st.lists(st.sampled_from(ALL_NAMES + [n for n, _, _ in QWEN_TABLE]), max_size=30),
       st.booleans())
def test_filter_partitions_any_checkpoint_between_the_roles(names, gate_on_attention):
    config = deepseek_config()

    attention = list(filter_weights(RecordingSource(names), "attention", config, DSV2, gate_on_attention))
    ffn = list(filter_weights(RecordingSource(names), "ffn", config, DSV2, gate_on_attention))

    for name in names:
        owner = weight_role(name, config, DSV2, gate_on_attention)
        count = (attention.count((name, f"tensor:{name}")), ffn.count((name, f"tensor:{name}")))
        expected_per_occurrence = {"attention": (1, 0), "ffn": (0, 1), "both": (1, 1), "drop": (0, 0)}[owner]
        occurrences = names.count(name)
        assert count == tuple(occurrences * c for c in expected_per_occurrence)
