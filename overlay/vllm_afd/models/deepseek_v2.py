"""`AFDDeepseekV2ForCausalLM` / `AFDDeepseekV3ForCausalLM`: DeepSeek split at the FFN boundary.

Subclasses of the native vLLM 0.30.0 classes (`vllm/model_executor/models/deepseek_v2.py`).
Their `__init__`s build only the role's modules, with the native classes, arguments and
prefixes; the decoder layer's `forward` (FP16 overflow guards included), the model body's
`forward` and hand-written `load_weights`, and `compute_logits` are inherited unchanged.
Attention keeps whichever native attention the config selects: MLA when
`model_config.use_mla` (GPU), the MHA formulation with `VLLM_MLA_DISABLE=1` (CPU).
DeepSeek-V3.2's sparse attention (`index_topk`) and ROCm AITER shared-expert fusion are out
of scope and refused.
"""

from __future__ import annotations

import typing

import torch
from torch import nn
from vllm._aiter_ops import rocm_aiter_ops
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import (
    get_ep_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from vllm.model_executor.layers.fused_moe import FusedMoEFactory, GateLinear
from vllm.model_executor.layers.fused_moe.utils import is_model_fused_shared_expert_compatible
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.deepseek_v2 import (
    DeepseekAttention,
    DeepseekV2Attention,
    DeepseekV2DecoderLayer,
    DeepseekV2ForCausalLM,
    DeepseekV2MLAAttention,
    DeepseekV2MLP,
    DeepseekV2Model,
    DeepseekV2MoE,
    DeepseekV3ForCausalLM,
    _get_moe_router_dtype,
)
from vllm.model_executor.models.utils import (
    PPMissingLayer,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)
from vllm.platforms import current_platform

from vllm_afd.models.base import (
    AFDCausalLMMixin,
    copy_packed_modules_mapping,
    mlp_kind,
    read_afd_settings,
    role_norm,
)
from vllm_afd.models.proxy import RemoteFFNProxy, RemoteMoEProxyMixin
from vllm_afd.models.split import is_moe_layer

__all__ = [
    "AFDDeepseekV2DecoderLayer",
    "AFDDeepseekV2Experts",
    "AFDDeepseekV2ForCausalLM",
    "AFDDeepseekV2MoEProxy",
    "AFDDeepseekV2Model",
    "AFDDeepseekV3ForCausalLM",
]

# The split rules are the same for V2 and V3 (and the model body is shared).
ARCHITECTURE = "DeepseekV2ForCausalLM"


def _uses_mha(config: typing.Any) -> bool:
    """The native `use_mha` test (DeepSeek-V1 style attention, no MLA head dims)."""
    dims = (getattr(config, "qk_nope_head_dim", 0), getattr(config, "qk_rope_head_dim", 0))
    return config.model_type == "deepseek" or all(dim == 0 for dim in dims)


def _uses_correction_bias(config: typing.Any) -> bool:
    return getattr(config, "topk_method", None) == "noaux_tc"


def _router(config: typing.Any, prefix: str) -> GateLinear:
    """The native router of `DeepseekV2MoE` (`<prefix>.gate`, with its correction bias)."""
    gate = GateLinear(
        config.hidden_size,
        config.n_routed_experts,
        out_dtype=_get_moe_router_dtype(config),
        prefix=f"{prefix}.gate",
    )
    # NOTE: loaded on both roles (AFD_SPEC §7.6) so the router module matches the native one;
    # the logits do not use it, the FFN's top-k selection does.
    bias = (
        nn.Parameter(torch.empty(config.n_routed_experts, dtype=torch.float32))
        if _uses_correction_bias(config)
        else None
    )
    gate.register_parameter("e_score_correction_bias", bias)
    return gate


class AFDDeepseekV2MoEProxy(RemoteMoEProxyMixin, DeepseekV2MoE):
    """Attention-side `mlp` of a MoE layer: parameter-free, or holding the native router."""

    def __init__(
        self, config: typing.Any, prefix: str, layer_idx: int, gate_on_attention: bool
    ) -> None:
        gate = _router(config, prefix) if gate_on_attention else None
        self.init_proxy(layer_idx, gate, config.n_routed_experts)
        # Read by `extract_moe_parameters` and `is_model_fused_shared_expert_compatible`.
        self.n_shared_experts = config.n_shared_experts
        self.is_fused_shared_expert_enabled = False


class _CorrectionBias(nn.Module):
    """Holds `<prefix>.gate.e_score_correction_bias` on an FFN block that has no router."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32))


class AFDDeepseekV2Experts(DeepseekV2MoE):
    """FFN-side MoE block without internal router: gate on attention (AFD_SPEC §7.7).

    Same attributes, shared experts and `FusedMoEFactory` arguments as the native block,
    except `gate=None`: vLLM 0.30's `MoERunner._forward_impl` recomputes the logits from a
    gate it holds, and uses the `router_logits` argument as the logits only without one.
    The correction bias (noaux_tc) stays here: grouped top-k adds it to the scores.
    """

    def __init__(
        self,
        config: typing.Any,
        parallel_config: typing.Any,
        quant_config: typing.Any = None,
        reduce_results: bool = True,
        prefix: str = "",
        apply_routed_scale_to_output: bool = False,
    ) -> None:
        nn.Module.__init__(self)
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.routed_scaling_factor = getattr(config, "routed_scaling_factor", 1.0)
        self.ep_group = get_ep_group().device_group
        self.ep_size = self.ep_group.size()
        self.n_routed_experts: int = config.n_routed_experts
        self.n_shared_experts: int = config.n_shared_experts
        self.is_sequence_parallel = parallel_config.use_sequence_parallel_moe  # False (refused)
        self.router_dtype = _get_moe_router_dtype(config)
        self.gate = (
            _CorrectionBias(config.n_routed_experts) if _uses_correction_bias(config) else None
        )
        bias = None if self.gate is None else self.gate.e_score_correction_bias
        self.enable_eplb = parallel_config.enable_eplb
        self.n_redundant_experts = parallel_config.eplb_config.num_redundant_experts
        self.n_logical_experts = self.n_routed_experts
        self.n_physical_experts = self.n_logical_experts + self.n_redundant_experts
        self.n_local_physical_experts = self.n_physical_experts // self.ep_size
        self.is_rocm_aiter_moe_enabled = False
        self.is_fused_shared_expert_enabled = False
        if config.n_shared_experts is None:
            self.shared_experts = None
        else:
            self.shared_experts = DeepseekV2MLP(
                hidden_size=config.hidden_size,
                intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
                hidden_act=config.hidden_act,
                quant_config=quant_config,
                is_sequence_parallel=self.is_sequence_parallel,
                reduce_results=False,
                prefix=f"{prefix}.shared_experts",
            )
        self.experts = FusedMoEFactory(
            shared_experts=self.shared_experts,
            gate=None,
            num_experts=config.n_routed_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            renormalize=config.norm_topk_prob,
            quant_config=quant_config,
            use_grouped_topk=True,
            num_expert_group=getattr(config, "n_group", 1),
            topk_group=getattr(config, "topk_group", 1),
            prefix=f"{prefix}.experts",
            scoring_func=getattr(config, "scoring_func", "softmax"),
            routed_scaling_factor=self.routed_scaling_factor,
            apply_routed_scale_to_output=apply_routed_scale_to_output,
            e_score_correction_bias=bias,
            enable_eplb=self.enable_eplb,
            num_redundant_experts=self.n_redundant_experts,
            is_sequence_parallel=self.is_sequence_parallel,
            reduce_results=reduce_results,
            router_logits_dtype=self.router_dtype,
        )

    def forward(  # type: ignore[override]
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor
    ) -> torch.Tensor:
        # hidden_states: [num_tokens, hidden_size]; router_logits: [num_tokens, n_routed_experts]
        return self.experts(hidden_states=hidden_states, router_logits=router_logits)


def _self_attn(vllm_config: VllmConfig, config: typing.Any, prefix: str) -> nn.Module:
    """The attention `DeepseekV2DecoderLayer.__init__` builds at 0.30.0 (V3.2 indexer aside)."""
    if _uses_mha(config):
        attn_cls: typing.Any = DeepseekAttention
    elif vllm_config.model_config.use_mla:
        attn_cls = DeepseekV2MLAAttention
    else:
        attn_cls = DeepseekV2Attention
    return attn_cls(
        vllm_config=vllm_config,
        config=config,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        qk_nope_head_dim=getattr(config, "qk_nope_head_dim", 0),
        qk_rope_head_dim=getattr(config, "qk_rope_head_dim", 0),
        v_head_dim=getattr(config, "v_head_dim", 0),
        q_lora_rank=getattr(config, "q_lora_rank", None),
        kv_lora_rank=getattr(config, "kv_lora_rank", 0),
        max_position_embeddings=getattr(config, "max_position_embeddings", 8192),
        cache_config=vllm_config.cache_config,
        quant_config=vllm_config.quant_config,
        prefix=f"{prefix}.self_attn",
        topk_indices_buffer=None,
        reduce_results=True,
    )


def _mlp(vllm_config: VllmConfig, config: typing.Any, prefix: str, layer_idx: int) -> nn.Module:
    """The module of this role in layer `prefix`'s `mlp` slot (AFD_SPEC §7.3)."""
    role, gate_on_attention = read_afd_settings(vllm_config, "AFDDeepseekV2DecoderLayer")
    is_moe = is_moe_layer(config, ARCHITECTURE, layer_idx)
    kind = mlp_kind(role, gate_on_attention, is_moe)
    mlp_prefix = f"{prefix}.mlp"
    if kind == "proxy":
        return RemoteFFNProxy(layer_idx)
    if kind == "moe_proxy":
        return AFDDeepseekV2MoEProxy(config, mlp_prefix, layer_idx, gate_on_attention)
    if kind == "placeholder":
        return PPMissingLayer()
    if kind == "experts" or is_moe:
        block_cls = AFDDeepseekV2Experts if kind == "experts" else DeepseekV2MoE
        return block_cls(
            config=config,
            parallel_config=vllm_config.parallel_config,
            quant_config=vllm_config.quant_config,
            prefix=mlp_prefix,
            # aiter applies routed_scaling_factor internally (native comment)
            apply_routed_scale_to_output=not rocm_aiter_ops.is_fused_moe_enabled(),
        )
    return DeepseekV2MLP(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        hidden_act=config.hidden_act,
        quant_config=vllm_config.quant_config,
        prefix=mlp_prefix,
    )


class AFDDeepseekV2DecoderLayer(DeepseekV2DecoderLayer):
    """Native decoder layer holding one role's half; `forward` is the native one."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        prefix: str,
        config: typing.Any = None,
        topk_indices_buffer: torch.Tensor | None = None,
        index_group_builder: typing.Any = None,
    ) -> None:
        nn.Module.__init__(self)
        if config is None:
            config = vllm_config.model_config.hf_config
        attention = read_afd_settings(vllm_config, type(self).__name__).role == "attention"
        # Attributes the native forward reads.
        self.hidden_size = config.hidden_size
        self.layer_idx = int(prefix.split(sep=".")[-1])
        self.use_mha = _uses_mha(config)
        self.use_sequence_parallel_moe = False  # refused by read_afd_settings
        self.routed_scaling_factor = getattr(config, "routed_scaling_factor", 1.0)
        # Same registration order as the native layer: self_attn, mlp, both norms.
        self.self_attn = _self_attn(vllm_config, config, prefix) if attention else PPMissingLayer()
        self.mlp = _mlp(vllm_config, config, prefix, self.layer_idx)
        self.input_layernorm = role_norm(config, attention)
        self.post_attention_layernorm = role_norm(config, attention)


@support_torch_compile
class AFDDeepseekV2Model(DeepseekV2Model):
    """Native model body holding one role's half; `forward` and `load_weights` are native.

    Sets the attributes the native `forward`/`load_weights` read; embeddings and final norm
    exist on attention only. Decorated like the native class: its own `__init__` replaces the
    one the native decorator wrapped.
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_config
        attention = read_afd_settings(vllm_config, type(self).__name__).role == "attention"
        if hasattr(config, "index_topk"):
            raise ValueError(
                f"{type(self).__name__}: sparse-attention checkpoints (index_topk="
                f"{config.index_topk}, DeepSeek-V3.2 style) are not supported by AFD; expected "
                "a DeepSeek-V2/V3 checkpoint. Serve this model without AFD."
            )
        self.config = config
        self.device = current_platform.device_type
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.is_v32 = False
        if attention:
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size,
                config.hidden_size,
                quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.embed_tokens",
            )
        else:
            self.embed_tokens = PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: AFDDeepseekV2DecoderLayer(vllm_config=vllm_config, prefix=prefix),
            prefix=f"{prefix}.layers",
        )
        self.is_fused_shared_expert_enabled = is_model_fused_shared_expert_compatible(
            self.layers, DeepseekV2MoE, "mlp"
        )
        self.norm = (
            role_norm(config, attention)
        )
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size
        )
        self.aux_hidden_state_layers = tuple[int, ...]()
        self.use_mha = _uses_mha(config)
        self.num_redundant_experts = vllm_config.parallel_config.eplb_config.num_redundant_experts


