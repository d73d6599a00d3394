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

`--layout xAyF` (1A1F, 2A1F, 2A2F) starts each AFD deployment with the flags of tests/e2e: the attention
`--data-parallel-size x`, the FFN `--data-parallel-size y --enable-expert-parallel` at y > 1 (then every
server in float32, as tests/e2e/test_afd_pool.py, unless `--dtype`), `num_attention_ranks` x and `num_ffn_ranks`
y; every attention rank's OpenMP threads on core 1, every FFN rank's on core 0.  Its plain baseline is vLLM's own
DP x (with `--enable-expert-parallel` where the AFD FFN runs it, or with `--plain-expert-parallel`), one rank
per core: the same CPU, each plain rank decoding what one attention rank does.  With `--pin-processes` every
process of the attention server is on core 1, of the FFN server on core 0, of a plain DP baseline on cores 0-1.
More ranks than cores oversubscribe them (printed).  `--predict PROFILE.json` prints, beside every measured
AFD ÷ plain ratio, the planner's (scripts/afd_plan.py predict: colocated DP x EP on x ranks ÷ AFD xA:yF, at
the batch per attention rank).

    python scripts/bench_afd_cpu.py --arch qwen3_moe_1k_4l --batch-sizes 1,8,16,32 --num-stages 1 2 3 \\
        [--layout 2A1F] [--predict PROFILE.json] [--pin-processes] [--plain-2-cores] [--min-tokens-per-stage N] \\
        [--repeats N] [--max-other-cores X] [--out evidence]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import re
import signal
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import stage_model
from paired_rounds import PairedRatio, Prompts, median, pair_rounds, relative_gap, round_loads
from afd_planner.cost import CostModel
from afd_planner.links import LINKS, parse_link
from afd_planner.profile import load_profile
from vllm_afd.config import DEFAULT_MIN_TOKENS_PER_STAGE

from afd_harness.afd import AFDDeployment
from afd_harness.server import VllmServer, complete_batch, cpu_server_env
from afd_harness.tiny_models import build_tiny_model, read_recipe, serve_env

REPO = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")
# Per server: a DP server starts several engine cores and API servers on two shared cores (AFDDeployment's default).
STARTUP_TIMEOUT_S = 600.0
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


# ---- layouts (pure) -------------------------------------------------------------------------------

MAX_RANKS_PER_ROLE = 2
LAYOUT_FORM = re.compile(r"([0-9]+)A([0-9]+)F")


@dataclass(frozen=True)
class Layout:
    """AFD xA:yF on this machine, with the flags and cores of tests/e2e: x attention DP ranks, y FFN DP ranks (with
    vLLM's expert parallelism at y > 1), every attention rank on core 1, every FFN rank on core 0; and its plain
    vLLM baseline: DP x (each plain rank decodes what one attention rank does), its ranks one per core."""

    attention_ranks: int
    ffn_ranks: int

    @property
    def name(self) -> str:
        return f"{self.attention_ranks}A{self.ffn_ranks}F"

    @property
    def ranks(self) -> int:
        return self.attention_ranks + self.ffn_ranks

    @property
    def expert_parallel(self) -> bool:
        """The FFN runs vLLM's expert parallelism (tests/e2e/test_afd_pool.py: an FFN pool is DP with EP)."""
        return self.ffn_ranks > 1

    def afd_fields(self) -> dict[str, int]:
        if (self.attention_ranks, self.ffn_ranks) == (1, 1):
            return {}
        return {"num_attention_ranks": self.attention_ranks, "num_ffn_ranks": self.ffn_ranks}

    def attention_args(self) -> list[str]:
        return ["--data-parallel-size", str(self.attention_ranks)] if self.attention_ranks > 1 else []

    def ffn_args(self) -> list[str]:
        return ["--data-parallel-size", str(self.ffn_ranks), "--enable-expert-parallel"] if self.ffn_ranks > 1 else []

    @property
    def attention_cpus(self) -> str:
        """VLLM_CPU_OMP_THREADS_BIND of the attention server: core 1 for each of its DP ranks ("1|1")."""
        return "|".join(["1"] * self.attention_ranks)

    @property
    def ffn_cpus(self) -> str:
        return "|".join(["0"] * self.ffn_ranks)

    @property
    def plain_ranks(self) -> int:
        return self.attention_ranks

    def plain_args(self, expert_parallel: bool) -> list[str]:
        """The plain baseline's vLLM flags: DP x, with `--enable-expert-parallel` where asked (and DP > 1)."""
        if self.plain_ranks == 1:
            return []
        return ["--data-parallel-size", str(self.plain_ranks), *(["--enable-expert-parallel"] * expert_parallel)]

    @property
    def plain_cpus(self) -> str:
        """The plain baseline's OpenMP binds: one core per rank ("0" for one rank, "0|1" for two)."""
        return "|".join(str(rank) for rank in range(self.plain_ranks))

    def plain_label(self, expert_parallel: bool) -> str:
        if self.plain_ranks == 1:
            return "plain 1 core"
        return f"plain DP {self.plain_ranks}{' + EP' if expert_parallel else ''}"

    def oversubscribes(self, cores: int) -> bool:
        """More ranks (one OpenMP thread each) than cores: the roles' ranks share their core."""
        return self.ranks > cores


