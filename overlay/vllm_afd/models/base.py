"""What every AFD model alias shares: settings, `mlp` slots, the loader, the FFN entry points.

An alias subclasses the native `…ForCausalLM` and mixes `AFDCausalLMMixin` in front of it. Its
`__init__` reads the AFD settings once (`init_afd`) and runs the native constructor; the model
seams of `patches/` (docs/hooks.md, "Model seams") let the alias and its body, layer and MoE-block
subclasses choose, through class-valued properties, what the native constructors build: the
native classes for what the role owns, parameter-free placeholders (`Absent`) or proxies for the
rest (docs/models.md, "What each role builds"). Forward passes and weight loaders stay native.

NOTE: the AFD subclasses store the settings before calling the native `__init__` (a plain
attribute may be set before `nn.Module.__init__`), because the properties the native
constructor reads depend on them; below the top-level model they arrive as a keyword argument
bound with `functools.partial`, so the configuration is parsed once per model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch
from torch import nn
from vllm.model_executor.models.utils import PPMissingLayer, extract_layer_index

from vllm_afd.config import afd_config_of
from vllm_afd.models.proxy import RemoteFFNProxy
from vllm_afd.models.split import filter_weights, moe_layer_indices, num_routed_experts
from vllm_afd.role import Role

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig

__all__ = [
    "AFDCausalLMMixin",
    "AFDSettings",
    "Absent",
    "ModuleFactory",
    "RemoteDenseProxy",
    "attention_only",
    "copy_packed_modules_mapping",
    "dense_mlp_cls",
    "mlp_kind",
    "moe_block_cls",
    "read_afd_settings",
]

# What a `*_cls` property returns: a module class, or one with AFD arguments bound.
ModuleFactory = Callable[..., nn.Module]


class AFDSettings(NamedTuple):
    """The two AFD facts model construction depends on."""

    role: str  # a Role's value: "attention" | "ffn"
    gate_on_attention: bool  # compute_gate_on_attention


def read_afd_settings(vllm_config: VllmConfig, caller: str) -> AFDSettings:
    """Role and gate placement: the worker's parse (`afd_config_of`), checked by `validation.check_features`."""
    afd = afd_config_of(vllm_config, caller)
    return AFDSettings(afd.role, afd.compute_gate_on_attention)


def copy_packed_modules_mapping(native_cls: type) -> dict[str, list[str]]:
    """An alias's own `packed_modules_mapping`, which the native `__init__` extends in place.

    Native `__init__`s add entries to their class's dict before building modules (quantisation
    configs hold a reference to it); under an alias they do so to this copy, never to the
    native dict.
    """
    return {name: list(parts) for name, parts in native_cls.packed_modules_mapping.items()}


class Absent(PPMissingLayer):
    """Parameter-free stand-in for a module the other role owns.

    Takes (and ignores) the native constructor's arguments, so a `*_cls` property can return
    it in place of any native class. A `PPMissingLayer`, so native loaders skip it like a
    module of another pipeline stage. `tie_weights` keeps a tied LM head absent too.
    """

    def tie_weights(self, embed_tokens: nn.Module) -> Absent:
        return self


class RemoteDenseProxy(RemoteFFNProxy):
    """`RemoteFFNProxy` built from a native dense MLP's constructor arguments (`prefix` counts)."""

    def __init__(self, *args: Any, prefix: str, **kwargs: Any) -> None:
        super().__init__(extract_layer_index(prefix))


def mlp_kind(role: str, gate_on_attention: bool, is_moe: bool) -> str:
    """Which module a decoder layer's `mlp` slot holds on this role (docs/models.md).

    "proxy": `RemoteDenseProxy`; "moe_proxy": the model's MoE proxy (holding the router iff
    the gate is on attention); "native": the native MLP or MoE block; "experts": the model's
    MoE block without internal router; "placeholder": `Absent`.
    """
    if role == Role.ATTENTION:
        if is_moe:
            return "moe_proxy"
        return "native" if gate_on_attention else "proxy"
    if is_moe:
        return "experts" if gate_on_attention else "native"
    return "placeholder" if gate_on_attention else "native"


def attention_only(settings: AFDSettings, native_cls: type[nn.Module]) -> type[nn.Module]:
    """`native_cls` on the attention role; `Absent` on the FFN role, which does not own it."""
    return native_cls if settings.role == Role.ATTENTION else Absent


def dense_mlp_cls(settings: AFDSettings, native_cls: type[nn.Module]) -> type[nn.Module]:
    """What a dense layer's `mlp` slot is built with on this role."""
    kind = mlp_kind(settings.role, settings.gate_on_attention, is_moe=False)
    return {"proxy": RemoteDenseProxy, "native": native_cls, "placeholder": Absent}[kind]