class AFDDeepseekV2ForCausalLM(AFDCausalLMMixin, DeepseekV2ForCausalLM):
    """AFD alias of `DeepseekV2ForCausalLM`: the half of `additional_config["afd"]["role"]`."""

    afd_architecture = "DeepseekV2ForCausalLM"
    model_cls = AFDDeepseekV2Model
    packed_modules_mapping = copy_packed_modules_mapping(DeepseekV2ForCausalLM)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)
        self.init_afd(vllm_config)
        config = vllm_config.model_config.hf_config
        self.config = config
        self.quant_config = vllm_config.quant_config
        self.use_mha = _uses_mha(config)
        if self.use_mha:
            self.packed_modules_mapping["qkv_proj"] = ["q_proj", "k_proj", "v_proj"]
        self.fuse_qkv_a_proj = getattr(config, "q_lora_rank", None) is not None
        if self.fuse_qkv_a_proj:
            self.packed_modules_mapping["fused_qkv_a_proj"] = ["q_a_proj", "kv_a_proj_with_mqa"]
        self.model = self.model_cls(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.init_lm_head(vllm_config, prefix, tie_word_embeddings=False)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        # GateLinear: logits in its out_dtype (fp32 for moe_router_dtype="float32"), else
        # in its weight dtype, the model dtype.
        self.afd_router_logits_dtype = (
            _get_moe_router_dtype(config) or vllm_config.model_config.dtype
        )
        blocks = self.init_moe_bookkeeping(
            DeepseekV2MoE,
            num_expert_groups=getattr(config, "n_group", 1),
            num_shared_experts=config.n_shared_experts,
        )
        self.moe_mlp_layers = blocks if self.afd_role == "ffn" else []

    def finish_dense_output(self, output: torch.Tensor) -> torch.Tensor:
        """The native decoder's FP16 overflow guard for `DeepseekV2MLP` outputs, applied once.

        The attention side's `RemoteFFNProxy` is no `DeepseekV2MLP`, so the inherited
        forward skips it there; MoE blocks scale inside the fused-MoE runner.
        """
        if output.dtype == torch.float16:
            return output * (1.0 / getattr(self.config, "routed_scaling_factor", 1.0))
        return output


class AFDDeepseekV3ForCausalLM(AFDDeepseekV2ForCausalLM, DeepseekV3ForCausalLM):
    """AFD alias of `DeepseekV3ForCausalLM` (the V2 machinery; V3 differs only by config)."""

    afd_architecture = "DeepseekV3ForCausalLM"
    packed_modules_mapping = copy_packed_modules_mapping(DeepseekV3ForCausalLM)
