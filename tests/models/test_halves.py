"""Both halves against the native model, built in-process from the same tiny checkpoints.

For every architecture and gate placement: each half holds exactly its role's parameters
(docs/models.md) and loads them through the native loader's strict check; the FFN
half's outputs equal the native `mlp` outputs bit for bit; misuse fails loudly.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from models_support import MLA_OFF, afd, random_hidden  # noqa: E402
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner  # noqa: E402
from vllm.model_executor.models import deepseek_v2 as ds  # noqa: E402
from vllm.model_executor.models import qwen3_moe as qw  # noqa: E402

from vllm_afd.models import deepseek_v2 as afd_ds  # noqa: E402
from vllm_afd.models import qwen3_moe as afd_qw  # noqa: E402
from vllm_afd.models.base import RemoteDenseProxy  # noqa: E402
from vllm_afd.models.split import layer_kinds, moe_layer_indices, weight_role  # noqa: E402

ARCHS = {
    # tiny dir: (alias, native MoE block, checkpoint architecture, env)
    "qwen3_moe": (afd_qw.AFDQwen3MoeForCausalLM, qw.Qwen3MoeSparseMoeBlock, "Qwen3MoeForCausalLM", {}),
    "deepseek_v2": (afd_ds.AFDDeepseekV2ForCausalLM, ds.DeepseekV2MoE, "DeepseekV2ForCausalLM", MLA_OFF),
    "deepseek_v3": (afd_ds.AFDDeepseekV3ForCausalLM, ds.DeepseekV2MoE, "DeepseekV3ForCausalLM", MLA_OFF),
}


@pytest.fixture(scope="module")
def zoo(build, tiny_model_dirs):
    """`zoo(arch)` -> native; `zoo(arch, role, gate_on_attention)` -> that half (built once)."""
    cache = {}

    def get(arch, role=None, gate_on_attention=False):
        key = (arch, role, gate_on_attention)
        if key not in cache:
            alias, _, _, env = ARCHS[arch]
            if role is None:
                cache[key] = build(tiny_model_dirs[arch], env=env)
            else:
                cache[key] = build(tiny_model_dirs[arch], alias, afd(role, gate_on_attention), env=env)
        return cache[key]

    return get


def hidden_for(built, num_tokens, seed):
    config = built.config.model_config
    return random_hidden(num_tokens, config.hf_text_config.hidden_size, config.dtype, seed)


@pytest.mark.parametrize("gate_on_attention", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_each_half_holds_exactly_its_roles_parameters(zoo, arch, gate_on_attention):
    native = zoo(arch)
    halves = {role: zoo(arch, role, gate_on_attention) for role in ("attention", "ffn")}
    hf_config, checkpoint_arch = native.config.model_config.hf_text_config, ARCHS[arch][2]

    def role_of(name):
        return weight_role(name, hf_config, checkpoint_arch, gate_on_attention)

    for role, half in halves.items():
        assert {role_of(name) for name in half.param_names()} <= {role, "both"}, role
    attention, ffn = halves["attention"].param_names(), halves["ffn"].param_names()
    assert attention | ffn == native.param_names()
    assert attention & ffn == {name for name in native.param_names() if role_of(name) == "both"}
    assert len(ffn) > 0 and len(attention) > 0


@pytest.mark.parametrize("gate_on_attention", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_each_half_registers_only_its_roles_layers(zoo, arch, gate_on_attention):
    """Attention layers (KV cache) only on attention, fused-MoE layers only on the FFN."""
    native = zoo(arch)
    moe = moe_layer_indices(native.config.model_config.hf_text_config, ARCHS[arch][2])

    attention, ffn = (set(zoo(arch, role, gate_on_attention).config.compilation_config
                          .static_forward_context) for role in ("attention", "ffn"))

    assert attention and all(".self_attn." in name for name in attention)
    assert ffn == {f"model.layers.{idx}.mlp.experts" for idx in moe}
    assert attention | ffn == set(native.config.compilation_config.static_forward_context)


@pytest.mark.parametrize("arch", ARCHS)
def test_afd_config_is_read_once_per_model(build, tiny_model_dirs, monkeypatch, arch):
    from vllm_afd.models import base

    alias, env = ARCHS[arch][0], ARCHS[arch][3]
    read, callers = base.afd_config_of, []

    def recording(src, caller, *args, **kwargs):
        callers.append(caller)
        return read(src, caller, *args, **kwargs)

    monkeypatch.setattr(base, "afd_config_of", recording)

    build(tiny_model_dirs[arch], alias, afd("ffn", True), env=env)

    assert callers == [alias.__name__]


@pytest.mark.parametrize("arch", ARCHS)
def test_layer_kinds_agree_with_the_native_modules(zoo, arch):
    native = zoo(arch)
    block_cls, checkpoint_arch = ARCHS[arch][1], ARCHS[arch][2]

    built_kinds = "".join("M" if isinstance(layer.mlp, block_cls) else "D"
                          for layer in native.model.model.layers)

    assert layer_kinds(native.config.model_config.hf_text_config, checkpoint_arch) == built_kinds
    assert "D" in built_kinds and "M" in built_kinds


@pytest.mark.parametrize("arch", ARCHS)
def test_attention_mlp_slots_hold_parameter_free_proxies(zoo, arch):
    half = zoo(arch, "attention", False)
    block_cls = ARCHS[arch][1]
    num_experts = half.model.num_routed_experts

    for idx, layer in enumerate(half.model.model.layers):
        mlp = layer.mlp
        assert list(mlp.parameters()) == [] and list(mlp.buffers()) == []
        assert mlp.layer_idx == idx
        if idx in half.model.get_experts_layer_indices():
            assert isinstance(mlp, block_cls) and mlp.gate is None
            assert (mlp.n_routed_experts, mlp.n_logical_experts, mlp.n_local_physical_experts) == (
                num_experts, num_experts, 0)
        else:
            assert type(mlp) is RemoteDenseProxy


@pytest.mark.parametrize("arch", ARCHS)
def test_gate_on_attention_proxies_hold_the_native_router(zoo, arch):
    half = zoo(arch, "attention", True)
    native = zoo(arch)

    for idx in half.model.get_experts_layer_indices():
        proxy, native_block = half.model.model.layers[idx].mlp, native.model.model.layers[idx].mlp
        assert type(proxy.gate) is type(native_block.gate)
        own = dict(proxy.named_parameters())
        assert set(own) == {f"gate.{name}" for name, _ in native_block.gate.named_parameters()}
        for name, param in native_block.gate.named_parameters():
            assert torch.equal(own[f"gate.{name}"], param), name


@pytest.mark.parametrize("num_tokens", [1, 7])
@pytest.mark.parametrize("arch", ARCHS)
def test_ffn_half_reproduces_every_native_mlp(zoo, arch, num_tokens):
    native, ffn = zoo(arch), zoo(arch, "ffn", False)

    for idx, layer in enumerate(native.model.model.layers):
        hidden = hidden_for(native, num_tokens, seed=idx)
        expected = native.run(lambda: layer.mlp(hidden))
        actual = ffn.run(lambda: ffn.model.compute_ffn_output(hidden, idx))
        assert actual.shape == expected.shape and actual.dtype == expected.dtype
        assert torch.equal(actual, expected), f"layer {idx}: {diagnose(native, ffn, layer, hidden, idx)}"


def diagnose(native, ffn, layer, hidden, idx) -> str:
    """What a mismatch looks like on a second try (a one-off NaN in CI's CPU kernels, once in 32 runs)."""
    again = ffn.run(lambda: ffn.model.compute_ffn_output(hidden.clone(), idx))
    native_again = native.run(lambda: layer.mlp(hidden.clone()))
    return (f"input NaN {bool(hidden.isnan().any())}; FFN half again NaN {bool(again.isnan().any())}, "
            f"== native again {torch.equal(again, native_again)}; native again NaN {bool(native_again.isnan().any())}")


@pytest.mark.parametrize("arch", ARCHS)
def test_gate_on_attention_halves_reproduce_every_native_mlp(zoo, arch):
    native, attention, ffn = zoo(arch), zoo(arch, "attention", True), zoo(arch, "ffn", True)
    moe_layers = ffn.model.get_experts_layer_indices()

    for idx, layer in enumerate(native.model.model.layers):
        hidden = hidden_for(native, 5, seed=100 + idx)
        expected = native.run(lambda: layer.mlp(hidden))
        own_mlp = attention.model.model.layers[idx].mlp
        if idx in moe_layers:
            logits, _ = attention.run(lambda: own_mlp.gate(hidden))
            actual = ffn.run(lambda: ffn.model.compute_experts_output(hidden, idx, logits))
        else:
            actual = attention.run(lambda: own_mlp(hidden))
        assert torch.equal(actual, expected), f"layer {idx}"


@pytest.mark.parametrize("arch", ARCHS)
def test_experts_route_by_the_logits_they_are_given(zoo, arch):
    attention, ffn = zoo(arch, "attention", True), zoo(arch, "ffn", True)
    idx = ffn.model.get_experts_layer_indices()[0]
    hidden = hidden_for(ffn, 6, seed=7)
    logits, _ = attention.run(lambda: attention.model.model.layers[idx].mlp.gate(hidden))

    routed = ffn.run(lambda: ffn.model.compute_experts_output(hidden, idx, logits))
    reversed_routing = ffn.run(lambda: ffn.model.compute_experts_output(hidden, idx, -logits))

    assert not torch.equal(routed, reversed_routing)
    assert isinstance(ffn.model.model.layers[idx].mlp.experts, MoERunner)
    assert ffn.model.model.layers[idx].mlp.experts.gate is None


@pytest.mark.parametrize("arch", ARCHS)
def test_routing_spec_describes_the_attention_routers_output(zoo, arch):
    attention, ffn = zoo(arch, "attention", True), zoo(arch, "ffn", True)
    hidden = hidden_for(ffn, 3, seed=3)

    for idx in ffn.model.get_experts_layer_indices():
        spec = ffn.model.get_experts_routing_spec(idx)
        logits, _ = attention.run(lambda: attention.model.model.layers[idx].mlp.gate(hidden))
        assert spec == (logits.shape[1], logits.dtype)
        assert attention.model.get_experts_routing_spec(idx) == spec
    with pytest.raises(RuntimeError, match="layer 0 is dense; expected a MoE layer"):
        ffn.model.get_experts_routing_spec(0)


@pytest.mark.parametrize("gate_on_attention", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_only_the_ffn_half_counts_fused_moe_layers(zoo, arch, gate_on_attention):
    native = zoo(arch)
    halves = {role: zoo(arch, role, gate_on_attention).model for role in ("attention", "ffn")}
    moe = moe_layer_indices(native.config.model_config.hf_text_config, ARCHS[arch][2])

    assert halves["ffn"].get_experts_layer_indices() == moe
    assert halves["ffn"].num_moe_layers == len(moe) and halves["attention"].num_moe_layers == 0
    assert all(isinstance(runner, MoERunner) for runner in halves["ffn"].moe_layers)
    assert halves["attention"].moe_layers == []
    for half in halves.values():
        for name in ("num_logical_experts", "num_physical_experts", "num_routed_experts",
                     "num_redundant_experts", "num_expert_groups", "num_shared_experts"):
            assert getattr(half, name) == getattr(native.model, name), name


MISUSE = [
    # (role, gate_on_attention, call, error type, message)
    ("attention", False, lambda m, h: m.compute_ffn_output(h, 1), RuntimeError,
     "built for role 'attention'; expected 'ffn'"),
    ("ffn", False, lambda m, h: m.compute_experts_output(h, 1, h[:, :8]), RuntimeError,
     "the FFN runs the router"),
    ("ffn", True, lambda m, h: m.compute_ffn_output(h, 0), RuntimeError,
     "Dense layers are computed on the Attention side when compute_gate_on_attention=true"),
    ("ffn", True, lambda m, h: m.compute_ffn_output(h, 1), RuntimeError,
     "Attention-side gate must call compute_experts_output"),
    ("ffn", True, lambda m, h: m.compute_experts_output(h, 0, h[:, :8]), RuntimeError,
     "layer 0 is dense"),
    ("ffn", False, lambda m, h: m.compute_ffn_output(h, 3), IndexError,
     "layer_idx 3 out of range; expected 0 <= layer_idx < 3"),
]


@pytest.mark.parametrize("role, gate_on_attention, call, error, message", MISUSE)
def test_compute_entry_points_refuse_misuse(zoo, role, gate_on_attention, call, error, message):
    half = zoo("qwen3_moe", role, gate_on_attention)

    with pytest.raises(error, match=message):
        call(half.model, hidden_for(half, 2, seed=0))


@pytest.mark.parametrize("arch", ARCHS)
def test_alias_without_afd_config_is_refused(build, tiny_model_dirs, arch):
    alias, env = ARCHS[arch][0], ARCHS[arch][3]

    with pytest.raises(ValueError, match=rf'{alias.__name__} requires additional_config\["afd"\]'):
        build(tiny_model_dirs[arch], alias, afd=None, env=env)


def test_an_alias_never_parses_the_config_a_second_time(tiny_model_dirs):
    """The worker parses once; a config that does not carry that parse is a bug, not a second parse."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    from tests.connectors._vllm_configs import skip_without_cpu_configs

    skip_without_cpu_configs()
    config = EngineArgs(model=str(tiny_model_dirs["qwen3_moe"]), enforce_eager=True, skip_tokenizer_init=True,
                        additional_config={"afd": afd("ffn")}).create_engine_config()

    with set_current_vllm_config(config), pytest.raises(AssertionError, match="parsed once per worker"):
        afd_qw.AFDQwen3MoeForCausalLM(vllm_config=config)
