#!/usr/bin/env python3
"""Decode throughput of AFD ÷ plain vLLM on this CPU, measured side by side in one run.

Both deployments serve the same tiny model with the same patched vLLM, alternately and for
the same requests (greedy, `ignore_eos`): plain vLLM on one core, AFD as an FFN and an
attention server on one core each.  Decode time is the wall time of a request for
`1 + num_decode_tokens` tokens minus that of a 1-token request (the prefill), so
decode tok/s = batch × num_decode_tokens / decode time.  Each cell is the median of
`--repeats` runs.  Writes a markdown table and a PNG plot (with `--out DIR`); the per-layer
round trip ÷ raw gloo ping-pong comes from scripts/bench_gloo_roundtrip.py.  `--num-stages 1 2 3`
measures one AFD deployment per micro-batch stage count (docs/pingpong.md) and prints each against
1 stage and against plain vLLM; the stage goal (2 ÷ 1 >= 1.15) needs a model whose per-layer compute
exceeds the transport, e.g. `--arch qwen3_moe_1k_4l` (dummy weights).

    python scripts/bench_afd_cpu.py [--arch qwen3_moe] [--batch-sizes 1,8] [--num-stages 1 2 3] [--out docs/bench]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

from afd_harness.afd import AFDDeployment
from afd_harness.server import VllmServer, complete_batch, cpu_server_env
from afd_harness.tiny_models import build_tiny_model, read_recipe, serve_env

REPO = Path(__file__).resolve().parents[1]
PROMPT = "The experts of a mixture route each token to"


def timed_request(base_url: str, batch: int, max_tokens: int) -> float:
    started = time.perf_counter()
    complete_batch(base_url, [PROMPT] * batch, max_tokens, ignore_eos=True)
    return time.perf_counter() - started


def decode_tok_s(base_url: str, batch: int, num_decode_tokens: int, repeats: int) -> float:
    timed_request(base_url, batch, 1 + num_decode_tokens)  # warm this shape
    samples = []
    for _ in range(repeats):
        full = timed_request(base_url, batch, 1 + num_decode_tokens)
        prefill = timed_request(base_url, batch, 1)
        samples.append(batch * num_decode_tokens / max(full - prefill, 1e-6))
    return statistics.median(samples)


def measure(base_url: str, batch_sizes: list[int], num_decode_tokens: int,
            repeats: int) -> dict[int, float]:
    return {b: decode_tok_s(base_url, b, num_decode_tokens, repeats) for b in batch_sizes}


def write_plot(rows: list[tuple[int, float, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"batch {b}" for b, _, _ in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([x - 0.2 for x in xs], [p for _, p, _ in rows], width=0.4, label="plain vLLM (1 core)")
    ax.bar([x + 0.2 for x in xs], [a for _, _, a in rows], width=0.4, label="AFD 1A1F gloo (2 cores)")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("decode tokens / s")
    ax.set_title("AFD vs plain vLLM on CPU (tiny Qwen3-MoE)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def stage_table(title: str, batch_sizes: list[int], plain: dict[int, float],
                afd: dict[int, dict[int, float]]) -> list[str]:
    """Markdown: tok/s of plain and of AFD per stage count, then each count ÷ 1 stage and ÷ plain."""
    stages = sorted(afd)
    head = ["batch", "plain vLLM tok/s", *[f"AFD {k} stage{'s' if k > 1 else ''} tok/s" for k in stages],
            *[f"{k} ÷ 1 stage" for k in stages if k > 1 and 1 in afd], *[f"{k} ÷ plain" for k in stages]]
    rows = []
    for b in batch_sizes:
        cells = [str(b), f"{plain[b]:.1f}", *[f"{afd[k][b]:.1f}" for k in stages],
                 *[f"{afd[k][b] / afd[1][b]:.2f}" for k in stages if k > 1 and 1 in afd],
                 *[f"{afd[k][b] / plain[b]:.2f}" for k in stages]]
        rows.append("| " + " | ".join(cells) + " |")
    return [title, "", "| " + " | ".join(head) + " |", "|" + "---:|" * len(head), *rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3_moe")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-stages", type=int, nargs="+", default=[1], choices=(1, 2, 3),
                        help="one AFD deployment per micro-batch stage count (docs/pingpong.md)")
    parser.add_argument("--out", type=Path, help="write bench-afd-cpu.md and .png here")
    args = parser.parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    num_stages = sorted(set(args.num_stages))

    model = build_tiny_model(args.arch, REPO / "models" / args.arch)
    env = serve_env(model)
    serve_args = read_recipe(model)["serve_args"]  # --load-format dummy for weight-less recipes
    logs = Path(tempfile.mkdtemp(prefix="afd-bench-"))
    with VllmServer(model, python=sys.executable, launcher="cli", log_path=logs / "plain.log",
                    env={**cpu_server_env(omp_cpus="0"), **env}, extra_args=serve_args) as plain:
        plain_tok_s = measure(plain.base_url, batch_sizes, args.decode_tokens, args.repeats)
    afd_tok_s = {}
    for k in num_stages:
        (logs / f"stages-{k}").mkdir()
        with AFDDeployment(model, python=sys.executable, log_dir=logs / f"stages-{k}", env=env,
                           afd_fields={"num_stages": k}, attention_args=serve_args, ffn_args=serve_args) as afd:
            afd_tok_s[k] = measure(afd.attention.base_url, batch_sizes, args.decode_tokens, args.repeats)

    title = (f"Decode throughput, {args.arch}, {args.decode_tokens} decode tokens, median of "
             f"{args.repeats} ({datetime.date.today().isoformat()})")
    if num_stages == [1]:
        rows = [(b, plain_tok_s[b], afd_tok_s[1][b]) for b in batch_sizes]
        lines = [title, "", "| batch | plain vLLM tok/s | AFD tok/s | AFD ÷ plain |", "|---:|---:|---:|---:|",
                 *[f"| {b} | {p:.1f} | {a:.1f} | {a / p:.2f} |" for b, p, a in rows]]
    else:
        rows, lines = [], stage_table(title, batch_sizes, plain_tok_s, afd_tok_s)
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench-afd-cpu.md").write_text("\n".join(lines) + "\n")
        if rows:
            write_plot(rows, args.out / "bench-afd-cpu.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