def parse_layout(text: str) -> Layout:
    """`xAyF` (case-insensitive) with 1 <= y <= x <= MAX_RANKS_PER_ROLE; argparse's type for `--layout`."""
    form = LAYOUT_FORM.fullmatch(text.strip().upper())
    x, y = (int(form.group(1)), int(form.group(2))) if form else (0, 0)
    if not (form and 1 <= y <= x <= MAX_RANKS_PER_ROLE):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected xAyF with 1 <= y <= x <= {MAX_RANKS_PER_ROLE} (1A1F, 2A1F or 2A2F): x attention "
            "ranks (the attention's --data-parallel-size), y FFN ranks (the FFN's --data-parallel-size, with "
            "--enable-expert-parallel at y > 1); A >= F is the layout rule of docs/topology.md")
    return Layout(x, y)


# ---- the planner's prediction (pure) --------------------------------------------------------------

# What a predicted AFD ÷ plain cell compares (scripts/afd_plan.py predict's two calls, printed under the report).
PREDICTION_NOTE = (
    "predicted (in brackets after a measured AFD ÷ plain ratio): the planner (afd_planner, as "
    "`afd_plan.py predict {profile}{link} --context {context}`) at batch ceil(B / {x}) per attention rank: "
    "colocated DP x EP on {x} rank(s) (`--attention-ranks {x} --ffn-ranks 0`, the one colocated layout `predict` "
    "models) ÷ AFD {layout} (`--attention-ranks {x} --ffn-ranks {y} --stages k`, k stages where the rank's batch "
    ">= k x min_tokens_per_stage {min_tokens}, else 1), one step's time each, both decoding B; {layers} layers, "
    "context {context} = prompt + half the decode tokens.{mismatch}")


def planner_model(profile: Path, num_layers: int | None = None, link: str | None = None) -> CostModel:
    """`afd_plan.py predict`'s cost model: the profile, its layer count replaced where given; `link` as --link."""
    loaded = load_profile(profile)
    if num_layers is not None:
        loaded = replace(loaded, model=replace(loaded.model, num_layers=num_layers))
    wire = parse_link(link) if link else None
    return CostModel.from_profile(loaded, wire, wire or LINKS["nvlink"])


def predicted_ratios(model: CostModel, layout: Layout, batch_sizes: Sequence[int], stages: Sequence[int],
                     context: int, min_tokens_per_stage: int) -> dict[tuple[int, int], float]:
    """(k, batch) -> predicted AFD k stages ÷ plain throughput at `batch` requests in all: the colocated DP x EP
    step on the plain's ranks over the AFD step, both at ceil(batch / x) requests per rank (the busiest rank
    sets a DP step's pace)."""
    ratios = {}
    for b in batch_sizes:
        per_rank = math.ceil(b / layout.attention_ranks)
        plain_ms = model.colocated_dp_ep_ms(layout.plain_ranks, per_rank, context)
        for k in stages:
            ran = stage_model.stages_run(k, per_rank, min_tokens_per_stage)
            ratios[(k, b)] = plain_ms / model.afd_ms(layout.attention_ranks, layout.ffn_ranks, ran, per_rank, context)
    return ratios


