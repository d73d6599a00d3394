"""What the AFD model classes assume of the native model code of each supported vLLM release
(docs/models.md; the release differences: overlay/vllm_afd/releases.py).

The AFD classes run the native constructors and pick modules through the model seams of
`patches/` (docs/hooks.md): pinned here are the seams' native defaults, the signatures of the
native constructors whose arguments the AFD stand-ins accept, the inherited `forward`s and
loaders, that only the proxies skip a native constructor, and, on built models, that every
plain attribute and child a native `__init__` sets is also set on its AFD counterpart.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from models_support import MLA_OFF, afd  # noqa: E402
from torch import nn  # noqa: E402
from vllm.model_executor.layers.fused_moe import GateLinear  # noqa: E402
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner  # noqa: E402
from vllm.model_executor.layers.layernorm import RMSNorm  # noqa: E402
from vllm.model_executor.layers.linear import ReplicatedLinear  # noqa: E402
from vllm.model_executor.layers.vocab_parallel_embedding import (  # noqa: E402
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.models import deepseek_v2 as ds  # noqa: E402
from vllm.model_executor.models import qwen3_moe as qw  # noqa: E402

from vllm_afd.models import deepseek_v2 as afd_ds  # noqa: E402
from vllm_afd.models import qwen3_moe as afd_qw  # noqa: E402
from vllm_afd.releases import installed  # noqa: E402

RELEASE = installed()


def resolve(qualified: str) -> type:
    module, _, name = qualified.rpartition(".")
    return vars(importlib.import_module(module))[name]


def params(fn):
    return list(inspect.signature(fn).parameters)


# (native class, seam attribute, its native default): the seams the AFD classes override.
SEAM_DEFAULTS = [
    (qw.Qwen3MoeSparseMoeBlock, "gate_cls", resolve(RELEASE.qwen3_moe_gate_cls)),
    (qw.Qwen3MoeSparseMoeBlock, "experts_apply_gate", True),
    (qw.Qwen3MoeDecoderLayer, "self_attn_cls", qw.Qwen3MoeAttention),
    (qw.Qwen3MoeDecoderLayer, "moe_block_cls", qw.Qwen3MoeSparseMoeBlock),
    (qw.Qwen3MoeDecoderLayer, "mlp_cls", qw.Qwen3MoeMLP),
    (qw.Qwen3MoeDecoderLayer, "norm_cls", RMSNorm),
    (qw.Qwen3MoeModel, "embed_tokens_cls", VocabParallelEmbedding),
    (qw.Qwen3MoeModel, "norm_cls", RMSNorm),
    (qw.Qwen3MoeForCausalLM, "model_cls", qw.Qwen3MoeModel),
    (qw.Qwen3MoeForCausalLM, "lm_head_cls", ParallelLMHead),
    (ds.DeepseekV2MoE, "gate_cls", GateLinear),
    (ds.DeepseekV2MoE, "experts_apply_gate", True),
    (ds.DeepseekV2DecoderLayer, "self_attn_cls", None),
    (ds.DeepseekV2DecoderLayer, "moe_block_cls", ds.DeepseekV2MoE),
    (ds.DeepseekV2DecoderLayer, "mlp_cls", ds.DeepseekV2MLP),
    (ds.DeepseekV2DecoderLayer, "norm_cls", RMSNorm),
    (ds.DeepseekV2Model, "embed_tokens_cls", VocabParallelEmbedding),
    (ds.DeepseekV2Model, "decoder_layer_cls", ds.DeepseekV2DecoderLayer),
    (ds.DeepseekV2Model, "norm_cls", RMSNorm),
    (ds.DeepseekV2ForCausalLM, "model_cls", ds.DeepseekV2Model),
    (ds.DeepseekV2ForCausalLM, "lm_head_cls", ParallelLMHead),
]


@pytest.mark.parametrize("native, name, default", SEAM_DEFAULTS,
                         ids=[f"{c.__name__}.{n}" for c, n, _ in SEAM_DEFAULTS])
def test_installed_vllm_has_the_model_seams_with_native_defaults(native, name, default):
    assert vars(native)[name] is default


# Native constructors whose arguments an AFD stand-in accepts in its place (proxies, the dense
# proxy's `prefix`), or which it calls itself (the proxies' routers), and what the experts call.
PINNED_SIGNATURES = [
    (qw.Qwen3MoeForCausalLM.__init__, ["self", "vllm_config", "prefix"]),
    (qw.Qwen3MoeSparseMoeBlock.__init__, ["self", "vllm_config", "prefix", "is_fused_checkpoint_transposed"]),
    (qw.Qwen3MoeMLP.__init__, ["self", "hidden_size", "intermediate_size", "hidden_act", "quant_config",
                               "reduce_results", "expert_gate", "prefix"]),
    (ds.DeepseekV2ForCausalLM.__init__, ["self", "vllm_config", "prefix"]),
    (ds.DeepseekV2ForCausalLM.set_moe_parameters, ["self"]),
    (ds.DeepseekV2MoE.__init__, ["self", "config", "parallel_config", "quant_config", "reduce_results",
                                 "prefix", "apply_routed_scale_to_output"]),
    (ds.DeepseekV2MLP.__init__, ["self", "hidden_size", "intermediate_size", "hidden_act", "quant_config",
                                 "reduce_results", "is_sequence_parallel", "prefix"]),
    (ReplicatedLinear.__init__, ["self", "input_size", "output_size", "bias", "skip_bias_add", "params_dtype",
                                 "quant_config", "prefix", "return_bias", "disable_tp"]),
    (GateLinear.__init__, ["self", "input_size", "output_size", "bias", "out_dtype", "params_dtype",
                           "force_fp32_compute", "prefix"]),
    (MoERunner.forward, ["self", "hidden_states", "router_logits", "input_ids", "shared_experts_input"]),
]


# Where a release's signature differs from 0.30.0's: {version: {qualname: parameters}}.  The
# AFD routers pass keywords both releases accept (bias, quant_config, prefix).
_GATE_LINEAR_SINCE_0_32 = ["self", "input_size", "output_size", "bias", "out_dtype", "params_dtype",
                           "force_fp32_compute", "skip_bias_add", "quant_config", "prefix", "return_bias"]
RELEASE_SIGNATURES = {
    "0.32.0": {"GateLinear.__init__": _GATE_LINEAR_SINCE_0_32},
    "0.34.0": {"GateLinear.__init__": _GATE_LINEAR_SINCE_0_32},
}


@pytest.mark.parametrize("fn, expected", PINNED_SIGNATURES, ids=lambda x: getattr(x, "__qualname__", ""))
def test_native_signatures_are_the_pinned_ones(fn, expected):
    assert params(fn) == RELEASE_SIGNATURES.get(RELEASE.version, {}).get(fn.__qualname__, expected)


@pytest.mark.parametrize("proxy, native", [
    (afd_qw.AFDQwen3MoeProxy, qw.Qwen3MoeSparseMoeBlock),
    (afd_ds.AFDDeepseekV2MoEProxy, ds.DeepseekV2MoE),
])
def test_moe_proxies_take_the_native_block_arguments(proxy, native):
    assert params(proxy.__init__) == params(native.__init__) + ["gate_on_attention"]


@pytest.mark.parametrize("ours, native, names", [
    (afd_qw.AFDQwen3MoeDecoderLayer, qw.Qwen3MoeDecoderLayer, ["forward"]),
    (afd_ds.AFDDeepseekV2DecoderLayer, ds.DeepseekV2DecoderLayer, ["forward"]),
    (afd_qw.AFDQwen3MoeModel, qw.Qwen3MoeModel, ["forward", "load_weights", "embed_input_ids", "__call__"]),
    (afd_ds.AFDDeepseekV2Model, ds.DeepseekV2Model, ["forward", "load_weights", "embed_input_ids", "__call__"]),
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
    (afd_qw.AFDQwen3MoeModel, qw.Qwen3MoeModel),
    (afd_ds.AFDDeepseekV2Model, ds.DeepseekV2Model),
    (afd_qw.AFDQwen3MoeDecoderLayer, qw.Qwen3MoeDecoderLayer),
    (afd_ds.AFDDeepseekV2DecoderLayer, ds.DeepseekV2DecoderLayer),
    (afd_qw.AFDQwen3MoeExperts, qw.Qwen3MoeSparseMoeBlock),
    (afd_ds.AFDDeepseekV2Experts, ds.DeepseekV2MoE),
    (afd_qw.AFDQwen3MoeProxy, qw.Qwen3MoeSparseMoeBlock),
    (afd_ds.AFDDeepseekV2MoEProxy, ds.DeepseekV2MoE),
])
def test_afd_classes_are_native_subclasses(ours, native):
    assert issubclass(ours, native)


def test_alias_load_weights_wraps_the_native_loader():
    for alias in (afd_qw.AFDQwen3MoeForCausalLM, afd_ds.AFDDeepseekV2ForCausalLM):
        assert alias.load_weights is not alias.__mro__[2].load_weights
        assert alias.__mro__[2].load_weights is alias.__mro__[2].__dict__["load_weights"]


ALIAS_MODULES = [afd_qw, afd_ds]
# Classes that never run their native base's constructor (it would build the experts).
PROXIES = {"AFDQwen3MoeProxy", "AFDDeepseekV2MoEProxy"}


def class_defs(module):
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    return [node for node in tree.body if isinstance(node, ast.ClassDef)]


@pytest.mark.parametrize("module", ALIAS_MODULES, ids=lambda m: m.__name__)
def test_only_the_proxies_replace_a_native_constructor(module):
    for cls in class_defs(module):
        inits = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
        calls = {ast.unparse(node.func) for init in inits for node in ast.walk(init)
                 if isinstance(node, ast.Call)}
        if cls.name in PROXIES:
            assert "self.init_proxy" in calls, cls.name
        elif inits and cls.name.startswith("AFD"):
            assert "super().__init__" in calls, cls.name
        assert "nn.Module.__init__" not in calls, cls.name


@pytest.mark.parametrize("module", ALIAS_MODULES, ids=lambda m: m.__name__)
def test_afd_properties_override_native_seams_only(module):
    for cls in class_defs(module):
        ours = getattr(module, cls.name)
        native = next((base for base in ours.__mro__ if base.__module__.startswith("vllm.")), None)
        for name, value in vars(ours).items() if native is not None else ():
            if isinstance(value, property):
                assert name in dir(native), f"{cls.name}.{name}: no such seam on {native.__name__}"


EXPERTS_BLOCKS = (afd_qw.AFDQwen3MoeExperts, afd_ds.AFDDeepseekV2Experts)


def state(module: nn.Module) -> tuple[set[str], set[str]]:
    """(plain attribute names, child module names) a module's constructor set."""
    attributes = {k for k in vars(module) if not k.startswith("_")} - {"training"}
    return attributes, set(dict(module.named_children()))


def pairs(native, half):
    """(native module, AFD module) pairs at every level the AFD classes subclass."""
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
            where = f"{type(afd_module).__name__} ({half.model.afd_settings.role})"
            assert native_attrs - {"compiled", "was_aot_compile_fn_loaded_from_disk"} <= afd_attrs, where
            assert native_children == afd_children, where
