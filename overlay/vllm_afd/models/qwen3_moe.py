"""`AFDQwen3MoeForCausalLM`: Qwen3-MoE split at the FFN boundary, one half per AFD role.

Subclasses of the native vLLM 0.30.0 classes (`vllm/model_executor/models/qwen3_moe.py`).
Their `__init__`s build only the role's modules, with the native classes, arguments and
prefixes (so checkpoint names and the native loaders stay valid); the decoder layer's
`forward`, the model body's `forward` and `load_weights`, and the LM's `compute_logits` are
inherited unchanged. Native constructor signatures are pinned in tests/models.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_ep_group, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.fused_moe import FusedMoEFactory
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.qwen3_moe import (
    Qwen3MoeAttention,
    Qwen3MoeDecoderLayer,
    Qwen3MoeForCausalLM,
    Qwen3MoeMLP,
    Qwen3MoeModel,
    Qwen3MoeSparseMoeBlock,
)
from vllm.model_executor.models.utils import (
    PPMissingLayer,
    extract_layer_index,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)

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
    "AFDQwen3MoeDecoderLayer",
    "AFDQwen3MoeExperts",
    "AFDQwen3MoeForCausalLM",
    "AFDQwen3MoeModel",
    "AFDQwen3MoeProxy",
]

ARCHITECTURE = "Qwen3MoeForCausalLM"


def _router(vllm_config: VllmConfig, prefix: str) -> ReplicatedLinear:
    """The native router of `Qwen3MoeSparseMoeBlock` (`<prefix>.gate`)."""
    config = vllm_config.model_config.hf_text_config
    return ReplicatedLinear(
        config.hidden_size,
        config.num_experts,
        bias=False,
        quant_config=vllm_config.quant_config,
        prefix=f"{prefix}.gate",
    )


class AFDQwen3MoeProxy(RemoteMoEProxyMixin, Qwen3MoeSparseMoeBlock):
    """Attention-side `mlp` of a MoE layer: parameter-free, or holding the native router."""

    def __init__(self, vllm_config: VllmConfig, prefix: str, gate_on_attention: bool) -> None:
        config = vllm_config.model_config.hf_text_config
        gate = _router(vllm_config, prefix) if gate_on_attention else None
        self.init_proxy(extract_layer_index(prefix), gate, config.num_experts)


class AFDQwen3MoeExperts(Qwen3MoeSparseMoeBlock):
    """FFN-side MoE block without internal router: gate on attention (AFD_SPEC §7.7).

    Same expert counts, shared expert and `FusedMoEFactory` arguments as the native block,
    except `gate=None`: vLLM 0.30's `MoERunner._forward_impl` recomputes the logits from a
    gate it holds, and uses the `router_logits` argument as the logits only without one.
    `forward` therefore takes the logits the attention side computed.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        prefix: str = "",
        is_fused_checkpoint_transposed: bool = False,
    ) -> None:
        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_text_config
        parallel_config = vllm_config.parallel_config
        quant_config = vllm_config.quant_config

        # Attributes of the native block, for native bookkeeping.
        self.tp_size = get_tensor_model_parallel_world_size()
        self.ep_group = get_ep_group().device_group
        self.ep_size = self.ep_group.size()
        self.n_routed_experts = config.num_experts
        self.is_sequence_parallel = parallel_config.use_sequence_parallel_moe  # False (refused)
        if self.tp_size > config.num_experts:
            raise ValueError(
                f"Tensor parallel size {self.tp_size} is greater than "
                f"the number of experts {config.num_experts}."
            )
        self.enable_eplb = parallel_config.enable_eplb
        self.n_logical_experts = self.n_routed_experts
        self.n_redundant_experts = parallel_config.eplb_config.num_redundant_experts
        self.n_physical_experts = self.n_logical_experts + self.n_redundant_experts
        self.n_local_physical_experts = self.n_physical_experts // self.ep_size

        shared_size = getattr(config, "shared_expert_intermediate_size", 0)
        if shared_size > 0:
            self.shared_expert_gate = ReplicatedLinear(
                config.hidden_size, 1, bias=False, quant_config=None,
                prefix=f"{prefix}.shared_expert_gate",
            )
            self.shared_expert = Qwen3MoeMLP(
                hidden_size=config.hidden_size,
                intermediate_size=shared_size,
                hidden_act=config.hidden_act,
                quant_config=quant_config,
                reduce_results=False,
                expert_gate=self.shared_expert_gate,
                prefix=f"{prefix}.shared_expert",
            )
        else:
            self.shared_expert_gate = None
            self.shared_expert = None

        self.experts = FusedMoEFactory(
            shared_experts=self.shared_expert,
            gate=None,
            num_experts=self.n_routed_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            renormalize=config.norm_topk_prob,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
            enable_eplb=self.enable_eplb,
            num_redundant_experts=self.n_redundant_experts,
            is_sequence_parallel=self.is_sequence_parallel,
            is_fused_checkpoint_transposed=is_fused_checkpoint_transposed,
        )

    def forward(  # type: ignore[override]
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor
    ) -> torch.Tensor:
        # hidden_states: [num_tokens, hidden_size]; router_logits: [num_tokens, num_experts]
        return self.experts(hidden_states=hidden_states, router_logits=router_logits)


