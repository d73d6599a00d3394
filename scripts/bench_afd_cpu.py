#!/usr/bin/env python3
"""Decode throughput of AFD ÷ plain vLLM on this CPU, and k micro-batch stages ÷ 1, measured side by side.

All deployments are started first and stay up: plain vLLM on one core (and, with `--plain-2-cores`,
on both), and one AFD deployment (an FFN and an attention server, one core each) per stage count of
`--num-stages`.  Then each round sends every batch size to every deployment in turn, one request at a
time, the order rotating from round to round, so a slow minute of this shared machine lands on every
deployment alike.  Decode time is the wall time of a request for `1 + num_decode_tokens` tokens minus
that of a 1-token request (the prefill), so decode tok/s = batch × num_decode_tokens / decode time.
Greedy, `ignore_eos`; every request has prompts of its own (token ids, `--prompt-tokens` long, none
repeated in the run) and the servers run without prefix caching, so every sample does the same work.

The machine is shared (docs/benchmarks.md#micro-batch-stages-on-cpu-k-stages--1-stage--plain): a ratio is
taken per round, of the two deployments' samples of that round (side by side in time), and a cell is the
median of those per-round ratios, with their min–max.  A round whose samples saw other jobs (the
machine's busy CPU beyond every deployment's and this script's own) take more than `--max-other-cores`
is dropped and counted; the rounds kept are split in halves (first and second in time), whose medians
the script prints next to each other as the run's own reproducibility estimate.  `--warmup-rounds` full
rounds run first and are not recorded.

With more than one stage count every AFD deployment records its per-layer timeline (docs/timeline.md),
and the script prints, per batch and count: the measured k ÷ 1 ratio next to the one
docs/pingpong.md#10-predicted-speed-up predicts from the 1-stage costs (scripts/stage_model.py: a, f, t
fitted over the batch sizes,
the layers simulated at n/k tokens per stage), the per-exchange a, f, t the k-stage run measured, each
role's busy share from the timeline, and the CPU share of each role's processes (/proc: the worker,
the engine core, the API server) — the places a bubble hides.  `--pin-processes` pins every process of
a role to its core (otherwise only the workers' OpenMP threads are, and the engine core and API server
float).  The model must have per-layer compute >= transport: `--arch qwen3_moe_1k_4l` (dummy weights).

    python scripts/bench_afd_cpu.py --arch qwen3_moe_1k_4l --batch-sizes 1,8,16,32 --num-stages 1 2 3 \\
        [--pin-processes] [--plain-2-cores] [--min-tokens-per-stage N] [--repeats N] [--max-other-cores X] \\
        [--out evidence]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import stage_model
from vllm_afd.config import DEFAULT_MIN_TOKENS_PER_STAGE

from afd_harness.afd import AFDDeployment
from afd_harness.server import VllmServer, complete_batch, cpu_server_env
from afd_harness.tiny_models import build_tiny_model, read_recipe, serve_env

REPO = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")
# The CPU-share key of other jobs: the machine's busy CPU beyond every deployment's and this script's.
OTHER_JOBS = "other jobs"


@dataclass
class Target:
    """One deployment under measurement: where to send requests, whose CPU time to read, its timeline."""

    label: str
    base_url: str
    groups: dict[str, int]  # role -> process group id
    num_stages: int | None = None  # None: plain vLLM
    timeline: Path | None = None
    tok_s: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    windows: dict[int, list[tuple[int, int]]] = field(default_factory=lambda: defaultdict(list))
    cpu: dict[int, list[dict[str, float]]] = field(default_factory=lambda: defaultdict(list))


def cpu_seconds(groups: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system, exited threads included) per "<group name>/<process name>"."""
    names = {pgid: name for name, pgid in groups.items()}
    totals: dict[str, float] = defaultdict(float)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        fields = stat[stat.rindex(")") + 2:].split()
        group = names.get(int(fields[2]))  # field 5 of stat: pgrp
        if group is not None:
            process = stat[stat.index('(') + 1:stat.rindex(')')]
            totals[f"{group}/{process}"] += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return totals


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine spent busy since boot (/proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / CLK_TCK


# Prompt length in token ids when `--prompt-tokens` is not given (the length of the short sentence used before).
DEFAULT_PROMPT_TOKENS = 12
# Token ids a prompt draws from: above the tiny tokenizers' special tokens, below their 512-entry vocabularies.
FIRST_ID, NUM_IDS = 16, 480


class Prompts:
    """Token-id prompts of `length` ids, a different one for every request of the run (no prefix cache hit)."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.issued = 0

    def batch(self, batch: int) -> list[list[int]]:
        first, self.issued = self.issued, self.issued + batch
        return [unique_prompt(r, self.length) for r in range(first, first + batch)]


def unique_prompt(index: int, length: int) -> list[int]:
    """Prompt number `index`: its first two ids spell `index` in base NUM_IDS, so no two of the first
    NUM_IDS² share their first block; the rest vary with `index` too."""
    head = [FIRST_ID + index // NUM_IDS % NUM_IDS, FIRST_ID + index % NUM_IDS]
    tail = [FIRST_ID + (7 * i + 31 * index) % NUM_IDS for i in range(max(0, length - 2))]
    return (head + tail)[:length]


PROMPTS = Prompts(DEFAULT_PROMPT_TOKENS)


def timed_request(base_url: str, batch: int, max_tokens: int) -> float:
    prompts = PROMPTS.batch(batch)
    started = time.perf_counter()
    complete_batch(base_url, prompts, max_tokens, ignore_eos=True)
    return time.perf_counter() - started


def sample(target: Target, batch: int, num_decode_tokens: int, everyone: dict[str, int], record: bool = True) -> None:
    """One decode sample: a full request (its window and CPU shares recorded), then a prefill-only one.

    `everyone`: the process groups of every deployment; the machine's busy CPU beyond theirs and this script's
    own is other jobs' ("other jobs" in the CPU column), which this shared machine's benchmarks must show next
    to each number and which decides whether the sample's round is kept (`--max-other-cores`).
    `record`: False for a warm-up round (nothing is kept).
    """
    before, machine, client = cpu_seconds(everyone), busy_cpu_seconds(), time.process_time()
    start_ns = time.perf_counter_ns()
    full = timed_request(target.base_url, batch, 1 + num_decode_tokens)
    window = (start_ns, time.perf_counter_ns())
    after, machine, client = cpu_seconds(everyone), busy_cpu_seconds() - machine, time.process_time() - client
    own = {name: after[name] - before.get(name, 0.0) for name in after}
    mine = {name.removeprefix(f"{target.label}:"): seconds / full for name, seconds in own.items()
            if name.startswith(f"{target.label}:")}
    mine[OTHER_JOBS] = max(0.0, machine - sum(own.values()) - client) / full
    prefill = timed_request(target.base_url, batch, 1)
    if record:
        target.windows[batch].append(window)
        target.cpu[batch].append(mine)
        target.tok_s[batch].append(batch * num_decode_tokens / max(full - prefill, 1e-6))


def run_rounds(targets: list[Target], batch_sizes: list[int], num_decode_tokens: int, repeats: int,
               settle_s: float, warmup_rounds: int = 1) -> None:
    """Every batch on every target per round, the target order rotated each round; one request at a time.

    Sample i of every target and batch belongs to round i, so ratios pair by index (`pair_rounds`); the
    `warmup_rounds` first rounds are run in full and not recorded.

    NOTE: `settle_s` between targets: after a step, vLLM's engine core keeps polling its worker's shm queue
    with sched_yield for 1 s (shm_broadcast.SpinCondition, busy_loop_s), so the deployment measured just
    before would take a core from the next one (the FFN's with plain vLLM first, the attention's with AFD
    first: the 1-stage deployment ran 15 % faster at batch 1 than the staged ones, which never split it).
    """
    everyone = {f"{t.label}:{role}": pgid for t in targets for role, pgid in t.groups.items()}
    for target in targets:
        for batch in batch_sizes:
            timed_request(target.base_url, batch, 1 + num_decode_tokens)  # warm this shape
    for round_index in range(-warmup_rounds, repeats):
        for batch in batch_sizes:
            shift = (round_index + batch_sizes.index(batch)) % len(targets)
            for target in targets[shift:] + targets[:shift]:
                time.sleep(settle_s)
                sample(target, batch, num_decode_tokens, everyone, record=round_index >= 0)
        others = [t.cpu[b][-1][OTHER_JOBS] for t in targets for b in batch_sizes if round_index >= 0]
        name = f"round {round_index + 1}/{repeats}" if round_index >= 0 else "warm-up round"
        print(f"{name} done ({time.strftime('%H:%M:%S')}, load {os.getloadavg()[0]:.2f}"
              + (f", other jobs {min(others):.2f}-{max(others):.2f} cores" if others else "") + ")", flush=True)


# ---- per-round ratios (pure) ----------------------------------------------------------------------


@dataclass(frozen=True)
class PairedRatio:
    """One ratio cell: the per-round ratios of two targets' samples of one batch, in round order, without the
    rounds whose samples saw other jobs above the bound (`dropped` of them; `all_ratios` keeps every round)."""

    ratios: tuple[float, ...]
    dropped: int
    all_ratios: tuple[float, ...]

    @property
    def median(self) -> float:
        return median(list(self.ratios))

    @property
    def low(self) -> float:
        return min(self.ratios, default=float("nan"))

    @property
    def high(self) -> float:
        return max(self.ratios, default=float("nan"))

    @property
    def halves(self) -> tuple[float, float]:
        return half_split(self.ratios)


def pair_rounds(numerator: Sequence[float], denominator: Sequence[float], loads: Sequence[float],
                max_load: float) -> PairedRatio:
    """Ratios numerator[i] / denominator[i] of the samples of round i, kept where loads[i] <= max_load.

    `loads[i]`: other jobs' CPU (cores) during round i's two samples, the larger of the two.
    """
    if not len(numerator) == len(denominator) == len(loads):
        raise ValueError(f"bench_afd_cpu: {len(numerator)} and {len(denominator)} samples with {len(loads)} loads; "
                         "expected one sample of each target and one load per round")
    every = tuple(n / d for n, d in zip(numerator, denominator))
    kept = tuple(r for r, load in zip(every, loads) if load <= max_load)
    return PairedRatio(kept, len(every) - len(kept), every)


def round_loads(*per_target: Sequence[float]) -> list[float]:
    """Per round, the largest other-jobs share any of the targets' samples of that round saw."""
    return [max(loads) for loads in zip(*per_target, strict=True)]


def half_split(values: Sequence[float]) -> tuple[float, float]:
    """Medians of the first and the second half of `values` (in time order; an odd middle one goes to neither);
    nan, nan below two values. Their difference is what a second run of half the length could show."""
    half = len(values) // 2
    if half == 0:
        return float("nan"), float("nan")
    return median(list(values[:half])), median(list(values[-half:]))


def relative_gap(first: float, second: float) -> float:
    """|first / second - 1|, the difference of two readings of one ratio as a share (nan if undefined)."""
    if not (second > 0 and first == first):
        return float("nan")
    return abs(first / second - 1.0)


def timeline_costs(target: Target, batch: int) -> stage_model.ExchangeCosts | None:
    """Median per-exchange costs of the target's decode steps of `batch` rows inside its measured windows."""
    if target.timeline is None:
        return None
    return stage_model.batch_costs(stage_model.read_steps(target.timeline, "attention"),
                                   stage_model.read_steps(target.timeline, "ffn"), batch, target.windows[batch])


def step_ms(target: Target, batch: int) -> float:
    """Median host time between consecutive decode steps of `batch` rows in the target's windows (attention)."""
    if target.timeline is None:
        return float("nan")
    records = stage_model.read_steps(target.timeline, "attention")
    by_seq = {r.step_seq: r for r in records if r.rows == batch
              and any(lo <= r.opened_ns <= hi for lo, hi in target.windows[batch])}
    return median([(by_seq[s + 1].opened_ns - r.opened_ns) / 1e6 for s, r in by_seq.items() if s + 1 in by_seq])


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def cpu_shares(target: Target, batch: int) -> str:
    """Median CPU share (cores) of each process kind over the target's samples of `batch`, largest first."""
    names = {name for sample_ in target.cpu[batch] for name in sample_}
    shares = {name: median([s.get(name, 0.0) for s in target.cpu[batch]]) for name in names}
    return ", ".join(f"{name} {share:.2f}" for name, share in sorted(shares.items(), key=lambda kv: -kv[1])
                     if share >= 0.02)


def ratio_cells(targets: list[Target], batch_sizes: list[int],
                max_other_cores: float) -> dict[tuple[str, str, int], PairedRatio]:
    """Every k ÷ 1 stage and AFD ÷ plain cell: (numerator label, denominator label, batch) -> its rounds."""
    plain = [t for t in targets if t.num_stages is None]
    afd = {t.num_stages: t for t in targets if t.num_stages is not None}
    pairs = [(afd[k], afd[1]) for k in sorted(afd) if k > 1 and 1 in afd]
    pairs += [(afd[k], plain[0]) for k in sorted(afd) if plain]
    cells = {}
    for numerator, denominator in pairs:
        for b in batch_sizes:
            loads = round_loads([c.get(OTHER_JOBS, 0.0) for c in numerator.cpu[b]],
                                [c.get(OTHER_JOBS, 0.0) for c in denominator.cpu[b]])
            cells[(numerator.label, denominator.label, b)] = pair_rounds(
                numerator.tok_s[b], denominator.tok_s[b], loads, max_other_cores)
    return cells


def report(targets: list[Target], batch_sizes: list[int], title: str, min_tokens_per_stage: int,
           max_other_cores: float = float("inf")) -> list[str]:
    """Markdown: tok/s per target, AFD k ÷ 1 measured vs predicted, ÷ plain; their spread and halves; then the
    per-exchange detail."""
    plain = [t for t in targets if t.num_stages is None]
    afd = {t.num_stages: t for t in targets if t.num_stages is not None}
    stages = sorted(afd)
    rate = {t.label: {b: median(t.tok_s[b]) for b in batch_sizes} for t in targets}
    cells = ratio_cells(targets, batch_sizes, max_other_cores)
    costs = {(k, b): timeline_costs(afd[k], b) for k in stages for b in batch_sizes}
    one = [(b, costs[(1, b)]) for b in batch_sizes if 1 in afd and costs[(1, b)] is not None]
    fits = (stage_model.fit_linear([(b, c.a) for b, c in one]), stage_model.fit_linear([(b, c.f) for b, c in one]),
            stage_model.fit_linear([(b, c.t) for b, c in one])) if one else None
    split = [k for k in stages if k > 1 and 1 in afd]
    head = ["batch", *[f"{t.label} tok/s" for t in targets],
            *[f"{k} ÷ 1 stage (predicted)" for k in split], *[f"{k} ÷ {plain[0].label}" for k in stages if plain],
            "rounds kept"]
    lines = [title, "", "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for b in batch_sizes:
        row = [str(b), *[f"{rate[t.label][b]:.1f}" for t in targets]]
        for k in split:
            predicted = "—"
            c1, ran = costs[(1, b)], stage_model.stages_run(k, b, min_tokens_per_stage)
            if fits is not None and c1 is not None:
                step_1 = 1000.0 * b / rate[afd[1].label][b]
                predicted = f"{step_1 / stage_model.predicted_step_ms(step_1, fits, b, c1.num_layers, ran):.2f}"
            row.append(f"{cells[(afd[k].label, afd[1].label, b)].median:.2f} ({predicted})")
        row += [f"{cells[(afd[k].label, plain[0].label, b)].median:.2f}" for k in stages if plain]
        kept = [len(cell.ratios) for (_, _, batch), cell in cells.items() if batch == b]
        total = [len(cell.all_ratios) for (_, _, batch), cell in cells.items() if batch == b]
        row.append(f"{min(kept, default=0)}/{max(total, default=0)}")
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", f"tok/s: medians of all rounds; ratios: medians of the per-round ratios of the rounds kept (other "
              f"jobs <= {max_other_cores:g} cores in both samples). Spread and the run's own reproducibility estimate "
              "(median of the first half of the kept rounds vs the second half):", "",
              "| ratio | batch | median | min–max | first half | second half | halves differ | all rounds | "
              "rounds dropped |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (numerator, denominator, b), cell in cells.items():
        first, second = cell.halves
        lines.append(f"| {numerator} ÷ {denominator} | {b} | {cell.median:.3f} | {cell.low:.2f}–{cell.high:.2f} | "
                     f"{first:.3f} | {second:.3f} | {100 * relative_gap(first, second):.1f} % | "
                     f"{median(list(cell.all_ratios)):.3f} | {cell.dropped} |")
    if fits is not None:
        lines += ["", "1-stage costs per exchange, ms, fitted over the batch sizes "
                  "(docs/pingpong.md#10-predicted-speed-up): "
                  + ", ".join(f"{name} = {fit.fixed:.3f} + {fit.per_token:.4f}·n"
                              for name, fit in zip(("a", "f", "t"), fits))]
    lines += ["", "Per decode step of the timeline (medians; a, f, t per exchange; layers = first send to last "
              "receive, predicted from the 1-stage fits; host = step - layers: scheduling, sampling, the first "
              "stage's first attention, the head):", "",
              "| batch | stages | a ms | f ms | t ms | attention busy | FFN busy | layers ms (predicted) | step ms | "
              "host ms | CPU cores by process |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for b in batch_sizes:
        for k in stages:
            c = costs[(k, b)]
            if c is None:
                lines.append(f"| {b} | {k} | — | — | — | — | — | — | — | — | {cpu_shares(afd[k], b)} |")
                continue
            predicted, ran, step = "—", c.num_stages, step_ms(afd[k], b)
            if fits is not None:
                n = b / ran  # the span starts at the first send: without the first stage's first attention
                layers = stage_model.simulate_layers(fits[0](n), fits[1](n), fits[2](n), c.num_layers, ran) - fits[0](n)
                predicted = f"{layers:.2f}"
            lines.append(f"| {b} | {k}{'' if ran == k else f' (ran {ran})'} | {c.a:.3f} | {c.f:.3f} | {c.t:.3f} | "
                         f"{c.attention_busy:.2f} | {c.ffn_busy:.2f} | {c.layers_ms:.2f} ({predicted}) | {step:.2f} | "
                         f"{step - c.layers_ms:.2f} | {cpu_shares(afd[k], b)} |")
    for t in plain:
        lines.append("")
        lines.append(f"{t.label}, CPU cores by process: "
                     + "; ".join(f"batch {b}: {cpu_shares(t, b)}" for b in batch_sizes))
    return lines


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3_moe")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS,
                        help="token ids per prompt (context length); every request's prompts are its own")
    parser.add_argument("--repeats", type=int, default=3, help="recorded rounds")
    parser.add_argument("--warmup-rounds", type=int, default=1, help="full rounds run first and not recorded")
    parser.add_argument("--max-other-cores", type=float, default=0.5,
                        help="drop a round's ratio when other jobs took more CPU (cores) during either sample")
    parser.add_argument("--num-stages", type=int, nargs="+", default=[1], choices=(1, 2, 3),
                        help="one AFD deployment per micro-batch stage count (docs/pingpong.md)")
    parser.add_argument("--min-tokens-per-stage", type=int, default=None,
                        help="AFD min_tokens_per_stage for the staged deployments "
                             "(docs/config.md; default: the config's)")
    parser.add_argument("--pin-processes", action="store_true",
                        help="pin every process of a role (API server, engine core) to its core, not only the worker")
    parser.add_argument("--plain-2-cores", action="store_true", help="also plain vLLM with OpenMP on both cores")
    parser.add_argument("--settle-s", type=float, default=1.5,
                        help="pause before each sample, so the previous deployment's engine core stops polling")
    parser.add_argument("--no-timeline", action="store_true", help="do not record the AFD timelines")
    parser.add_argument("--out", type=Path, help="write bench-afd-cpu.md (and a PNG for one stage) here")
    args = parser.parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    num_stages = sorted(set(args.num_stages))
    if args.min_tokens_per_stage is not None and args.min_tokens_per_stage < 1:
        parser.error(f"--min-tokens-per-stage must be >= 1, got {args.min_tokens_per_stage}")
    if args.prompt_tokens < 2 or args.repeats < 1 or args.warmup_rounds < 0:
        parser.error(f"need --prompt-tokens >= 2, --repeats >= 1, --warmup-rounds >= 0; got {args.prompt_tokens}, "
                     f"{args.repeats}, {args.warmup_rounds}")
    PROMPTS.length = args.prompt_tokens

    model = build_tiny_model(args.arch, REPO / "models" / args.arch)
    env = serve_env(model)
    # --load-format dummy for weight-less recipes; NOTE: the harness's CPU default is --max-num-seqs 8, which
    # would run a batch of 16 as two waves of 8 (as the runs before 2026-12-02 08:20 did).
    # Prefix caching off: every sample computes its whole prefill (and no split step is vetoed for a prefix hit).
    serve_args = [*read_recipe(model)["serve_args"], "--no-enable-prefix-caching",
                  "--max-num-seqs", str(max(batch_sizes)),
                  "--max-model-len", str(max(512, args.prompt_tokens + args.decode_tokens + 64))]
    logs = Path(tempfile.mkdtemp(prefix="afd-bench-"))
    print(f"logs and timelines: {logs}", flush=True)
    targets: list[Target] = []
    with contextlib.ExitStack() as stack:
        plains = [("plain 1 core", "0")] + ([("plain 2 cores", "0-1")] if args.plain_2_cores else [])
        for label, cpus in plains:
            prefix = ("taskset", "-c", cpus) if args.pin_processes else ()
            server = stack.enter_context(VllmServer(
                model, python=sys.executable, launcher="cli", log_path=logs / f"{label.replace(' ', '-')}.log",
                env={**cpu_server_env(omp_cpus=cpus), **env}, extra_args=serve_args, command_prefix=prefix))
            targets.append(Target(label, server.base_url, {"plain": server.pgid}))
        for k in num_stages:
            log_dir = logs / f"stages-{k}"
            fields: dict[str, object] = {"num_stages": k}
            if args.min_tokens_per_stage is not None and k > 1:
                fields["min_tokens_per_stage"] = args.min_tokens_per_stage
            if not args.no_timeline and len(num_stages) > 1:
                fields["timeline_dir"] = str(log_dir / "timeline")
            afd = stack.enter_context(AFDDeployment(
                model, python=sys.executable, log_dir=log_dir, env=env, afd_fields=fields,
                attention_args=serve_args, ffn_args=serve_args, pin_processes=args.pin_processes))
            targets.append(Target(f"AFD {k} stage{'s' if k > 1 else ''}", afd.attention.base_url,
                                  {"attention": afd.attention.pgid, "ffn": afd.ffn.pgid}, num_stages=k,
                                  timeline=log_dir / "timeline" if "timeline_dir" in fields else None))
        print(f"{len(targets)} deployments up ({time.strftime('%H:%M:%S')}, load {os.getloadavg()[0]:.2f})", flush=True)
        started = datetime.datetime.now(datetime.timezone.utc)
        load_before = os.getloadavg()[0]
        run_rounds(targets, batch_sizes, args.decode_tokens, args.repeats, args.settle_s, args.warmup_rounds)

    pinned = ", every process of a role pinned to its core" if args.pin_processes else ""
    pinned += f", min_tokens_per_stage {args.min_tokens_per_stage or DEFAULT_MIN_TOKENS_PER_STAGE}"
    others = [c[OTHER_JOBS] for t in targets for b in batch_sizes for c in t.cpu[b]] or [float("nan")]
    title = (f"Decode throughput, {args.arch}, {args.prompt_tokens}-token prompts of their own, prefix caching off, "
             f"{args.decode_tokens} decode tokens, {args.repeats} interleaved rounds after {args.warmup_rounds} "
             f"warm-up{pinned} ({started:%Y-%m-%d %H:%M}–{datetime.datetime.now(datetime.timezone.utc):%H:%M} UTC, "
             f"load {load_before:.2f} at the first round, {os.getloadavg()[0]:.2f} at the end; other jobs "
             f"{min(others):.2f}–{max(others):.2f} cores, median {median(others):.2f}, per sample)")
    lines = report(targets, batch_sizes, title, args.min_tokens_per_stage or DEFAULT_MIN_TOKENS_PER_STAGE,
                   args.max_other_cores)
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench-afd-cpu.md").write_text("\n".join(lines) + "\n")
        if num_stages == [1]:
            write_plot([(b, median(targets[0].tok_s[b]), median(targets[-1].tok_s[b])) for b in batch_sizes],
                       args.out / "bench-afd-cpu.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
