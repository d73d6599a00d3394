"""`register_afd_models`: lazy, idempotent, never replacing an architecture (docs/models.md#architectures-and-aliases)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm import ModelRegistry  # noqa: E402

from vllm_afd.models import AFD_MODEL_ALIASES, register_afd_models  # noqa: E402
from vllm_afd.models.deepseek_v2 import (  # noqa: E402
    AFDDeepseekV2ForCausalLM,
    AFDDeepseekV3ForCausalLM,
)
from vllm_afd.models.qwen3_moe import AFDQwen3MoeForCausalLM  # noqa: E402

NATIVE = {
    "Qwen3MoeForCausalLM": ("vllm.model_executor.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("vllm.model_executor.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("vllm.model_executor.models.deepseek_v2", "DeepseekV3ForCausalLM"),
}


def entry(arch):
    registered = ModelRegistry.models[arch]
    return registered.module_name, registered.class_name


def test_registration_adds_lazy_aliases_and_keeps_native_architectures():
    register_afd_models()
    register_afd_models()  # idempotent

    for alias, target in AFD_MODEL_ALIASES.items():
        assert entry(alias) == tuple(target.split(":"))
    for arch, native in NATIVE.items():
        assert entry(arch) == native


def test_lazy_aliases_resolve_to_the_alias_classes():
    register_afd_models()
    expected = {
        "AFDQwen3MoeForCausalLM": AFDQwen3MoeForCausalLM,
        "AFDDeepseekV2ForCausalLM": AFDDeepseekV2ForCausalLM,
        "AFDDeepseekV3ForCausalLM": AFDDeepseekV3ForCausalLM,
    }

    for alias, cls in expected.items():
        assert ModelRegistry.models[alias].load_model_cls() is cls


def test_vllm_inspects_each_alias_like_its_native_architecture():
    register_afd_models()

    for alias in AFD_MODEL_ALIASES:
        ours = ModelRegistry.models[alias].inspect_model_cls()
        native = ModelRegistry.models[alias.removeprefix("AFD")].inspect_model_cls()
        for field in ("is_text_generation_model", "supports_pp", "is_attention_free",
                      "supports_multimodal", "has_inner_state"):
            assert getattr(ours, field) == getattr(native, field), (alias, field)


COLLISION = textwrap.dedent('''
    from vllm import ModelRegistry
    from vllm_afd.models import register_afd_models

    ModelRegistry.register_model("AFDQwen3MoeForCausalLM",
                                 "vllm.model_executor.models.qwen3_moe:Qwen3MoeForCausalLM")
    for attempt in (1, 2):
        try:
            register_afd_models()
        except RuntimeError as exc:
            print(f"REFUSED {attempt}: {exc}")
    print("ENTRY", ModelRegistry.models["AFDQwen3MoeForCausalLM"].module_name)
    print("V2", "AFDDeepseekV2ForCausalLM" in ModelRegistry.get_supported_archs())
''')


def test_an_architecture_registered_under_an_alias_name_is_never_replaced():
    overlay = Path(__file__).resolve().parents[2] / "overlay"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(overlay), env.get("PYTHONPATH")]))

    done = subprocess.run([sys.executable, "-c", COLLISION], capture_output=True, text=True,
                          timeout=300, env=env)

    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    refused = [line for line in lines if line.startswith("REFUSED")]
    assert len(refused) == 2  # still unregistered after a failure: a retry checks again
    assert "AFDQwen3MoeForCausalLM already registered" in refused[0]
    assert "ENTRY vllm.model_executor.models.qwen3_moe" in lines
    assert "V2 False" in lines  # nothing registered when one alias is taken
