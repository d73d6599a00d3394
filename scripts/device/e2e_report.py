"""Pure parts of the GPU end-to-end run: phases, prompts, token comparison, rates, the report.

`gpu_e2e.py` drives servers on the lent GPU machine, where every minute costs device time;
everything that needs no GPU and no vLLM lives here so that it is unit-tested on the CPU
machine (tests/tools/test_device_scripts.py): phase selection, the fixed prompt sets, the
greedy-token comparison (AFD vs plain vLLM, graphs vs eager), decode rates from timed
requests, the ratios the bench pairs by repetition, and the markdown rendering of `summary.json`.
Stdlib only.
"""

from __future__ import annotations

import random
import re
import statistics
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

# Execution order.  "pristine" runs the unpatched tree, so it must precede "patch".
PHASES = ("models", "pristine", "patch", "gputests", "rtt", "ipcfloor", "tokens", "bench", "hooks", "heal", "profile")
DEFAULT_PHASES = ("patch", "models", "gputests", "rtt", "ipcfloor", "tokens", "bench", "hooks")

# Token checks: a few text prompts in the tiny tokenizer's domain, plus one chat turn.
TEXT_PROMPTS = (
    "The quick brown fox",
    "Attention layers mix information across positions;",
    "In a mixture of experts, a router sends every token",
    "Once upon a time there was a little robot who",
    "What is the capital of France?",
    "Numbers such as 1, 2, 3",
)
CHAT_MESSAGE = "How many legs does a spider have?"
# First token id a bench prompt may use: the tiny tokenizer's 6 special tokens come first.  Every model the
# run serves, the real-shape ones included, has the tiny tokenizer's 512 ids (afd_harness.tiny_models).
FIRST_PLAIN_TOKEN_ID = 6
TINY_VOCAB_SIZE = 512
# The bench's prompts (serving.bench_prompts) differ in their first two of these ids: at most their square.
BENCH_PROMPT_IDS = TINY_VOCAB_SIZE - FIRST_PLAIN_TOKEN_ID

# Variant names: the baseline everything is compared with, and the candidates.
BASELINE = "plain_eager"
# Micro-batch stage variants (serving.AFD_VARIANTS): each against the baseline and its one-stage twin.
STAGE_VARIANTS = tuple(f"afd_ipc_{mode}_s{k}" for mode in ("eager", "graphs") for k in (2, 3))
AFD_VARIANTS = ("afd_eager", "afd_ipc_eager", "afd_ipc_graphs", *STAGE_VARIANTS)
# The bench's ratios taken per repetition (round_records.paired_records): (numerator, denominator) variants.
PAIRED_RATIOS = (*((v, "plain_graphs") for v in AFD_VARIANTS), *((v, BASELINE) for v in AFD_VARIANTS),
                 ("plain_graphs", BASELINE), ("afd_ipc_eager", "afd_eager"),
                 *((v, v.rsplit("_s", 1)[0]) for v in STAGE_VARIANTS))
# What the bench tables' columns are (every ratio a paired median: round_records.paired_records).
RATIOS_NOTE = "tok/s: median of repeats; ratios: median of the per-repetition ratios"
COMPARISONS = (("afd_eager", BASELINE), ("plain_graphs", BASELINE), ("pristine_eager", BASELINE),
               ("afd_ipc_eager", BASELINE), ("afd_ipc_graphs", BASELINE), ("afd_ipc_graphs", "plain_graphs"),
               *((v, BASELINE) for v in STAGE_VARIANTS), *((v, v.rsplit("_s", 1)[0]) for v in STAGE_VARIANTS))