# ---- the report (per-round ratios: paired_rounds.py) ----------------------------------------------


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
           max_other_cores: float = float("inf"), planned: dict[tuple[int, int], float] | None = None,
           planned_note: str = "") -> list[str]:
    """Markdown: tok/s per target, AFD k ÷ 1 measured vs predicted, ÷ plain (with the planner's prediction where
    `planned`: (k, batch) -> ratio); their spread and halves; then the per-exchange detail."""
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
            *[f"{k} ÷ 1 stage (predicted)" for k in split],
            *[f"{k} ÷ {plain[0].label}{' (planner)' if planned is not None else ''}" for k in stages if plain],
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
        row += [f"{cells[(afd[k].label, plain[0].label, b)].median:.2f}" + planned_cell(planned, k, b)
                for k in stages if plain]
        kept = [len(cell.ratios) for (_, _, batch), cell in cells.items() if batch == b]
        total = [len(cell.all_ratios) for (_, _, batch), cell in cells.items() if batch == b]
        row.append(f"{min(kept, default=0)}/{max(total, default=0)}")
        lines.append("| " + " | ".join(row) + " |")
    if planned is not None and planned_note:
        lines += ["", planned_note]
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
              "1 stage's step ÷ this | host ms | CPU cores by process |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for b in batch_sizes:
        one_stage = step_ms(afd[1], b) if 1 in afd and costs[(1, b)] is not None else math.nan
        for k in stages:
            c = costs[(k, b)]
            if c is None:
                lines.append(f"| {b} | {k} | — | — | — | — | — | — | — | — | — | {cpu_shares(afd[k], b)} |")
                continue
            predicted, ran, step = "—", c.num_stages, step_ms(afd[k], b)
            speedup = f"{one_stage / step:.3f}" if step > 0 and math.isfinite(one_stage / step) else "—"
            if fits is not None:
                n = b / ran  # the span starts at the first send: without the first stage's first attention
                layers = stage_model.simulate_layers(fits[0](n), fits[1](n), fits[2](n), c.num_layers, ran) - fits[0](n)
                predicted = f"{layers:.2f}"
            lines.append(f"| {b} | {k}{'' if ran == k else f' (ran {ran})'} | {c.a:.3f} | {c.f:.3f} | {c.t:.3f} | "
                         f"{c.attention_busy:.2f} | {c.ffn_busy:.2f} | {c.layers_ms:.2f} ({predicted}) | {step:.2f} | "
                         f"{speedup} | {step - c.layers_ms:.2f} | {cpu_shares(afd[k], b)} |")
    for t in plain:
        lines.append("")
        lines.append(f"{t.label}, CPU cores by process: "
                     + "; ".join(f"batch {b}: {cpu_shares(t, b)}" for b in batch_sizes))
    return lines


def planned_cell(planned: dict[tuple[int, int], float] | None, k: int, b: int) -> str:
    """" (0.97)": the planner's ratio after a measured one; "" without a prediction."""
    if planned is None:
        return ""
    return f" ({planned[(k, b)]:.2f})" if (k, b) in planned else " (—)"


