"""`AFDDeepseekV2ForCausalLM` / `AFDDeepseekV3ForCausalLM`: DeepSeek split at the FFN boundary.

Subclasses of the native vLLM 0.30.0 classes (`vllm/model_executor/models/deepseek_v2.py`) whose
`__init__`s run the native constructors: `model_cls` and the `deepseek-v2-*` seams of `patches/`
(docs/hooks.md) let them pick, per role, the class of every submodule the other role owns. The
decoder layer's `forward` (FP16 overflow guards included), the model body's `forward` and
hand-written `load_weights`, and `compute_logits` are inherited unchanged. Attention keeps
whichever native attention the config selects: MLA when `model_config.use_mla` (GPU), the MHA
formulation with `VLLM_MLA_DISABLE=1` (CPU). DeepSeek-V3.2's sparse attention (`index_topk`)
and ROCm AITER fused MoE are out of scope and refused.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from vllm._aiter_ops import rocm_aiter_ops
from vllm.config import VllmConfig
from vllm.model_executor.layers.fused_moe import GateLinear
from vllm.model_executor.models.deepseek_v2 import (
    DeepseekV2DecoderLayer,
    DeepseekV2ForCausalLM,
    DeepseekV2Model,
    DeepseekV2MoE,
    DeepseekV3ForCausalLM,
    _get_moe_router_dtype,
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
from vllm_afd.role import Role

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


def _uses_correction_bias(config: Any) -> bool:
    return getattr(config, "topk_method", None) == "noaux_tc"


class AFDDeepseekV2MoEProxy(RemoteMoEProxyMixin, DeepseekV2MoE):
    """Attention-side `mlp` of a MoE layer: parameter-free, or holding the native router.

    Takes the native block's constructor arguments but never runs its `__init__` (that would
    build the experts).
    """

    def __init__(
        self,
        config: Any,
        parallel_config: Any,
        quant_config: Any = None,
        reduce_results: bool = True,
        prefix: str = "",
        apply_routed_scale_to_output: bool = False,
        *,
        gate_on_attention: bool,
    ) -> None:
        gate = self._router(config, prefix) if gate_on_attention else None
        self.init_proxy(extract_layer_index(prefix), gate, config.n_routed_experts)
        # Read by `extract_moe_parameters` and `is_model_fused_shared_expert_compatible`.
        self.n_shared_experts = config.n_shared_experts
        self.is_fused_shared_expert_enabled = False

    @staticmethod
    def _router(config: Any, prefix: str) -> GateLinear:
        """The native block's router (`<prefix>.gate`, with its correction bias)."""
        gate = DeepseekV2MoE.gate_cls(
            config.hidden_size,
            config.n_routed_experts,
            out_dtype=_get_moe_router_dtype(config),
            prefix=f"{prefix}.gate",
        )
        # NOTE: loaded on both roles (docs/models.md, weight loading) so the router module
        # matches the native one; the logits do not use it, the FFN's top-k selection does.
        bias = (
            nn.Parameter(torch.empty(config.n_routed_experts, dtype=torch.float32))
            if _uses_correction_bias(config)
            else None
        )
        gate.register_parameter("e_score_correction_bias", bias)
        return gate


