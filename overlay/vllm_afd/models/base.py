"""What every AFD model alias shares: its role, its `mlp` slots, its loader and FFN entry points.

An alias subclasses the native `ForCausalLM` and mixes `AFDCausalLMMixin` in front of it. Its
`__init__` builds one role's half with native submodule classes and prefixes, parameter-free
placeholders (vLLM's `PPMissingLayer`) elsewhere (AFD_SPEC §7.3); everything else, above all
the decoder layers' `forward` and the weight loaders, stays native.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch
from torch import nn

from vllm_afd.config import require_afd_config
from vllm_afd.models.split import filter_weights, moe_layer_indices, num_routed_experts

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig

__all__ = [
    "AFDCausalLMMixin",
    "AFDSettings",
    "copy_packed_modules_mapping",
    "mlp_kind",
    "read_afd_settings",
]


class AFDSettings(NamedTuple):
    """The two AFD facts model construction depends on."""

    role: str  # "attention" | "ffn"
    gate_on_attention: bool  # compute_gate_on_attention


def read_afd_settings(vllm_config: VllmConfig, caller: str) -> AFDSettings:
    """Role and gate placement from `additional_config["afd"]`; refuse what the split cannot do."""
    afd = require_afd_config(vllm_config, caller)
    if vllm_config.parallel_config.use_sequence_parallel_moe:
        # NOTE: SP MoE reshapes hidden states around the `mlp` call inside the native
        # decoder forward (DeepSeek) or the MoE block (Qwen3); the split point assumes full rows.
        raise ValueError(
            f"{caller}: AFD does not support sequence-parallel MoE "
            "(parallel_config.use_sequence_parallel_moe=True); expected it off. Disable "
            "sequence parallelism for MoE on both roles."
        )
    return AFDSettings(afd.role, afd.compute_gate_on_attention)


def copy_packed_modules_mapping(native_cls: type) -> dict[str, list[str]]:
    """An alias's own `packed_modules_mapping`, which its `__init__` may extend in place.

    Native `__init__`s add entries to their class's dict before building modules (quantisation
    configs hold a reference to it); an alias does the same to a copy, never to the native dict.
    """
    return {name: list(parts) for name, parts in native_cls.packed_modules_mapping.items()}


def mlp_kind(role: str, gate_on_attention: bool, is_moe: bool) -> str:
    """Which module a decoder layer's `mlp` slot holds on this role (AFD_SPEC §7.3).

    "proxy": `RemoteFFNProxy`; "moe_proxy": the model's MoE proxy (holding the router iff
    the gate is on attention); "native": the native MLP or MoE block; "experts": the model's
    MoE block without internal router; "placeholder": `PPMissingLayer`.
    """
    if role == "attention":
        if is_moe:
            return "moe_proxy"
        return "native" if gate_on_attention else "proxy"
    if is_moe:
        return "experts" if gate_on_attention else "native"
    return "placeholder" if gate_on_attention else "native"


class AFDCausalLMMixin:
    """Role bookkeeping, the filtered loader and the FFN compute interface (AFD_SPEC §7.5-7.6).

    Put in front of the native `ForCausalLM` in the bases. The alias's `__init__` calls
    `init_afd` first, then builds `self.model` (whose `layers[i].mlp` the FFN entry points
    run), `init_lm_head` and `init_moe_bookkeeping`.
    """

    afd_architecture: ClassVar[str]  # checkpoint architecture this alias splits
    afd_role: str
    afd_gate_on_attention: bool
    afd_moe_layers: tuple[int, ...]  # indices of the MoE layers
    afd_router_logits_dtype: torch.dtype  # dtype of the router's output
    config: Any  # the HF text config (native attribute)
    model: Any  # the AFD model body (native attribute)

    # ---- construction -------------------------------------------------------------
    def init_afd(self, vllm_config: VllmConfig) -> AFDSettings:
        settings = read_afd_settings(vllm_config, type(self).__name__)
        hf_config = vllm_config.model_config.hf_text_config
        self.afd_role = settings.role
        self.afd_gate_on_attention = settings.gate_on_attention
        self.afd_moe_layers = moe_layer_indices(hf_config, self.afd_architecture)
        return settings

    def init_lm_head(self, vllm_config: VllmConfig, prefix: str, tie_word_embeddings: bool) -> None:
        """`lm_head` and `logits_processor` as the native class builds them, on attention only."""
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
        from vllm.model_executor.models.utils import PPMissingLayer, maybe_prefix

        config = vllm_config.model_config.hf_text_config
        if self.afd_role == "attention":
            self.lm_head = ParallelLMHead(
                config.vocab_size,
                config.hidden_size,
                quant_config=vllm_config.quant_config,
                prefix=maybe_prefix(prefix, "lm_head"),
            )
            if tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.lm_head = PPMissingLayer()
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def init_moe_bookkeeping(
        self, block_cls: type[nn.Module], num_expert_groups: int, num_shared_experts: int
    ) -> list[nn.Module]:
        """The `MixtureOfExperts` attributes native `__init__`s set, for the experts held here.

        Only the FFN holds fused-MoE layers, so only there are `moe_layers` non-empty (the
        attention half is then no `MixtureOfExperts` model for vLLM's EPLB code, which AFD
        rejects anyway); the expert counts come from the blocks (MoE proxies carry them).
        Returns the MoE blocks of `self.model.layers`.
        """
        blocks = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, block_cls)]
        if not blocks:
            raise RuntimeError(
                f"{type(self).__name__}: no {block_cls.__name__} in model.layers (role "
                f"{self.afd_role!r}); expected one per MoE layer {self.afd_moe_layers}. "
                "Check the checkpoint's MoE settings."
            )
        example = blocks[-1]
        self.moe_layers = [block.experts for block in blocks] if self.afd_role == "ffn" else []
        self.num_moe_layers = len(self.moe_layers)
        self.num_expert_groups = num_expert_groups
        self.num_shared_experts = num_shared_experts
        self.num_logical_experts = example.n_logical_experts
        self.num_physical_experts = example.n_physical_experts
        self.num_local_physical_experts = example.n_local_physical_experts
        self.num_routed_experts = example.n_routed_experts
        self.num_redundant_experts = example.n_redundant_experts
        return blocks

    # ---- weights ----------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The native loader, fed only the weights this role materialises (AFD_SPEC §7.6)."""
        own = filter_weights(
            weights, self.afd_role, self.config, self.afd_architecture, self.afd_gate_on_attention
        )
        return super().load_weights(own)  # type: ignore[misc]

    # ---- FFN compute interface (AFD_SPEC §7.5) -----------------------------------------
    def get_experts_layer_indices(self) -> tuple[int, ...]:
        """The MoE layer indices: the layers that cross when the gate runs on attention."""
        return self.afd_moe_layers

    def get_experts_routing_spec(self, layer_idx: int) -> Any:
        """Width and dtype of the router logits MoE layer `layer_idx` receives."""
        from vllm_afd.connectors.metadata import AFDExpertRoutingSpec

        self._check_layer("get_experts_routing_spec", layer_idx, want_moe=True, want_ffn=False)
        return AFDExpertRoutingSpec(
            router_logits_width=num_routed_experts(self.config),
            router_logits_dtype=self.afd_router_logits_dtype,
        )

    def compute_ffn_output(self, hidden_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """The layer's full MLP/MoE output (router, experts, shared experts, scaling, TP reduce)."""
        is_moe = self._check_layer("compute_ffn_output", layer_idx, want_moe=None)
        if self.afd_gate_on_attention:
            what = (
                "Attention-side gate must call compute_experts_output"
                if is_moe
                else "Dense layers are computed on the Attention side when "
                "compute_gate_on_attention=true"
            )
            raise RuntimeError(
                f"{type(self).__name__}.compute_ffn_output(layer {layer_idx}): {what}; "
                "compute_ffn_output serves compute_gate_on_attention=false only."
            )
        output = self.model.layers[layer_idx].mlp(hidden_states)
        return output if is_moe else self.finish_dense_output(output)

    def compute_experts_output(
        self, hidden_states: torch.Tensor, layer_idx: int, router_logits: torch.Tensor
    ) -> torch.Tensor:
        """A MoE layer's output for router logits computed on attention (gate on attention)."""
        if not self.afd_gate_on_attention:
            raise RuntimeError(
                f"{type(self).__name__}.compute_experts_output(layer {layer_idx}): the FFN "
                "runs the router (compute_gate_on_attention=false); call compute_ffn_output."
            )
        self._check_layer("compute_experts_output", layer_idx, want_moe=True)
        return self.model.layers[layer_idx].mlp(hidden_states, router_logits)

    def finish_dense_output(self, output: torch.Tensor) -> torch.Tensor:
        """Post-processing the native decoder applies to a dense MLP's output (none by default)."""
        return output

    def _check_layer(
        self, caller: str, layer_idx: int, want_moe: bool | None, want_ffn: bool = True
    ) -> bool:
        where = f"{type(self).__name__}.{caller}"
        if want_ffn and self.afd_role != "ffn":
            raise RuntimeError(
                f"{where}: this model was built for role {self.afd_role!r}; expected 'ffn'. "
                "Only the FFN role computes MLP and MoE outputs."
            )
        num_layers = len(self.model.layers)
        if not 0 <= layer_idx < num_layers:
            raise IndexError(
                f"{where}: layer_idx {layer_idx} out of range; expected 0 <= layer_idx < "
                f"{num_layers}."
            )
        is_moe = layer_idx in self.afd_moe_layers
        if want_moe and not is_moe:
            raise RuntimeError(
                f"{where}: layer {layer_idx} is dense; expected a MoE layer "
                f"{self.afd_moe_layers}. Dense layers never cross with the gate on attention."
            )
        return is_moe


def role_norm(config: Any, attention: bool) -> nn.Module:
    """A native RMSNorm on the attention role; a parameter-free placeholder on the FFN."""
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.models.utils import PPMissingLayer

    if attention:
        return RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    return PPMissingLayer()