def write_plot(rows: list[tuple[int, float, float]], path: Path, plain_label: str = "plain vLLM (1 core)",
               afd_label: str = "AFD 1A1F gloo (2 cores)") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"batch {b}" for b, _, _ in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([x - 0.2 for x in xs], [p for _, p, _ in rows], width=0.4, label=plain_label)
    ax.bar([x + 0.2 for x in xs], [a for _, _, a in rows], width=0.4, label=afd_label)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("decode tokens / s")
    ax.set_title("AFD vs plain vLLM on CPU (tiny Qwen3-MoE)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3_moe")
    parser.add_argument("--layout", type=parse_layout, default=Layout(1, 1),
                        help="AFD xAyF, 1 <= y <= x <= 2 (default 1A1F): x attention DP ranks on core 1, y FFN DP "
                             "ranks (EP at y > 1) on core 0; plain vLLM runs DP x, one rank per core")
    parser.add_argument("--dtype", help="every server's --dtype (default: float32 where the FFN runs expert "
                                        "parallelism, as tests/e2e/test_afd_pool.py; else the checkpoint's)")
    parser.add_argument("--plain-expert-parallel", action="store_true",
                        help="plain DP with --enable-expert-parallel also where the AFD FFN runs without (2A1F): "
                             "the colocated DP x EP the planner models")
    parser.add_argument("--predict", type=Path, metavar="PROFILE.json",
                        help="print the planner's AFD ÷ plain prediction (afd_plan.py predict) by each measured one")
    parser.add_argument("--predict-link",
                        help="afd_plan.py predict's --link for --predict (default: the profile's transport, "
                             "collectives on nvlink)")
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
    layout: Layout = args.layout
    if args.plain_expert_parallel and layout.plain_ranks == 1:
        parser.error(f"--plain-expert-parallel needs a plain baseline of several DP ranks; layout {layout.name} "
                     "has one (pass --layout 2A1F)")
    plain_ep = layout.expert_parallel or args.plain_expert_parallel
    dtype = args.dtype or ("float32" if layout.expert_parallel else None)
    profile_layers = None
    if args.predict is not None:
        try:  # checked before any server starts
            profile_layers = planner_model(args.predict, None, args.predict_link).shape.num_layers
        except ValueError as exc:  # ProfileError and a bad --predict-link included: the message names the field
            parser.error(f"--predict {args.predict}: {exc}")
    PROMPTS.length = args.prompt_tokens
    cores = len(os.sched_getaffinity(0))
    oversubscribed = layout.oversubscribes(cores)
    if oversubscribed:
        print(f"layout {layout.name} oversubscribes the cores: {layout.ranks} ranks on {cores} cores (attention "
              f"ranks share core 1, FFN ranks core 0; nothing can be pinned one rank per core)", flush=True)

    model = build_tiny_model(args.arch, REPO / "models" / args.arch)
    env = serve_env(model)
    # --load-format dummy for weight-less recipes; NOTE: the harness's CPU default is --max-num-seqs 8, which
    # would run a batch of 16 as two waves of 8 (as the runs before 2026-12-02 08:20 did).
    # Prefix caching off: every sample computes its whole prefill (and no split step is vetoed for a prefix hit).
    serve_args = [*read_recipe(model)["serve_args"], "--no-enable-prefix-caching",
                  "--max-num-seqs", str(max(batch_sizes)),
                  "--max-model-len", str(max(512, args.prompt_tokens + args.decode_tokens + 64)),
                  *(["--dtype", dtype] if dtype else [])]
    num_layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    planned, planned_note = None, ""
    if args.predict is not None:
        # As `predict --num-layers`: the served model's crossing layers (a profile built with --layers keeps the full
        # model's count, the same as the served model's).
        planned_model = planner_model(args.predict, num_layers, args.predict_link)
        context = args.prompt_tokens + args.decode_tokens // 2
        min_tokens = args.min_tokens_per_stage or DEFAULT_MIN_TOKENS_PER_STAGE
        planned = predicted_ratios(planned_model, layout, batch_sizes, num_stages, context, min_tokens)
        mismatch = "" if plain_ep or layout.plain_ranks == 1 else (
            f" The measured plain baseline runs DP {layout.plain_ranks} without EP (every expert's width split over "
            "the ranks): not the layout predicted; --plain-expert-parallel measures that one.")
        if oversubscribed:
            mismatch += (f" The planner gives every rank a device of its own (AFD {layout.ranks}, plain "
                         f"{layout.plain_ranks}); here {layout.ranks} ranks share {cores} cores.")
        if profile_layers != num_layers:
            mismatch += f" The profile's {profile_layers} layers replaced by the served model's {num_layers}."
        planned_note = PREDICTION_NOTE.format(
            profile=args.predict, link=f" --link {args.predict_link}" if args.predict_link else "", context=context,
            x=layout.attention_ranks, y=layout.ffn_ranks, layout=layout.name, min_tokens=min_tokens,
            layers=num_layers, mismatch=mismatch)
    logs = Path(tempfile.mkdtemp(prefix="afd-bench-"))
    print(f"logs and timelines: {logs}", flush=True)
    # A killed bench must not leave its servers (seven at 1A1F with three stage counts, ~19 GiB) running:
    # SIGTERM unwinds the ExitStack below, which stops them.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    targets: list[Target] = []
    with contextlib.ExitStack() as stack:
        # Pinned (--pin-processes): plain 1 core on core 0, a plain of several DP ranks on both cores ("0-1").
        plains = [(layout.plain_label(plain_ep), layout.plain_cpus, "0-1" if layout.plain_ranks > 1 else "0",
                   layout.plain_args(plain_ep))]
        plains += [("plain 2 cores", "0-1", "0-1", [])] if args.plain_2_cores else []
        for label, cpus, pinned, parallel in plains:
            prefix = ("taskset", "-c", pinned) if args.pin_processes else ()
            server = stack.enter_context(VllmServer(
                model, python=sys.executable, launcher="cli", log_path=logs / f"{label.replace(' ', '-')}.log",
                env={**cpu_server_env(omp_cpus=cpus), **env}, extra_args=[*parallel, *serve_args],
                command_prefix=prefix, startup_timeout_s=STARTUP_TIMEOUT_S))
            targets.append(Target(label, server.base_url, {"plain": server.pgid}))
        for k in num_stages:
            log_dir = logs / f"stages-{k}"
            fields: dict[str, object] = {**layout.afd_fields(), "num_stages": k}
            if args.min_tokens_per_stage is not None and k > 1:
                fields["min_tokens_per_stage"] = args.min_tokens_per_stage
            # NOTE: the timeline's detail (stage_model) reads attention rank 0's steps of the whole batch: 1A1F only.
            if not args.no_timeline and len(num_stages) > 1 and layout.attention_ranks == 1:
                fields["timeline_dir"] = str(log_dir / "timeline")
            afd = stack.enter_context(AFDDeployment(
                model, python=sys.executable, log_dir=log_dir, env=env, afd_fields=fields,
                attention_args=[*layout.attention_args(), *serve_args], ffn_args=[*layout.ffn_args(), *serve_args],
                attention_cpus=layout.attention_cpus, ffn_cpus=layout.ffn_cpus, pin_processes=args.pin_processes,
                startup_timeout_s=STARTUP_TIMEOUT_S))
            targets.append(Target(f"AFD {k} stage{'s' if k > 1 else ''}", afd.attention.base_url,
                                  {"attention": afd.attention.pgid, "ffn": afd.ffn.pgid}, num_stages=k,
                                  timeline=log_dir / "timeline" if "timeline_dir" in fields else None))
        print(f"{len(targets)} deployments up ({time.strftime('%H:%M:%S')}, load {os.getloadavg()[0]:.2f})", flush=True)
        started = datetime.datetime.now(datetime.timezone.utc)
        load_before = os.getloadavg()[0]
        run_rounds(targets, batch_sizes, args.decode_tokens, args.repeats, args.settle_s, args.warmup_rounds)

    pinned = (f", every process pinned (attention core 1, FFN core 0, {targets[0].label} "
              f"{'core 0' if layout.plain_ranks == 1 else 'cores 0-1'})" if args.pin_processes else "")
    pinned += f", min_tokens_per_stage {args.min_tokens_per_stage or DEFAULT_MIN_TOKENS_PER_STAGE}"
    pinned += f", dtype {dtype}" if dtype else ""
    pinned += (f", {layout.ranks} ranks on {cores} cores: oversubscribed" if oversubscribed else "")
    others = [c[OTHER_JOBS] for t in targets for b in batch_sizes for c in t.cpu[b]] or [float("nan")]
    title = (f"Decode throughput, AFD {layout.name} vs {targets[0].label}, {args.arch}, {args.prompt_tokens}-token "
             f"prompts of their own, prefix caching off, "
             f"{args.decode_tokens} decode tokens, {args.repeats} interleaved rounds after {args.warmup_rounds} "
             f"warm-up{pinned} ({started:%Y-%m-%d %H:%M}–{datetime.datetime.now(datetime.timezone.utc):%H:%M} UTC, "
             f"load {load_before:.2f} at the first round, {os.getloadavg()[0]:.2f} at the end; other jobs "
             f"{min(others):.2f}–{max(others):.2f} cores, median {median(others):.2f}, per sample)")
    lines = report(targets, batch_sizes, title, args.min_tokens_per_stage or DEFAULT_MIN_TOKENS_PER_STAGE,
                   args.max_other_cores, planned, planned_note)
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench-afd-cpu.md").write_text("\n".join(lines) + "\n")
        if num_stages == [1]:
            write_plot([(b, median(targets[0].tok_s[b]), median(targets[-1].tok_s[b])) for b in batch_sizes],
                       args.out / "bench-afd-cpu.png", f"{targets[0].label}",
                       f"AFD {layout.name} gloo ({min(layout.ranks, cores)} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
