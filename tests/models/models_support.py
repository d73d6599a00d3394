"""Helpers of the model tests: AFD configs, built models, the local DeepSeek-V3 checkpoint."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import torch

GLOO = "P2pGlooAFDConnector"
MLA_OFF = {"VLLM_MLA_DISABLE": "1"}


def afd(role: str, gate_on_attention: bool = False) -> dict[str, Any]:
    """An `additional_config["afd"]` for one role (CPU connector, default topology)."""
    return {"role": role, "connector": GLOO, "compute_gate_on_attention": gate_on_attention}


def build_deepseek_v3_noaux(out_dir: pathlib.Path) -> pathlib.Path:
    """Tiny DeepSeek-V3 (noaux_tc routing with a random correction bias, q_lora, sigmoid
    scores, routed scaling 2.5, two expert groups), plus a stray MTP layer the split drops."""
    import transformers
    from safetensors.torch import load_file, save_file

    from afd_harness.tiny_models import init_weights

    config = transformers.DeepseekV3Config(
        vocab_size=512, hidden_size=128, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=32,
        qk_rope_head_dim=32, v_head_dim=64, routed_scaling_factor=2.5, norm_topk_prob=True,
        hidden_act="silu", max_position_embeddings=2048, tie_word_embeddings=False,
        topk_method="noaux_tc", scoring_func="sigmoid",
    )
    model = transformers.DeepseekV3ForCausalLM(config)
    init_weights(model, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        # NOTE: a buffer in transformers' DeepseekV3, so init_weights leaves it at zero.
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator))
    model = model.to(torch.bfloat16)
    model.config.architectures = ["DeepseekV3ForCausalLM"]
    model.save_pretrained(out_dir)
    weights_file = out_dir / "model.safetensors"
    weights = load_file(weights_file)
    weights["model.layers.3.enorm.weight"] = torch.ones(128, dtype=torch.bfloat16)
    weights["model.layers.3.mlp.experts.0.up_proj.weight"] = torch.ones(64, 128, dtype=torch.bfloat16)
    save_file(weights, weights_file, metadata={"format": "pt"})
    return out_dir


class Built:
    """A loaded model with the config it was built under (forward contexts need it)."""

    def __init__(self, model: torch.nn.Module, config: Any) -> None:
        self.model = model
        self.config = config

    def run(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Call `fn` inside a forward context of this model (MoE layers look themselves up)."""
        from vllm.forward_context import set_forward_context

        with torch.inference_mode(), set_forward_context(None, self.config):
            return fn()

    def param_names(self) -> set[str]:
        return {name for name, _ in self.model.named_parameters()}


def random_hidden(num_tokens: int, hidden_size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, hidden_size, generator=generator).to(dtype)