def parse_phases(text: str) -> list[str]:
    """'tokens,patch' -> ['patch', 'tokens'] (execution order); 'all' -> every phase."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if names == ["all"]:
        return list(PHASES)
    unknown = sorted(set(names) - set(PHASES))
    if unknown or not names:
        raise ValueError(
            f"--phases: unknown phase(s) {unknown or '(none given)'}; expected a comma-separated subset "
            f"of {', '.join(PHASES)} or 'all'. Example: --phases patch,models,tokens"
        )
    return [phase for phase in PHASES if phase in names]


def parse_int_list(text: str, what: str) -> list[int]:
    """'1,32' -> [1, 32]; every entry a positive integer."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(value <= 0 for value in values):
        raise ValueError(f"{what}: {text!r} is not a list of positive integers; expected e.g. '1,32'.")
    return values


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    """'2GiB' / '512m' / '1073741824' -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"size {text!r} is not understood; expected a number with an optional unit "
                         "(B, KiB, MiB, GiB), e.g. '2GiB'.")
    return int(float(match.group(1)) * _UNITS[unit])


def bench_prompt_ids(num_prompts: int, prompt_len: int, seed: int = 0,
                     vocab_size: int = TINY_VOCAB_SIZE) -> list[list[int]]:
    """Deterministic token-id prompts of equal length, free of special tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_PLAIN_TOKEN_ID, vocab_size) for _ in range(prompt_len)]
            for _ in range(num_prompts)]


def first_difference(reference: Sequence[int], candidate: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts); None when equal."""
    for index, (ref, cand) in enumerate(zip(reference, candidate)):
        if ref != cand:
            return index
    if len(reference) != len(candidate):
        return min(len(reference), len(candidate))
    return None


def compare_case(reference: Sequence[Sequence[int] | None], candidate: Sequence[Sequence[int] | None],
                 context: int = 3) -> dict[str, Any]:
    """Greedy token agreement of one request case, prompt by prompt."""
    mismatches = []
    if len(reference) != len(candidate):
        return {"num_prompts": len(reference), "num_identical": 0, "mismatches": [],
                "error": f"prompt counts differ (reference {len(reference)}, candidate {len(candidate)})"}
    for index, (ref, cand) in enumerate(zip(reference, candidate)):
        if ref is None or cand is None:
            mismatches.append({"index": index, "first_diff": None, "error": "no token ids returned"})
            continue
        diff = first_difference(ref, cand)
        if diff is not None:
            lo = max(0, diff - context)
            mismatches.append({"index": index, "first_diff": diff, "ref_len": len(ref), "cand_len": len(cand),
                               "ref_tokens": list(ref[lo:diff + context]),
                               "cand_tokens": list(cand[lo:diff + context])})
    return {"num_prompts": len(reference), "num_identical": len(reference) - len(mismatches),
            "mismatches": mismatches}


def compare_variants(reference: Mapping[str, Sequence[Sequence[int] | None]],
                     candidate: Mapping[str, Sequence[Sequence[int] | None]]) -> dict[str, Any]:
    """Compare every case both variants ran; `identical` is True only if all prompts of all cases agree."""
    cases = {name: compare_case(reference[name], candidate[name]) for name in reference if name in candidate}
    missing = sorted(set(reference) ^ set(candidate))
    identical = bool(cases) and not missing and all(
        case["num_identical"] == case["num_prompts"] and "error" not in case for case in cases.values())
    return {"identical": identical, "cases": cases, "cases_missing": missing}


def decode_rate(batch: int, max_tokens: int, full_s: float, prefill_s: float) -> dict[str, float] | None:
    """Decode tok/s and TPOT from a max_tokens request and a 1-token request of the same prompts.

    Subtracting the 1-token request removes prefill, the first token and HTTP overheads;
    what is left is max_tokens - 1 decode steps of `batch` sequences.
    """
    decode_s = full_s - prefill_s
    if max_tokens < 2 or decode_s <= 0:
        return None
    num_steps = max_tokens - 1
    return {"tok_s": batch * num_steps / decode_s, "tpot_ms": 1000.0 * decode_s / num_steps}


def median_rate(samples: Sequence[Mapping[str, float] | None]) -> dict[str, Any] | None:
    """Median tok/s and TPOT over repeats (None samples dropped), with the spread."""
    valid = [s for s in samples if s is not None]
    if not valid:
        return None
    rates = [s["tok_s"] for s in valid]
    return {"tok_s": statistics.median(rates), "tpot_ms": statistics.median(s["tpot_ms"] for s in valid),
            "tok_s_min": min(rates), "tok_s_max": max(rates), "num_samples": len(valid)}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def percentiles_ms(samples_s: Sequence[float]) -> dict[str, float]:
    """p50 / p99 / mean of durations given in seconds, in milliseconds."""
    ordered = sorted(samples_s)
    if not ordered:
        return {}
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"p50": 1000 * statistics.median(ordered), "p99": 1000 * p99, "mean": 1000 * statistics.fmean(ordered)}


def serving_per_layer_ms(afd_tpot_ms: float | None, plain_tpot_ms: float | None,
                         num_crossing_layers: int) -> float | None:
    """AFD's extra time per decode step spread over the layers that cross (derived, not measured)."""
    if afd_tpot_ms is None or plain_tpot_ms is None or num_crossing_layers <= 0:
        return None
    return (afd_tpot_ms - plain_tpot_ms) / num_crossing_layers


