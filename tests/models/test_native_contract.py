"""What the AFD model classes assume of vLLM 0.30.0's native model code (AFD_SPEC §7.1, §10).

Signatures of the native constructors the aliases call or mirror, the inherited `forward`s,
and, on built models, that every plain attribute and child a native `__init__` sets is also
set by its AFD counterpart (the inherited methods read them).
"""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("vllm")

from models_support import MLA_OFF, afd  # noqa: E402
from torch import nn  # noqa: E402
from vllm.model_executor.layers.fused_moe import FusedMoEFactory, GateLinear  # noqa: E402
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner  # noqa: E402
from vllm.model_executor.models import deepseek_v2 as ds  # noqa: E402
from vllm.model_executor.models import qwen3_moe as qw  # noqa: E402

from vllm_afd.models import deepseek_v2 as afd_ds  # noqa: E402
from vllm_afd.models import qwen3_moe as afd_qw  # noqa: E402


def params(fn):
    return list(inspect.signature(fn).parameters)


PINNED_SIGNATURES = [
    (qw.Qwen3MoeForCausalLM.__init__, ["self", "vllm_config", "prefix"]),
    (qw.Qwen3MoeDecoderLayer.__init__, ["self", "vllm_config", "prefix", "is_fused_checkpoint_transposed"]),
    (qw.Qwen3MoeSparseMoeBlock.__init__, ["self", "vllm_config", "prefix", "is_fused_checkpoint_transposed"]),
    (qw.Qwen3MoeMLP.__init__, ["self", "hidden_size", "intermediate_size", "hidden_act", "quant_config",
                               "reduce_results", "expert_gate", "prefix"]),
    (qw.Qwen3MoeAttention.__init__, ["self", "hidden_size", "num_heads", "num_kv_heads", "rope_parameters",
                                     "max_position_embeddings", "head_dim", "rms_norm_eps", "qkv_bias",
                                     "cache_config", "quant_config", "prefix", "dual_chunk_attention_config"]),
    (ds.DeepseekV2ForCausalLM.__init__, ["self", "vllm_config", "prefix"]),
    (ds.DeepseekV2DecoderLayer.__init__, ["self", "vllm_config", "prefix", "config", "topk_indices_buffer",
                                          "index_group_builder"]),
    (ds.DeepseekV2MoE.__init__, ["self", "config", "parallel_config", "quant_config", "reduce_results",
                                 "prefix", "apply_routed_scale_to_output"]),
    (ds.DeepseekV2MLP.__init__, ["self", "hidden_size", "intermediate_size", "hidden_act", "quant_config",
                                 "reduce_results", "is_sequence_parallel", "prefix"]),
    (ds.DeepseekV2Attention.__init__, ["self", "vllm_config", "config", "hidden_size", "num_heads",
                                       "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank",
                                       "kv_lora_rank", "max_position_embeddings", "cache_config",
                                       "quant_config", "topk_indices_buffer", "reduce_results", "prefix"]),
    (ds.DeepseekV2MLAAttention.__init__, ["self", "vllm_config", "config", "hidden_size", "num_heads",
                                          "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                          "q_lora_rank", "kv_lora_rank", "max_position_embeddings",
                                          "cache_config", "quant_config", "prefix", "topk_indices_buffer",
                                          "index_group_builder", "input_size", "reduce_results",
                                          "non_causal_multi_token_decode"]),
    (GateLinear.__init__, ["self", "input_size", "output_size", "bias", "out_dtype", "params_dtype",
                           "force_fp32_compute", "prefix"]),
    (MoERunner.forward, ["self", "hidden_states", "router_logits", "input_ids", "shared_experts_input"]),
]


@pytest.mark.parametrize("fn, expected", PINNED_SIGNATURES, ids=lambda x: getattr(x, "__qualname__", ""))
def test_native_signatures_are_the_pinned_ones(fn, expected):
    assert params(fn) == expected


def test_fused_moe_factory_still_takes_every_argument_the_experts_blocks_pass():
    used = {"shared_experts", "gate", "num_experts", "top_k", "hidden_size", "intermediate_size",
            "renormalize", "quant_config", "prefix", "enable_eplb", "num_redundant_experts",
            "is_sequence_parallel", "is_fused_checkpoint_transposed", "use_grouped_topk",
            "num_expert_group", "topk_group", "scoring_func", "routed_scaling_factor",
            "apply_routed_scale_to_output", "e_score_correction_bias", "reduce_results",
            "router_logits_dtype"}

    assert used <= set(params(FusedMoEFactory))


@pytest.mark.parametrize("ours, native", [
    (afd_qw.AFDQwen3MoeDecoderLayer, qw.Qwen3MoeDecoderLayer),
    (afd_ds.AFDDeepseekV2DecoderLayer, ds.DeepseekV2DecoderLayer),
    (afd_qw.AFDQwen3MoeExperts, qw.Qwen3MoeSparseMoeBlock),
    (afd_ds.AFDDeepseekV2Experts, ds.DeepseekV2MoE),
])
def test_afd_constructors_keep_the_native_signatures(ours, native):
    assert params(ours.__init__) == params(native.__init__)


