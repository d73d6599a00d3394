"""AFD model aliases: which class splits which checkpoint architecture, and their registration.

Importing this package needs neither torch nor vLLM (the plugin imports it in every process);
the alias modules are imported only when vLLM resolves an alias (lazy "module:Class" entries).
"""

from __future__ import annotations

from vllm_afd.models.split import SUPPORTED_ARCHITECTURES, check_architecture

__all__ = ["AFD_MODEL_ALIASES", "alias_for", "register_afd_models"]

# AFD alias architecture -> lazy "module:Class" of the class that builds one role's half.
AFD_MODEL_ALIASES: dict[str, str] = {
    "AFDDeepseekV2ForCausalLM": "vllm_afd.models.deepseek_v2:AFDDeepseekV2ForCausalLM",
    "AFDDeepseekV3ForCausalLM": "vllm_afd.models.deepseek_v2:AFDDeepseekV3ForCausalLM",
    "AFDQwen3MoeForCausalLM": "vllm_afd.models.qwen3_moe:AFDQwen3MoeForCausalLM",
}
_ALIAS_PREFIX = "AFD"
assert sorted(_ALIAS_PREFIX + arch for arch in SUPPORTED_ARCHITECTURES) == sorted(
    AFD_MODEL_ALIASES
), "vllm_afd.models: AFD_MODEL_ALIASES must hold one alias per supported architecture"

_registered = False


def alias_for(architecture: str) -> str:
    """The AFD alias architecture of checkpoint `architecture` (an alias maps to itself).

    Raises the worker-start error (docs/models.md) for an architecture AFD cannot split.
    """
    if architecture in AFD_MODEL_ALIASES:
        return architecture
    return _ALIAS_PREFIX + check_architecture(architecture)


def register_afd_models() -> None:
    """Register every alias with vLLM's `ModelRegistry`, lazily; safe to call repeatedly.

    Never replaces an architecture someone else registered under an alias's name (vLLM's
    `register_model` overwrites silently); a failed registration propagates and leaves this
    process unregistered, so the plugin does not mark itself registered either.
    """
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry

    taken = sorted(set(AFD_MODEL_ALIASES) & set(ModelRegistry.get_supported_archs()))
    if taken:
        raise RuntimeError(
            f"register_afd_models: architecture name(s) {', '.join(taken)} already registered "
            "with vLLM's ModelRegistry; expected them free for the AFD aliases. Remove the "
            "other registration (another plugin?) so AFD does not replace it."
        )
    for alias, target in AFD_MODEL_ALIASES.items():
        ModelRegistry.register_model(alias, target)
    _registered = True