class _RouterlessGate(nn.Module):
    """`gate` of an FFN block whose router runs on attention: no weight.

    Keeps what the native `DeepseekV2MoE.__init__` reads from and attaches to its router: the
    logits dtype (`out_dtype`) and the `e_score_correction_bias` (noaux_tc), which grouped
    top-k adds to the scores here.
    """

    def __init__(self, *args: Any, out_dtype: torch.dtype | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.out_dtype = out_dtype


class AFDDeepseekV2Experts(DeepseekV2MoE):
    """FFN-side MoE block whose router runs on the attention role (gate on attention).

    The native block without its router weight: vLLM 0.30's `MoERunner._forward_impl`
    recomputes the logits from a gate it holds and uses its `router_logits` argument only
    without one, so `forward` takes the logits the attention side computed.
    """

    gate_cls = _RouterlessGate
    experts_apply_gate = False

    def forward(  # type: ignore[override]
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor
    ) -> torch.Tensor:
        # hidden_states: [num_tokens, hidden_size]; router_logits: [num_tokens, n_routed_experts]
        return self.experts(hidden_states=hidden_states, router_logits=router_logits)


class AFDDeepseekV2DecoderLayer(DeepseekV2DecoderLayer):
    """Native decoder layer holding one role's half; `forward` is the native one."""

    def __init__(self, *args: Any, afd: AFDSettings, **kwargs: Any) -> None:
        self.afd_settings = afd  # read by the properties below, during the native __init__
        super().__init__(*args, **kwargs)

    # The `deepseek-v2-add-layer-module-cls` seams (docs/hooks.md): what this role builds.
    @property
    def self_attn_cls(self) -> type[nn.Module] | None:
        # None keeps the attention class the config selects (MHA, MLA or MLA in MHA form).
        return None if self.afd_settings.role == Role.ATTENTION else Absent

    @property
    def norm_cls(self) -> type[nn.Module]:
        return attention_only(self.afd_settings, super().norm_cls)

    @property
    def mlp_cls(self) -> type[nn.Module]:
        return dense_mlp_cls(self.afd_settings, super().mlp_cls)

    @property
    def moe_block_cls(self) -> ModuleFactory:
        return moe_block_cls(
            self.afd_settings, super().moe_block_cls, AFDDeepseekV2MoEProxy, AFDDeepseekV2Experts
        )


class AFDDeepseekV2Model(DeepseekV2Model):
    """Native model body holding one role's half; `forward` and `load_weights` are native.

    Inherits the native `@support_torch_compile` wrapping (the native `__init__` runs through
    it); embeddings and final norm exist on the attention role only.
    """

    def __init__(self, *, afd: AFDSettings, **kwargs: Any) -> None:
        self.afd_settings = afd  # read by the properties below, during the native __init__
        super().__init__(**kwargs)

    # The `deepseek-v2-add-model-module-cls` seams (docs/hooks.md).
    @property
    def decoder_layer_cls(self) -> ModuleFactory:
        return functools.partial(AFDDeepseekV2DecoderLayer, afd=self.afd_settings)

    @property
    def embed_tokens_cls(self) -> type[nn.Module]:
        return attention_only(self.afd_settings, super().embed_tokens_cls)

    @property
    def norm_cls(self) -> type[nn.Module]:
        return attention_only(self.afd_settings, super().norm_cls)


class AFDDeepseekV2ForCausalLM(AFDCausalLMMixin, DeepseekV2ForCausalLM):
    """AFD alias of `DeepseekV2ForCausalLM`: the half of `additional_config["afd"]["role"]`."""

    afd_architecture = "DeepseekV2ForCausalLM"
    packed_modules_mapping = copy_packed_modules_mapping(DeepseekV2ForCausalLM)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        config = vllm_config.model_config.hf_config
        where = type(self).__name__
        if hasattr(config, "index_topk"):
            raise ValueError(
                f"{where}: sparse-attention checkpoints (index_topk={config.index_topk}, "
                "DeepSeek-V3.2 style) are not supported by AFD; expected a DeepSeek-V2/V3 "
                "checkpoint. Serve this model without AFD."
            )
        if rocm_aiter_ops.is_fused_moe_enabled():
            raise ValueError(
                f"{where}: ROCm AITER fused MoE is not supported by AFD (the FFN's routerless "
                "MoE block has no router weight for it); expected it off. Unset "
                "VLLM_ROCM_USE_AITER_MOE or serve this model without AFD."
            )
        self.init_afd(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        # GateLinear: logits in its out_dtype (fp32 for moe_router_dtype="float32"), else
        # in its weight dtype, the model dtype.
        self.afd_router_logits_dtype = (
            _get_moe_router_dtype(config) or vllm_config.model_config.dtype
        )

    # Upstream's `model_cls` attribute; `lm_head_cls` (deepseek-v2-add-lm-head-cls): the mixin.
    @property
    def model_cls(self) -> ModuleFactory:
        return functools.partial(AFDDeepseekV2Model, afd=self.afd_settings)

    def set_moe_parameters(self) -> None:
        """The native `__init__`'s MoE bookkeeping, for the experts this role holds."""
        blocks = self.init_moe_bookkeeping(
            DeepseekV2MoE,
            num_expert_groups=getattr(self.config, "n_group", 1),
            num_shared_experts=self.config.n_shared_experts,
        )
        self.moe_mlp_layers = blocks if self.afd_settings.role == Role.FFN else []

    def finish_dense_output(self, output: torch.Tensor) -> torch.Tensor:
        """The native decoder's FP16 overflow guard for `DeepseekV2MLP` outputs, applied once.

        The attention side's `RemoteDenseProxy` is no `DeepseekV2MLP`, so the inherited
        forward skips it there; MoE blocks scale inside the fused-MoE runner.
        """
        if output.dtype == torch.float16:
            return output * (1.0 / getattr(self.config, "routed_scaling_factor", 1.0))
        return output


class AFDDeepseekV3ForCausalLM(AFDDeepseekV2ForCausalLM, DeepseekV3ForCausalLM):
    """AFD alias of `DeepseekV3ForCausalLM` (the V2 machinery; V3 differs only by config)."""

    afd_architecture = "DeepseekV3ForCausalLM"
    packed_modules_mapping = copy_packed_modules_mapping(DeepseekV3ForCausalLM)
