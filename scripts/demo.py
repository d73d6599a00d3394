#!/usr/bin/env python3
"""AFD on CPU, end to end: plain vLLM vs an FFN + attention deployment, side by side.

Builds a tiny random-weight model locally (no hub), serves it once with the patched vLLM
and no AFD config, then as two `vllm serve` roles joined by `P2pGlooAFDConnector`, sends
the same greedy completions through the OpenAI API to both and prints them side by side.
Exit status 0 when every completion is identical, 1 otherwise.

    python scripts/demo.py [--arch qwen3_moe|deepseek_v2] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from afd_harness.afd import AFDDeployment
from afd_harness.server import VllmServer, complete_batch, cpu_server_env
from afd_harness.tiny_models import build_tiny_model, serve_env

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["Hello, my name is", "The capital of France is", "Mixture of experts means",
           "Once upon a time"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3_moe", choices=("qwen3_moe", "deepseek_v2"))
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--models-dir", type=Path, default=REPO / "models")
    args = parser.parse_args(argv)

    model = build_tiny_model(args.arch, args.models_dir / args.arch)
    env = serve_env(model)
    logs = Path(tempfile.mkdtemp(prefix="afd-demo-"))
    print(f"model: {model} (random weights); server logs: {logs}")

    started = time.monotonic()
    with VllmServer(model, python=sys.executable, launcher="cli", log_path=logs / "plain.log",
                    env={**cpu_server_env(omp_cpus="0"), **env}) as plain:
        plain_out = complete_batch(plain.base_url, PROMPTS, args.max_tokens)
    print(f"plain vLLM served {len(PROMPTS)} prompts ({time.monotonic() - started:.0f} s)")

    started = time.monotonic()
    with AFDDeployment(model, python=sys.executable, log_dir=logs, env=env) as afd:
        print(f"AFD up: FFN on :{afd.ffn.port}, attention on :{afd.attention.port} "
              f"(rendezvous :{afd.afd_port})")
        afd_out = complete_batch(afd.attention.base_url, PROMPTS, args.max_tokens)
    print(f"AFD served {len(PROMPTS)} prompts ({time.monotonic() - started:.0f} s)\n")

    num_equal = 0
    for prompt, ours, theirs in zip(PROMPTS, afd_out, plain_out):
        same = ours.token_ids == theirs.token_ids
        num_equal += same
        print(f"prompt   {prompt!r}\n  AFD    {ours.text!r}\n  plain  {theirs.text!r}\n"
              f"  {'identical tokens' if same else 'DIFFERENT TOKENS'}")
    print(f"\n{num_equal}/{len(PROMPTS)} completions identical (greedy, random-weight model)")
    return 0 if num_equal == len(PROMPTS) else 1


if __name__ == "__main__":
    sys.exit(main())