def moe_block_cls(
    settings: AFDSettings,
    native_cls: type[nn.Module],
    proxy_cls: type[nn.Module],
    experts_cls: type[nn.Module],
) -> ModuleFactory:
    """What a MoE layer's `mlp` slot is built with on this role (a proxy learns the gate)."""
    kind = mlp_kind(settings.role, settings.gate_on_attention, is_moe=True)
    if kind == "moe_proxy":
        return functools.partial(proxy_cls, gate_on_attention=settings.gate_on_attention)
    return experts_cls if kind == "experts" else native_cls


class AFDCausalLMMixin:
    """Settings, the filtered loader and the FFN compute interface (docs/models.md).

    Put in front of the native `ForCausalLM` in the bases. The alias's `__init__` calls
    `init_afd` first, then the native `__init__` (which builds `self.model`, whose
    `layers[i].mlp` the FFN entry points run), then `init_moe_bookkeeping`.
    """

    afd_architecture: ClassVar[str]  # checkpoint architecture this alias splits
    afd_settings: AFDSettings
    afd_moe_layers: tuple[int, ...]  # indices of the MoE layers
    afd_router_logits_dtype: torch.dtype  # dtype of the router's output
    config: Any  # the HF text config (native attribute)
    model: Any  # the AFD model body (native attribute)

    # ---- construction -------------------------------------------------------------
    def init_afd(self, vllm_config: VllmConfig) -> AFDSettings:
        """Read the AFD settings, once per model; call before the native `__init__`."""
        self.afd_settings = read_afd_settings(vllm_config, type(self).__name__)
        hf_config = vllm_config.model_config.hf_text_config
        self.afd_moe_layers = moe_layer_indices(hf_config, self.afd_architecture)
        return self.afd_settings

    @property
    def lm_head_cls(self) -> type[nn.Module]:
        """The `lm_head_cls` seam (docs/hooks.md): the native head on attention, none on the FFN."""
        return attention_only(self.afd_settings, super().lm_head_cls)  # type: ignore[misc]

    def init_moe_bookkeeping(
        self, block_cls: type[nn.Module], num_expert_groups: int, num_shared_experts: int
    ) -> list[nn.Module]:
        """The `MixtureOfExperts` attributes, recomputed for the experts held here.

        Only the FFN holds fused-MoE layers, so only there are `moe_layers` non-empty (the
        attention half is then no `MixtureOfExperts` model for vLLM's EPLB code, which AFD
        rejects anyway); the expert counts come from the blocks (MoE proxies carry them).
        Returns the MoE blocks of `self.model.layers`.
        """
        blocks = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, block_cls)]
        if not blocks:
            raise RuntimeError(
                f"{type(self).__name__}: no {block_cls.__name__} in model.layers (role "
                f"{self.afd_settings.role!r}); expected one per MoE layer {self.afd_moe_layers}. "
                "Check the checkpoint's MoE settings."
            )
        example = blocks[-1]
        ffn = self.afd_settings.role == Role.FFN
        self.moe_layers = [block.experts for block in blocks] if ffn else []
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
        """The native loader, fed only the weights this role materialises (docs/models.md)."""
        role, gate_on_attention = self.afd_settings
        own = filter_weights(weights, role, self.config, self.afd_architecture, gate_on_attention)
        return super().load_weights(own)  # type: ignore[misc]

    # ---- FFN compute interface (docs/models.md) ----------------------------------------
    def get_experts_layer_indices(self) -> tuple[int, ...]:
        """The MoE layer indices: the layers that cross when the gate runs on attention."""
        return self.afd_moe_layers

    def get_experts_routing_spec(self, layer_idx: int) -> tuple[int, torch.dtype]:
        """(width, dtype) of the router logits MoE layer `layer_idx` receives (the FFN runner's `RoutingSpec`)."""
        self._check_layer("get_experts_routing_spec", layer_idx, want_moe=True, want_ffn=False)
        return num_routed_experts(self.config), self.afd_router_logits_dtype

    def compute_ffn_output(self, hidden_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """The layer's full MLP/MoE output (router, experts, shared experts, scaling, TP reduce)."""
        is_moe = self._check_layer("compute_ffn_output", layer_idx, want_moe=None)
        if self.afd_settings.gate_on_attention:
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
        if not self.afd_settings.gate_on_attention:
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
        if want_ffn and self.afd_settings.role != Role.FFN:
            raise RuntimeError(
                f"{where}: this model was built for role {self.afd_settings.role!r}; expected "
                "'ffn'. Only the FFN role computes MLP and MoE outputs."
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