@pytest.mark.parametrize("ours, native, names", [
    (afd_qw.AFDQwen3MoeDecoderLayer, qw.Qwen3MoeDecoderLayer, ["forward"]),
    (afd_ds.AFDDeepseekV2DecoderLayer, ds.DeepseekV2DecoderLayer, ["forward"]),
    (afd_qw.AFDQwen3MoeModel, qw.Qwen3MoeModel, ["forward", "load_weights", "embed_input_ids"]),
    (afd_ds.AFDDeepseekV2Model, ds.DeepseekV2Model, ["forward", "load_weights", "embed_input_ids"]),
    (afd_qw.AFDQwen3MoeForCausalLM, qw.Qwen3MoeForCausalLM, ["forward", "compute_logits"]),
    (afd_ds.AFDDeepseekV2ForCausalLM, ds.DeepseekV2ForCausalLM, ["forward", "compute_logits"]),
    (afd_ds.AFDDeepseekV3ForCausalLM, ds.DeepseekV3ForCausalLM, ["forward", "compute_logits"]),
])
def test_forward_and_loaders_are_inherited_unchanged(ours, native, names):
    for name in names:
        assert getattr(ours, name) is getattr(native, name), name


@pytest.mark.parametrize("ours, native", [
    (afd_qw.AFDQwen3MoeForCausalLM, qw.Qwen3MoeForCausalLM),
    (afd_ds.AFDDeepseekV2ForCausalLM, ds.DeepseekV2ForCausalLM),
    (afd_ds.AFDDeepseekV3ForCausalLM, ds.DeepseekV3ForCausalLM),
    (afd_qw.AFDQwen3MoeProxy, qw.Qwen3MoeSparseMoeBlock),
    (afd_ds.AFDDeepseekV2MoEProxy, ds.DeepseekV2MoE),
])
def test_afd_classes_are_native_subclasses(ours, native):
    assert issubclass(ours, native)


def test_alias_load_weights_wraps_the_native_loader():
    for alias in (afd_qw.AFDQwen3MoeForCausalLM, afd_ds.AFDDeepseekV2ForCausalLM):
        assert alias.load_weights is not alias.__mro__[2].load_weights
        assert alias.__mro__[2].load_weights is alias.__mro__[2].__dict__["load_weights"]


EXPERTS_BLOCKS = (afd_qw.AFDQwen3MoeExperts, afd_ds.AFDDeepseekV2Experts)


def state(module: nn.Module) -> tuple[set[str], set[str]]:
    """(plain attribute names, child module names) a module's constructor set."""
    attributes = {k for k in vars(module) if not k.startswith("_")} - {"training"}
    return attributes, set(dict(module.named_children()))


def pairs(native, half):
    """(native module, AFD module) pairs at every level the AFD classes reimplement."""
    yield native.model, half.model
    yield native.model.model, half.model.model
    for native_layer, afd_layer in zip(native.model.model.layers, half.model.model.layers):
        yield native_layer, afd_layer
        if isinstance(afd_layer.mlp, EXPERTS_BLOCKS):
            yield native_layer.mlp, afd_layer.mlp


CASES = [("qwen3_moe", afd_qw.AFDQwen3MoeForCausalLM, {}),
         ("deepseek_v2", afd_ds.AFDDeepseekV2ForCausalLM, MLA_OFF),
         ("deepseek_v2_mla", afd_ds.AFDDeepseekV2ForCausalLM, {}),
         ("deepseek_v3", afd_ds.AFDDeepseekV3ForCausalLM, MLA_OFF)]


@pytest.mark.parametrize("arch, alias, env", CASES, ids=[c[0] for c in CASES])
def test_afd_modules_set_every_attribute_and_child_of_the_native_ones(build, tiny_model_dirs, arch, alias, env):
    native = build(tiny_model_dirs[arch], env=env)
    halves = [build(tiny_model_dirs[arch], alias, afd(role, gate), env=env)
              for role in ("attention", "ffn") for gate in (False, True)]

    for half in halves:
        for native_module, afd_module in pairs(native, half):
            native_attrs, native_children = state(native_module)
            afd_attrs, afd_children = state(afd_module)
            where = f"{type(afd_module).__name__} ({half.model.afd_role})"
            assert native_attrs - {"compiled", "was_aot_compile_fn_loaded_from_disk"} <= afd_attrs, where
            # The experts-only blocks hold no router (a DeepSeek noaux_tc one keeps its bias).
            no_router = {"gate"} if isinstance(afd_module, EXPERTS_BLOCKS) else set()
            assert native_children - no_router <= afd_children <= native_children, where
