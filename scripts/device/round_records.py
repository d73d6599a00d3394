"""What one serving round records (phases.py): the greedy-token comparisons and the decode bench.

Pure: the round's raw results in, the dicts of `summary["phases"]["tokens"|"bench"]["models"][arch]` out
(tests/tools/test_device_scripts.py, tests/tools/test_device_ipc.py).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

# paired_rounds.py sits in scripts/ (repo_paths puts it on sys.path on the GPU machine).
import repo_paths  # noqa: F401
import e2e_report as report
import ipc_report
from paired_rounds import pair_rounds, relative_gap


def tokens_record(result: dict[str, Any]) -> dict[str, Any]:
    """Every comparison of report.COMPARISONS whose two variants answered, and who was not up."""
    outputs = result.get("outputs", {})
    comparisons = {}
    for candidate, reference in report.COMPARISONS:
        if candidate in outputs and reference in outputs:
            ref, cand = outputs[reference], outputs[candidate]
            if "error" in ref or "error" in cand:
                comparisons[f"{candidate}_vs_{reference}"] = {"error": ref.get("error") or cand.get("error")}
            else:
                comparisons[f"{candidate}_vs_{reference}"] = report.compare_variants(ref, cand)
    missing = sorted(set(result["variants"]) - set(result.get("variants_up", [])))
    return {"variants_up": result.get("variants_up"), "variants_not_up": missing,
            "ffn_refuses_requests": result.get("ffn_refuses_requests"), "comparisons": comparisons,
            "outputs": outputs}


def bench_record(result: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    """The round's decode bench plus the model facts and serving-derived costs per crossing layer."""
    bench = result.get("bench") or {"error": "no bench result (no server up or no time left)"}
    if "variants" in bench:
        num_layers = int(model["config"]["num_hidden_layers"])
        bench["num_crossing_layers"] = num_layers
        bench["hidden_size"] = int(model["config"]["hidden_size"])
        # (TPOT AFD - TPOT plain, same graph mode) / layers, per AFD variant; gloo's also under its old key
        by_variant = ipc_report.per_layer_by_variant(bench["variants"], bench["batches"], num_layers)
        bench["serving_per_layer_ms_by_variant"] = by_variant
        bench["serving_per_layer_ms"] = by_variant.get("afd_eager", {})
        bench["paired"] = paired_records(bench)
        bench["rate_spread"] = rate_spread(bench)
        for by_len in bench.get("by_prompt_len", {}).values():
            if "variants" in by_len:
                by_len["serving_per_layer_ms_by_variant"] = ipc_report.per_layer_by_variant(
                    by_len["variants"], by_len["batches"], num_layers)
                by_len["paired"] = paired_records(by_len)
                by_len["rate_spread"] = rate_spread(by_len)
    return bench


def paired_records(part: Mapping[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Every ratio of report.PAIRED_RATIOS whose variants both ran, per batch, taken rep by rep.

    "numerator/denominator" -> batch -> the median of the per-rep ratios with their min–max, the medians of the
    first and the second half of the reps and their gap, the per-rep ratios (None where a rep lacks a rate), and
    `median_of_rates`, the ratio of the two median rates (`variants`: the bench's older number).  Nothing for a
    bench without `per_rep_tok_s` (one recorded before the rates were kept per rep).
    """
    per_rep, variants = part.get("per_rep_tok_s") or {}, part.get("variants", {})
    records: dict[str, dict[str, dict[str, Any]]] = {}
    for numerator, denominator in report.PAIRED_RATIOS:
        if numerator not in per_rep or denominator not in per_rep:
            continue
        cells = {}
        for batch in part.get("batches", []):
            above, below = per_rep[numerator].get(str(batch), []), per_rep[denominator].get(str(batch), [])
            cell = pair_rounds(above, below)
            first, second = cell.halves
            cells[str(batch)] = {
                "median": _number(cell.median), "min": _number(cell.low), "max": _number(cell.high),
                "first_half": _number(first), "second_half": _number(second),
                "halves_differ": _number(relative_gap(first, second)),
                "num_paired": len(cell.ratios), "num_missing": cell.missing,
                "ratios": [n / d if n is not None and d is not None else None for n, d in zip(above, below)],
                "median_of_rates": report.ratio(report.tok_s(variants, numerator, batch),
                                                report.tok_s(variants, denominator, batch))}
        records[f"{numerator}/{denominator}"] = cells
    return records


def rate_spread(part: Mapping[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """How much one server's rate moves between repetitions: variant -> batch -> the coefficient of variation
    (population standard deviation over mean) and the slowest and fastest repetition over the median; a
    ratio's two runs can only agree as closely as these allow."""
    spread: dict[str, dict[str, dict[str, Any]]] = {}
    for variant, by_batch in (part.get("per_rep_tok_s") or {}).items():
        for batch, rates in by_batch.items():
            rates = sorted(r for r in rates if r is not None)
            if len(rates) < 2:
                continue
            median = statistics.median(rates)
            spread.setdefault(variant, {})[batch] = {"num_reps": len(rates),
                                                     "cv": statistics.pstdev(rates) / statistics.fmean(rates),
                                                     "slowest": rates[0] / median, "fastest": rates[-1] / median}
    return spread


def _number(value: float) -> float | None:
    """None for nan (too few reps): summary.json stays plain JSON."""
    return None if math.isnan(value) else value
