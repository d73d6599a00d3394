"""Where AFD cuts a checkpoint: layer kinds and the owner of every weight (docs/models.md).

Pure Python over a Hugging Face config (no torch, no vLLM), so both roles, the handshake
fingerprint and the unit tests derive the same answers from the same rules. The MoE rules
restate the native decoder layers' own tests at vLLM 0.30.0 (`Qwen3MoeDecoderLayer.__init__`,
`DeepseekV2DecoderLayer.__init__`); the model tests check them against the built modules.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = [
    "ROLES",
    "SUPPORTED_ARCHITECTURES",
    "WEIGHT_ROLES",
    "check_architecture",
    "filter_weights",
    "is_moe_layer",
    "layer_kinds",
    "model_family",
    "moe_layer_indices",
    "num_routed_experts",
    "weight_role",
]

# Checkpoint architecture -> model family whose split rules apply.
_FAMILIES = {
    "DeepseekV2ForCausalLM": "deepseek",
    "DeepseekV3ForCausalLM": "deepseek",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
SUPPORTED_ARCHITECTURES = tuple(sorted(_FAMILIES))
ROLES = ("attention", "ffn")
# What `weight_role` answers: the role that materialises a weight, both, or nobody.
WEIGHT_ROLES = ("attention", "ffn", "both", "drop")

# The first `layers.<i>.<child>` segment of a checkpoint name; `rest` is what follows `child.`.
_LAYER_SEGMENT = re.compile(r"(?:^|\.)layers\.(\d+)\.([^.]+)(?:\.(?P<rest>.*))?$")
# Children of a decoder layer that belong to the FFN half; everything else stays on attention.
_FFN_CHILD = "mlp"


def check_architecture(architecture: str) -> str:
    """Return `architecture` if AFD splits it, else raise the worker-start error."""
    if architecture not in _FAMILIES:
        raise ValueError(
            f"architecture {architecture} is not supported by AFD; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}. Serve a checkpoint of a supported "
            'architecture, or drop additional_config["afd"] to serve it without AFD.'
        )
    return architecture


def model_family(architecture: str) -> str:
    """"deepseek" or "qwen3_moe": which split rules apply to `architecture`."""
    return _FAMILIES[check_architecture(architecture)]


def num_routed_experts(hf_config: Any) -> int:
    """Routed experts per MoE layer (the router's output width); 0 for a model without MoE.

    DeepSeek-family configs (also those with another `model_type`, e.g. Kimi-K2) carry
    `n_routed_experts`; Qwen3-MoE carries `num_experts`.
    """
    if hasattr(hf_config, "n_routed_experts"):
        return int(hf_config.n_routed_experts or 0)
    return int(hf_config.num_experts or 0)


def is_moe_layer(hf_config: Any, architecture: str, layer_idx: int) -> bool:
    """True when the native model builds a MoE block (router + experts) at `layer_idx`."""
    if model_family(architecture) == "deepseek":
        # NOTE: DeepseekV2DecoderLayer.__init__ at 0.30.0.
        moe_layer_freq = getattr(hf_config, "moe_layer_freq", 1)
        return (
            hf_config.n_routed_experts is not None
            and layer_idx >= hf_config.first_k_dense_replace
            and layer_idx % moe_layer_freq == 0
        )
    # NOTE: Qwen3MoeDecoderLayer.__init__ at 0.30.0.
    mlp_only_layers = getattr(hf_config, "mlp_only_layers", None) or []
    return (
        layer_idx not in mlp_only_layers
        and hf_config.num_experts > 0
        and (layer_idx + 1) % hf_config.decoder_sparse_step == 0
    )


def moe_layer_indices(hf_config: Any, architecture: str) -> tuple[int, ...]:
    """Indices of the MoE layers, ascending (the only layers that cross with gate on attention)."""
    return tuple(
        i for i in range(hf_config.num_hidden_layers) if is_moe_layer(hf_config, architecture, i)
    )


def layer_kinds(hf_config: Any, architecture: str) -> str:
    """One character per layer, "D" dense or "M" MoE (the handshake's `layer_kinds`)."""
    moe = set(moe_layer_indices(hf_config, architecture))
    return "".join("M" if i in moe else "D" for i in range(hf_config.num_hidden_layers))


def _classify(
    name: str,
    num_hidden_layers: int,
    moe_layers: frozenset[int],
    gate_on_attention: bool,
) -> str:
    match = _LAYER_SEGMENT.search(name)
    if match is None:
        return "attention"  # embed_tokens, model.norm, lm_head
    layer_idx, child, rest = int(match.group(1)), match.group(2), match.group("rest") or ""
    if layer_idx >= num_hidden_layers:
        return "drop"  # multi-token-prediction layers past the decoder stack
    if child != _FFN_CHILD:
        return "attention"  # norms, self_attn (MLA, q/k norms, KV scales)
    if layer_idx not in moe_layers:
        return "attention" if gate_on_attention else "ffn"  # dense MLP
    if rest.startswith("gate."):
        if rest == "gate.e_score_correction_bias":
            return "both" if gate_on_attention else "ffn"
        return "attention" if gate_on_attention else "ffn"  # router (and its scales)
    return "ffn"  # routed and shared experts, Qwen's shared_expert_gate, their scales


def weight_role(name: str, hf_config: Any, architecture: str, gate_on_attention: bool) -> str:
    """Who materialises checkpoint weight `name`: "attention", "ffn", "both" or "drop"."""
    return _classify(
        name,
        hf_config.num_hidden_layers,
        frozenset(moe_layer_indices(hf_config, architecture)),
        gate_on_attention,
    )


def filter_weights(
    weights: Iterable[tuple[str, Any]],
    role: str,
    hf_config: Any,
    architecture: str,
    gate_on_attention: bool,
) -> Iterator[tuple[str, Any]]:
    """Lazily pass on the (name, tensor) pairs `role` materialises; one pass, like the source.

    Arguments are checked now, not at the first `next()`, so a wrong role fails where it is
    given. The checkpoint iterator is pulled only as the native loader pulls this one.
    """
    if role not in ROLES:
        raise ValueError(
            f"filter_weights: role must be one of {ROLES}, got {role!r}; pass the AFD role "
            "of the model being loaded."
        )
    num_hidden_layers = hf_config.num_hidden_layers
    moe_layers = frozenset(moe_layer_indices(hf_config, architecture))
    return _filtered(iter(weights), role, num_hidden_layers, moe_layers, gate_on_attention)


def _filtered(
    weights: Iterator[tuple[str, Any]],
    role: str,
    num_hidden_layers: int,
    moe_layers: frozenset[int],
    gate_on_attention: bool,
) -> Iterator[tuple[str, Any]]:
    for name, tensor in weights:
        owner = _classify(name, num_hidden_layers, moe_layers, gate_on_attention)
        if owner == role or owner == "both":
            yield name, tensor