def _self_attn(vllm_config: VllmConfig, prefix: str) -> Qwen3MoeAttention:
    """`Qwen3MoeAttention` with the arguments `Qwen3MoeDecoderLayer.__init__` passes at 0.30.0."""
    config = vllm_config.model_config.hf_text_config
    return Qwen3MoeAttention(
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        rope_parameters=config.rope_parameters,
        max_position_embeddings=getattr(config, "max_position_embeddings", 8192),
        rms_norm_eps=config.rms_norm_eps,
        qkv_bias=getattr(config, "attention_bias", False),
        head_dim=getattr(config, "head_dim", None),
        cache_config=vllm_config.cache_config,
        quant_config=vllm_config.quant_config,
        prefix=f"{prefix}.self_attn",
        dual_chunk_attention_config=getattr(config, "dual_chunk_attention_config", None),
    )


def _mlp(
    vllm_config: VllmConfig, prefix: str, is_fused_checkpoint_transposed: bool
) -> nn.Module:
    """The module of this role in layer `prefix`'s `mlp` slot (AFD_SPEC §7.3)."""
    config = vllm_config.model_config.hf_text_config
    role, gate_on_attention = read_afd_settings(vllm_config, "AFDQwen3MoeDecoderLayer")
    layer_idx = extract_layer_index(prefix)
    is_moe = is_moe_layer(config, ARCHITECTURE, layer_idx)
    kind = mlp_kind(role, gate_on_attention, is_moe)
    mlp_prefix = f"{prefix}.mlp"
    if kind == "proxy":
        return RemoteFFNProxy(layer_idx)
    if kind == "moe_proxy":
        return AFDQwen3MoeProxy(vllm_config, mlp_prefix, gate_on_attention)
    if kind == "experts":
        return AFDQwen3MoeExperts(vllm_config, mlp_prefix, is_fused_checkpoint_transposed)
    if kind == "placeholder":
        return PPMissingLayer()
    if is_moe:
        return Qwen3MoeSparseMoeBlock(
            vllm_config=vllm_config,
            prefix=mlp_prefix,
            is_fused_checkpoint_transposed=is_fused_checkpoint_transposed,
        )
    return Qwen3MoeMLP(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        hidden_act=config.hidden_act,
        quant_config=vllm_config.quant_config,
        prefix=mlp_prefix,
    )


class AFDQwen3MoeDecoderLayer(Qwen3MoeDecoderLayer):
    """Native decoder layer holding one role's half; `forward` is the native one."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        prefix: str = "",
        is_fused_checkpoint_transposed: bool = False,
    ) -> None:
        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_text_config
        attention = read_afd_settings(vllm_config, type(self).__name__).role == "attention"
        self.hidden_size = config.hidden_size
        # Same registration order as the native layer: self_attn, mlp, both norms.
        self.self_attn = _self_attn(vllm_config, prefix) if attention else PPMissingLayer()
        self.mlp = _mlp(vllm_config, prefix, is_fused_checkpoint_transposed)
        self.input_layernorm = role_norm(config, attention)
        self.post_attention_layernorm = role_norm(config, attention)


@support_torch_compile
class AFDQwen3MoeModel(Qwen3MoeModel):
    """Native model body holding one role's half; `forward` and `load_weights` are native.

    Sets the attributes the native `forward`/`load_weights` read; embeddings and final norm
    exist on attention only. Decorated like the native class: its own `__init__` replaces the
    one the native decorator wrapped.
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_text_config
        attention = read_afd_settings(vllm_config, type(self).__name__).role == "attention"
        self.num_redundant_experts = vllm_config.parallel_config.eplb_config.num_redundant_experts
        self.vocab_size = config.vocab_size
        self.config = config
        self.quant_config = vllm_config.quant_config
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
            lambda prefix: AFDQwen3MoeDecoderLayer(vllm_config=vllm_config, prefix=prefix),
            prefix=f"{prefix}.layers",
        )
        self.norm = (
            role_norm(config, attention)
        )
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size
        )


class AFDQwen3MoeForCausalLM(AFDCausalLMMixin, Qwen3MoeForCausalLM):
    """AFD alias of `Qwen3MoeForCausalLM`: the half of `additional_config["afd"]["role"]`."""

    afd_architecture = ARCHITECTURE
    packed_modules_mapping = copy_packed_modules_mapping(Qwen3MoeForCausalLM)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)
        self.init_afd(vllm_config)
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.quant_config = vllm_config.quant_config
        if getattr(config, "mlp_only_layers", []):
            self.packed_modules_mapping["gate_up_proj"] = ["gate_proj", "up_proj"]
        self.model = AFDQwen3MoeModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.init_lm_head(vllm_config, prefix, config.tie_word_embeddings)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        # ReplicatedLinear router: logits in the model dtype.
        self.afd_router_logits_dtype = vllm_config.model_config.dtype
        self.init_moe_bookkeeping(Qwen3MoeSparseMoeBlock, num_expert_groups=1, num_shared_experts=0)