# ---------------------------------------------------------------------------------------- markdown

def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_fmt(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def junit_cases(xml_text: str) -> list[dict[str, str]]:
    """pytest's --junitxml report -> [{"test": "file::name", "outcome": passed|failed|error|skipped}]."""
    cases = []
    for case in ElementTree.fromstring(xml_text).iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        outcome = {"failure": "failed"}.get(outcome, outcome)
        module = case.get("classname", "").replace(".", "/")
        cases.append({"test": f"{module}.py::{case.get('name')}", "outcome": outcome})
    return cases


def junit_counts(xml_text: str) -> dict[str, int]:
    """Outcome -> number of tests, from pytest's --junitxml report."""
    counts: dict[str, int] = {}
    for case in junit_cases(xml_text):
        counts[case["outcome"]] = counts.get(case["outcome"], 0) + 1
    return counts


def _gputest_lines(gputests: Mapping[str, Any]) -> list[str]:
    rows = [[case["test"], case["outcome"]] for case in gputests.get("tests", [])]
    if not rows:
        return []
    return ["### pytest on the GPU", "", markdown_table(["test", "outcome"], rows)]


def _phase_lines(phases: Mapping[str, Any]) -> list[str]:
    rows = []
    for name, phase in phases.items():
        error = (phase.get("error") or "").strip().splitlines()
        rows.append([name, phase.get("status"), phase.get("seconds"), error[-1][:160] if error else ""])
    return [markdown_table(["phase", "status", "seconds", "last error line"], rows)]


def _token_lines(tokens: Mapping[str, Any]) -> list[str]:
    rows = []
    for model, result in tokens.get("models", {}).items():
        for name, comparison in result.get("comparisons", {}).items():
            if "error" in comparison:
                rows.append([model, name, "—", "—", comparison["error"][:120]])
                continue
            cases = comparison["cases"]
            if comparison["identical"]:  # one row for the whole comparison
                num_prompts = sum(case["num_prompts"] for case in cases.values())
                rows.append([model, name, f"all {len(cases)} cases", f"{num_prompts}/{num_prompts}", "identical"])
                continue
            for case, outcome in cases.items():
                diffs = [m.get("first_diff") for m in outcome["mismatches"]]
                rows.append([model, name, case, f"{outcome['num_identical']}/{outcome['num_prompts']}",
                             ", ".join(map(str, diffs)) or "identical"])
            for case in comparison.get("cases_missing", []):
                rows.append([model, name, case, "—", "missing on one side"])
    if not rows:
        return []
    return ["### Greedy-token agreement", "",
            markdown_table(["model", "comparison", "case", "identical", "first divergence (per mismatch)"], rows)]


def paired_ratio(part: Mapping[str, Any], numerator: str, denominator: str, batch: Any) -> float | None:
    """numerator ÷ denominator at `batch`: the median of the per-repetition ratios where the bench paired this
    ratio's repetitions (round_records.paired_records; None where no repetition paired), else the two median
    rates divided (a ratio outside report.PAIRED_RATIOS, or a bench recorded before the pairing)."""
    if f"{numerator}/{denominator}" in (part.get("paired") or {}):
        return paired_cell(part, numerator, denominator, batch).get("median")
    variants = part.get("variants", {})
    return ratio(tok_s(variants, numerator, batch), tok_s(variants, denominator, batch))


def paired_cell(part: Mapping[str, Any], numerator: str, denominator: str, batch: Any) -> Mapping[str, Any]:
    """The bench's per-repetition record of numerator ÷ denominator at `batch` (empty where it has none)."""
    return (part.get("paired") or {}).get(f"{numerator}/{denominator}", {}).get(str(batch), {})


def tok_s(variants: Mapping[str, Any], variant: str, batch: Any) -> float | None:
    """The variant's median tok/s at `batch` (a bench's `variants`), or None where it has none."""
    entry = variants.get(variant, {}).get(str(batch))
    return entry["tok_s"] if entry else None


def _bench_parts(bench: Mapping[str, Any]) -> Iterator[tuple[str, Any, Mapping[str, Any]]]:
    """(model, prompt length, part) of each prompt length the bench ran; a one-length bench is its own part."""
    for model, result in bench.get("models", {}).items():
        for prompt_len, part in (result.get("by_prompt_len") or {result.get("prompt_len"): result}).items():
            yield model, prompt_len, part


def _bench_lines(bench: Mapping[str, Any]) -> list[str]:
    rows = []
    for model, result in bench.get("models", {}).items():
        variants = result.get("variants", {})
        for batch in result.get("batches", []):
            rows.append([model, batch,
                         *(tok_s(variants, v, batch) for v in ("plain_eager", "plain_graphs", "afd_eager")),
                         paired_ratio(result, "afd_eager", "plain_eager", batch),
                         paired_ratio(result, "afd_eager", "plain_graphs", batch),
                         paired_ratio(result, "plain_graphs", "plain_eager", batch)])
    if not rows:
        return []
    return [f"### Decode throughput ({RATIOS_NOTE})", "",
            markdown_table(["model", "batch", "plain eager", "plain graphs", "AFD eager (gloo)",
                            "AFD / plain eager", "AFD / plain graphs", "graphs / eager"], rows),
            *_stage_lines(bench), *_prompt_len_lines(bench), *_paired_lines(bench),
            *_spread_lines(bench)]


def _stage_lines(bench: Mapping[str, Any]) -> list[str]:
    """Micro-batch stages: each split variant's tok/s ÷ its one-stage twin, measured and predicted from the twin's
    timeline (stage_prediction.py), each role's busy share at one stage, and ÷ plain of the same mode."""
    rows, failures = [], []
    for model, prompt_len, part in _bench_parts(bench):
        variants, predictions = part.get("variants", {}), part.get("stage_prediction") or {}
        if "error" in predictions:  # annotate() raised: the round's other results stand
            failures.append(f"{model}, {prompt_len} prompt tokens: {predictions['error']}")
            predictions = {}
        for batch in part.get("batches", []):
            for variant in STAGE_VARIANTS:
                if variant not in variants:
                    continue
                twin = variant.rsplit("_s", 1)[0]
                plain = "plain_graphs" if "_graphs_" in variant else "plain_eager"
                cell = predictions.get(variant, {}).get("batches", {}).get(str(batch), {})
                busy = (cell.get("attention_busy_1_stage"), cell.get("ffn_busy_1_stage"))
                rows.append([model, prompt_len, batch, variant, tok_s(variants, variant, batch),
                             tok_s(variants, twin, batch), paired_ratio(part, variant, twin, batch),
                             cell.get("predicted"), None if None in busy else f"{busy[0]:.2f} / {busy[1]:.2f}",
                             tok_s(variants, plain, batch), paired_ratio(part, variant, plain, batch)])
    if not rows:
        return []
    return ["", f"### Micro-batch stages ({RATIOS_NOTE})", "",
            markdown_table(["model", "prompt tokens", "batch", "variant", "tok/s", "1 stage", "÷ 1 stage",
                            "predicted ÷ 1 stage", "attention / FFN busy (1 stage)", "plain (same mode)", "÷ plain"],
                           rows),
            "", "Predicted ÷ 1 stage: docs/pingpong.md#10-predicted-speed-up fed by the one-stage twin's timeline "
            "(per-layer attention compute, FFN compute and transport, fitted over the benched batch sizes; with one "
            "batch size the fit is flat and never predicts a gain): the twin's step with its layers re-simulated at "
            "batch ÷ k tokens per stage.  Busy: each role's compute and send issue ÷ its span of the step's layers, "
            "at one stage.  Both roles share the one H200 (their kernels time-slice), so the prediction is what two "
            "GPUs, one per role, would give: a miss on one GPU is the sharing as well as any bubble.  —: no "
            "timeline (run with --timeline).",
            *(f"Stage prediction failed: {failure}" for failure in failures)]


def _prompt_len_lines(bench: Mapping[str, Any]) -> list[str]:
    """One row per (model, prompt length, batch) when the bench ran several prompt lengths."""
    rows = []
    for model, result in bench.get("models", {}).items():
        for prompt_len, by_len in result.get("by_prompt_len", {}).items():
            variants, per_layer = by_len.get("variants", {}), by_len.get("serving_per_layer_ms_by_variant", {})
            for batch in by_len.get("batches", []):
                rows.append([model, prompt_len, batch,
                             *(tok_s(variants, v, batch) for v in ("plain_eager", "plain_graphs", "afd_ipc_graphs")),
                             paired_ratio(by_len, "afd_ipc_graphs", "plain_graphs", batch),
                             per_layer.get("afd_ipc_graphs", {}).get(str(batch))])
    if not rows:
        return []
    return ["", f"### Decode throughput by prompt length (AFD over IPC with graphs; {RATIOS_NOTE})", "",
            markdown_table(["model", "prompt tokens", "batch", "plain eager", "plain graphs", "AFD IPC graphs",
                            "AFD IPC graphs / plain graphs", "serving ms per crossing layer"], rows)]


def _paired_lines(bench: Mapping[str, Any]) -> list[str]:
    """The ratios taken per repetition (round_records.paired_records): median, min–max, halves, and the ratio of
    the median rates beside them; one row per (model, prompt length, ratio, batch)."""
    rows = []
    for model, prompt_len, part in _bench_parts(bench):
        for name, by_batch in (part.get("paired") or {}).items():
            for batch, cell in by_batch.items():
                low, high, gap = cell.get("min"), cell.get("max"), cell.get("halves_differ")
                paired = cell.get("num_paired", 0)
                rows.append([model, prompt_len, batch, name.replace("/", " ÷ "), cell.get("median"),
                             "—" if low is None else f"{low:.3g}–{high:.3g}", cell.get("first_half"),
                             cell.get("second_half"), "—" if gap is None else f"{100 * gap:.1f} %",
                             cell.get("median_of_rates"),
                             f"{paired}/{paired + cell.get('num_missing', 0)}"])
    if not rows:
        return []
    return ["", "### Decode throughput ratios per repetition (the two variants' rates of one repetition divided)", "",
            markdown_table(["model", "prompt tokens", "batch", "ratio", "median", "min–max", "first half",
                            "second half", "halves differ", "median ÷ median", "reps paired"], rows),
            "", "median: of the per-repetition ratios (both variants' requests ran in the same repetition, every "
            "request with prompts of its own); first / second half: the medians of the first and the second half "
            "of the repetitions in time (a middle one in neither), whose gap is what a second run of half the "
            "length could show; median ÷ median: the median rates divided (the tables above); reps paired: "
            "repetitions where both variants had a rate, of those recorded."]


def _spread_lines(bench: Mapping[str, Any]) -> list[str]:
    """One server's rate between repetitions (round_records.rate_spread), a row per (model, prompt length,
    variant, batch)."""
    rows = []
    for model, prompt_len, part in _bench_parts(bench):
        for variant, by_batch in (part.get("rate_spread") or {}).items():
            for batch, cell in by_batch.items():
                rows.append([model, prompt_len, batch, variant, cell["num_reps"], f"{cell['cv']:.3f}",
                             f"{cell['slowest']:.2f}", f"{cell['fastest']:.2f}"])
    if not rows:
        return []
    return ["", "### Each server's rate between repetitions", "",
            markdown_table(["model", "prompt tokens", "batch", "variant", "reps", "coefficient of variation",
                            "slowest ÷ median", "fastest ÷ median"], rows)]


def _rtt_lines(rtt: Mapping[str, Any], bench: Mapping[str, Any]) -> list[str]:
    rows = []
    for row in rtt.get("rows", []):
        raw, staged, conn = row.get("raw_host_ms", {}), row.get("raw_staged_ms", {}), row.get("connector_ms", {})
        floor = staged.get("p50") or raw.get("p50")
        rows.append([f"{row['rows']}x{row['hidden']}", raw.get("p50"), staged.get("p50"), conn.get("p50"),
                     conn.get("p99"), ratio(conn.get("p50"), floor)])
    lines = []
    if rows:
        lines += ["### Per-layer round trip, gloo (ms)", "",
                  markdown_table(["rows x hidden", "raw host p50", "raw CUDA-staged p50", "connector p50",
                                  "connector p99", "connector / raw (staged on CUDA) p50"], rows)]
    floors = {(row["rows"], row["hidden"]): (row.get("raw_staged_ms") or row.get("raw_host_ms") or {}).get("p50")
              for row in rtt.get("rows", [])}
    derived = []
    for model, result in bench.get("models", {}).items():
        for batch, value in result.get("serving_per_layer_ms", {}).items():
            if value is None:
                continue
            floor = floors.get((int(batch), result.get("hidden_size")))
            derived.append([model, batch, value, result.get("num_crossing_layers"), floor, ratio(value, floor)])
    external = rtt.get("bench_gloo_roundtrip", {})
    if external.get("table"):
        lines += ["", "scripts/bench_gloo_roundtrip.py (raw = host bytes only; alternating blocks):", "",
                  "```", external["table"], "```"]
    if derived:
        lines += ["", "Serving-derived AFD cost per crossing layer = (TPOT AFD − TPOT plain eager) / layers, "
                  "against the raw round trip of the same rows x hidden:", "",
                  markdown_table(["model", "batch", "ms per layer", "crossing layers", "raw p50 ms",
                                  "serving / raw"], derived)]
    return lines


def _server_lines(servers: Mapping[str, Any]) -> list[str]:
    rows = []
    for round_name, infos in servers.items():
        for name, server in infos.items():
            rows.append([round_name, name, server.get("status"), server.get("startup_s"),
                         ", ".join(server.get("backends", [])), ", ".join(server.get("moe_backends", [])),
                         server.get("graphs_captured"),
                         server.get("exit_code"), server.get("num_tracebacks_serving"), server.get("num_tracebacks")])
    if not rows:
        return []
    return ["### Servers", "", markdown_table(["round", "server", "status", "startup s", "attention backend",
                                               "MoE backend", "graphs captured", "exit code", "tracebacks serving",
                                               "tracebacks total"], rows)]


def _failure_lines(servers: Mapping[str, Any], num_lines: int = 12) -> list[str]:
    """The end of each failed server's start error (its log tail), so the reply shows the cause."""
    lines = []
    for round_name, infos in servers.items():
        for name, server in infos.items():
            if server.get("status") == "failed":
                tail = "\n".join(str(server.get("error", "")).splitlines()[-num_lines:])[-1500:]
                lines += ["", f"### {round_name} / {name} failed to start", "", "```", tail, "```"]
    return lines


def verdict_lines(summary: Mapping[str, Any]) -> list[str]:
    """One line per model: token agreement of each comparison, the FFN refusal, AFD's tok/s ratios."""
    phases = summary.get("phases", {})
    tokens = phases.get("tokens", {}).get("models", {})
    bench = phases.get("bench", {}).get("models", {})
    lines = []
    for model in dict.fromkeys([*tokens, *bench]):
        parts = []
        for name, comparison in tokens.get(model, {}).get("comparisons", {}).items():
            parts.append(f"{name.replace('_vs_', ' vs ')}: "
                         + ("identical" if comparison.get("identical") else "**DIFFERENT**"))
        not_up = tokens.get(model, {}).get("variants_not_up")
        if not_up:
            parts.append(f"**not up: {', '.join(not_up)}**")
        refusal = tokens.get(model, {}).get("ffn_refuses_requests")
        if refusal is not None:
            parts.append("FFN refuses requests: " + ("yes" if refusal.get("points_to_attention") else "**no**"))
        variants = bench.get(model, {}).get("variants", {})
        for batch in bench.get(model, {}).get("batches", []):
            afd, plain = (variants.get(v, {}).get(str(batch)) for v in ("afd_eager", "plain_eager"))
            value = ratio(afd and afd["tok_s"], plain and plain["tok_s"])
            parts.append(f"AFD/plain eager tok/s at B={batch}: {_fmt(value)}")
        lines.append(f"- **{model}**: " + "; ".join(parts))
    return lines


def render_markdown(summary: Mapping[str, Any], extra: Sequence[str] = ()) -> str:
    """summary.json -> summary.md: phase table, then tokens, throughput, round trips, `extra` lines, servers,
    hooks."""
    phases = summary.get("phases", {})
    lines = [f"# GPU end-to-end run ({summary.get('started_at', '?')})", "",
             f"Device: {summary.get('device', {}).get('name', '?')}; torch "
             f"{summary.get('device', {}).get('torch', '?')}; phases {', '.join(phases)}.", ""]
    lines += _phase_lines(phases)
    verdict = verdict_lines(summary)
    if verdict:
        lines += ["", "### Verdict", ""] + verdict
    for block in (_gputest_lines(phases.get("gputests", {})), _token_lines(phases.get("tokens", {})),
                  _bench_lines(phases.get("bench", {})),
                  _rtt_lines(phases.get("rtt", {}), phases.get("bench", {})), list(extra),
                  _server_lines(summary.get("servers", {}))):
        if block:
            lines += [""] + block
    pristine = phases.get("pristine", {})
    if "tokens_vs_patched_plain_eager" in pristine or "patched_over_pristine_tok_s" in pristine:
        same = pristine.get("tokens_vs_patched_plain_eager", {}).get("identical")
        rates = ", ".join(f"B={batch}: {_fmt(value)}"
                          for batch, value in pristine.get("patched_over_pristine_tok_s", {}).items())
        lines += ["", "### Hook cost, AFD off (patched vs pristine vLLM, eager)", "",
                  f"{pristine.get('model')}: tokens {'identical' if same else '**DIFFERENT**'}; "
                  f"tok/s patched / pristine: {rates or '—'} (sequential runs, not interleaved)"]
    for arch, tables in summary.get("timeline", {}).items():
        lines += ["", f"### Timeline, {arch} (docs/timeline.md)", ""]
        if isinstance(tables, Mapping) and "error" not in tables:
            for variant, table in tables.items():
                lines += [f"{variant}:", "", str(table).strip(), ""]
        else:
            lines += [f"{tables}"]
    lines += _failure_lines(summary.get("servers", {}))
    hooks = phases.get("hooks")
    if hooks:
        lines += ["", "### Hook GPU check", "", f"status: {hooks.get('status')}; result: "
                  f"{_fmt(hooks.get('result_status'))}"]
        result = hooks.get("result")
        if isinstance(result, Mapping):
            lines += [f"failures: {result.get('failures') or 'none'}; tokens eager == graphs: "
                      f"{_fmt(result.get('tokens_equal_eager_vs_graphs'))}"]
    notes = summary.get("notes", [])
    if notes:
        lines += ["", "### Notes", ""] + [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"
