"""`AFDQwen3MoeForCausalLM`: Qwen3-MoE split at the FFN boundary, one half per AFD role.

Subclasses of the native vLLM 0.30.0 classes (`vllm/model_executor/models/qwen3_moe.py`) whose
`__init__`s run the native constructors: the `qwen3-moe-*` seams of `patches/` (docs/hooks.md)
let them pick, per role, the class of every submodule the other role owns. Native arguments and
prefixes are kept (so checkpoint names and the native loaders stay valid); the `forward`s,
`load_weights` and `compute_logits` are inherited unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.models.qwen3_moe import (
    Qwen3MoeDecoderLayer,
    Qwen3MoeForCausalLM,
    Qwen3MoeModel,
    Qwen3MoeSparseMoeBlock,
)
from vllm.model_executor.models.utils import extract_layer_index

from vllm_afd.models.base import (
    Absent,
    AFDCausalLMMixin,
    AFDSettings,
    ModuleFactory,
    attention_only,
    copy_packed_modules_mapping,
    dense_mlp_cls,
    moe_block_cls,
)
from vllm_afd.models.proxy import RemoteMoEProxyMixin

__all__ = [
    "AFDQwen3MoeDecoderLayer",
    "AFDQwen3MoeExperts",
    "AFDQwen3MoeForCausalLM",
    "AFDQwen3MoeModel",
    "AFDQwen3MoeProxy",
]

ARCHITECTURE = "Qwen3MoeForCausalLM"


class AFDQwen3MoeProxy(RemoteMoEProxyMixin, Qwen3MoeSparseMoeBlock):
    """Attention-side `mlp` of a MoE layer: parameter-free, or holding the native router.

    Takes the native block's constructor arguments but never runs its `__init__` (that would
    build the experts); `experts` is None for the native MoE bookkeeping loop of
    `Qwen3MoeForCausalLM.__init__`, whose result `init_moe_bookkeeping` then replaces.
    """

    experts = None

    def __init__(
        self,
        vllm_config: VllmConfig,
        prefix: str = "",
        is_fused_checkpoint_transposed: bool = False,
        *,
        gate_on_attention: bool,
    ) -> None:
        config = vllm_config.model_config.hf_text_config
        gate = self._router(vllm_config, prefix) if gate_on_attention else None
        self.init_proxy(extract_layer_index(prefix), gate, config.num_experts)

    @staticmethod
    def _router(vllm_config: VllmConfig, prefix: str) -> ReplicatedLinear:
        """The native block's router (`<prefix>.gate`), built with the block's arguments."""
        config = vllm_config.model_config.hf_text_config
        return Qwen3MoeSparseMoeBlock.gate_cls(
            config.hidden_size,
            config.num_experts,
            bias=False,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.gate",
        )


class AFDQwen3MoeExperts(Qwen3MoeSparseMoeBlock):
    """FFN-side MoE block whose router runs on the attention role (gate on attention).

    The native block without its router: vLLM 0.30's `MoERunner._forward_impl` recomputes the
    logits from a gate it holds and uses its `router_logits` argument only without one, so
    `forward` takes the logits the attention side computed.
    """

    gate_cls = Absent
    experts_apply_gate = False

    def forward(  # type: ignore[override]
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor
    ) -> torch.Tensor:
        # hidden_states: [num_tokens, hidden_size]; router_logits: [num_tokens, num_experts]
        return self.experts(hidden_states=hidden_states, router_logits=router_logits)


class AFDQwen3MoeDecoderLayer(Qwen3MoeDecoderLayer):
    """Native decoder layer holding one role's half; `forward` is the native one."""

    def __init__(self, *args: Any, afd: AFDSettings, **kwargs: Any) -> None:
        self.afd_settings = afd  # read by the properties below, during the native __init__
        super().__init__(*args, **kwargs)

    # The `qwen3-moe-add-layer-module-cls` seams (docs/hooks.md): what this role builds.
    @property
    def self_attn_cls(self) -> type[torch.nn.Module]:
        return attention_only(self.afd_settings, super().self_attn_cls)

    @property
    def norm_cls(self) -> type[torch.nn.Module]:
        return attention_only(self.afd_settings, super().norm_cls)

    @property
    def mlp_cls(self) -> type[torch.nn.Module]:
        return dense_mlp_cls(self.afd_settings, super().mlp_cls)

    @property
    def moe_block_cls(self) -> ModuleFactory:
        return moe_block_cls(
            self.afd_settings, super().moe_block_cls, AFDQwen3MoeProxy, AFDQwen3MoeExperts
        )


class AFDQwen3MoeModel(Qwen3MoeModel):
    """Native model body holding one role's half; `forward` and `load_weights` are native.

    Inherits the native `@support_torch_compile` wrapping (the native `__init__` runs through
    it); embeddings and final norm exist on the attention role only.
    """

    def __init__(self, *, afd: AFDSettings, **kwargs: Any) -> None:
        self.afd_settings = afd  # read by the properties below, during the native __init__
        layer = functools.partial(AFDQwen3MoeDecoderLayer, afd=afd)
        super().__init__(decoder_layer_type=layer, **kwargs)

    # The `qwen3-moe-add-model-module-cls` seams (docs/hooks.md).
    @property
    def embed_tokens_cls(self) -> type[torch.nn.Module]:
        return attention_only(self.afd_settings, super().embed_tokens_cls)

    @property
    def norm_cls(self) -> type[torch.nn.Module]:
        return attention_only(self.afd_settings, super().norm_cls)


class AFDQwen3MoeForCausalLM(AFDCausalLMMixin, Qwen3MoeForCausalLM):
    """AFD alias of `Qwen3MoeForCausalLM`: the half of `additional_config["afd"]["role"]`."""

    afd_architecture = ARCHITECTURE
    packed_modules_mapping = copy_packed_modules_mapping(Qwen3MoeForCausalLM)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        self.init_afd(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        # ReplicatedLinear router: logits in the model dtype.
        self.afd_router_logits_dtype = vllm_config.model_config.dtype
        self.init_moe_bookkeeping(Qwen3MoeSparseMoeBlock, num_expert_groups=1, num_shared_experts=0)

    # The `qwen3-moe-add-causal-lm-module-cls` seam (docs/hooks.md); `lm_head_cls`: the mixin.
    @property
    def model_cls(self) -> ModuleFactory:
        return functools.partial(AFDQwen3MoeModel, afd=self.afd_settings)
