"""What one serving round records (phases.py): the greedy-token comparisons and the decode bench.

Pure: the round's raw results in, the dicts of `summary["phases"]["tokens"|"bench"]["models"][arch]` out
(tests/tools/test_device_scripts.py, tests/tools/test_device_ipc.py).
"""

from __future__ import annotations

from typing import Any

import e2e_report as report
import ipc_report


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
        for by_len in bench.get("by_prompt_len", {}).values():
            if "variants" in by_len:
                by_len["serving_per_layer_ms_by_variant"] = ipc_report.per_layer_by_variant(
                    by_len["variants"], by_len["batches"], num_layers)
    return bench
