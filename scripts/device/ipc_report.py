"""Pure parts of the GPU run's CUDA IPC rows: AFD over P2pIpcAFDConnector against plain vLLM and gloo.

The round serves AFD over IPC (eager, and FULL_DECODE_ONLY on both roles) next to plain vLLM and AFD
over gloo (serving.py); the `ipcfloor` phase measures the transport's own round trip
(bench_ipc_floor.py). This module turns both into the ratios of docs/conventions.md#measuring-performance:
decode tok/s AFD(IPC, graphs) / plain graphs and / plain eager, AFD(IPC, eager) / AFD(gloo, eager),
and serving's per-layer cost / the floor of the same rows x hidden. Stdlib only, tested on CPU
(tests/tools/test_device_scripts.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import e2e_report as report

IPC_VARIANTS = ("afd_ipc_eager", "afd_ipc_graphs")
# AFD variant -> the plain variant of the same graph mode; its serving cost per layer is measured against it.
SERVING_BASELINES = {"afd_eager": "plain_eager", "afd_ipc_eager": "plain_eager", "afd_ipc_graphs": "plain_graphs"}
# AFD variant -> the floor it is divided by (bench_ipc_floor.py modes).
FLOOR_MODES = {"afd_ipc_eager": "raw_eager_ms", "afd_ipc_graphs": "raw_graph_ms"}


def per_layer_by_variant(variants: Mapping[str, Any], batches: Sequence[int],
                         num_layers: int) -> dict[str, dict[str, float | None]]:
    """(TPOT AFD - TPOT of its plain baseline) / crossing layers, per AFD variant and batch."""
    result = {}
    for variant, baseline in SERVING_BASELINES.items():
        if variant not in variants:
            continue
        per_batch = {}
        for batch in batches:
            afd, plain = variants[variant].get(str(batch)), variants.get(baseline, {}).get(str(batch))
            per_batch[str(batch)] = report.serving_per_layer_ms(afd and afd["tpot_ms"], plain and plain["tpot_ms"],
                                                                num_layers)
        result[variant] = per_batch
    return result


def throughput_lines(bench: Mapping[str, Any]) -> list[str]:
    rows = []
    for model, result in bench.get("models", {}).items():
        variants = result.get("variants", {})
        if not set(IPC_VARIANTS) & set(variants):
            continue
        for batch in result.get("batches", []):
            rows.append([model, batch, report.tok_s(variants, "afd_ipc_graphs", batch),
                         report.tok_s(variants, "afd_ipc_eager", batch),
                         *(report.paired_ratio(result, numerator, denominator, batch) for numerator, denominator in (
                             ("afd_ipc_graphs", "plain_graphs"), ("afd_ipc_graphs", "plain_eager"),
                             ("afd_ipc_eager", "afd_eager"), ("afd_ipc_eager", "plain_eager")))])
    if not rows:
        return []
    return [f"### AFD over CUDA IPC: decode throughput ({report.RATIOS_NOTE})", "",
            report.markdown_table(["model", "batch", "AFD IPC graphs", "AFD IPC eager", "IPC graphs / plain graphs",
                                   "IPC graphs / plain eager", "IPC eager / gloo eager", "IPC eager / plain eager"],
                                  rows)]


def floor_lines(floor: Mapping[str, Any], bench: Mapping[str, Any]) -> list[str]:
    lines = []
    rows = [[f"{row['rows']}x{row['hidden']}", row.get("raw_graph_ms", {}).get("p50"),
             row.get("raw_eager_ms", {}).get("p50"), row.get("connector_eager_ms", {}).get("p50"),
             row.get("device_flags_graph_ms", {}).get("p50"), row.get("connector_eager_over_floor_p50")]
            for row in floor.get("rows", [])]
    if rows:
        lines += [f"### IPC round trip per layer (ms, p50; {floor.get('layers')} layers per step, "
                  "both roles on one GPU)",
                  "", report.markdown_table(["rows x hidden", "raw graph (floor)", "raw eager", "connector eager",
                                             "probe: device flags, graph", "connector eager / floor"], rows)]
    floors = {(row["rows"], row["hidden"]): row for row in floor.get("rows", [])}
    derived = []
    for model, result in bench.get("models", {}).items():
        for variant, per_batch in result.get("serving_per_layer_ms_by_variant", {}).items():
            if variant not in FLOOR_MODES:
                continue
            for batch, value in per_batch.items():
                row = floors.get((int(batch), result.get("hidden_size")), {})
                base = row.get(FLOOR_MODES[variant], {}).get("p50")
                derived.append([model, variant, batch, value, base, report.ratio(value, base)])
    if derived:
        lines += ["", "Serving-derived AFD cost per crossing layer = (TPOT AFD − TPOT plain, same graph mode) "
                  "/ layers, "
                  "against the IPC round trip of the same rows x hidden (graphs: raw graph; eager: raw eager):", "",
                  report.markdown_table(["model", "variant", "batch", "ms per layer", "floor p50 ms",
                                         "serving / floor"],
                                        derived)]
    return lines


def _verdict_ratio(result: Mapping[str, Any], numerator: str, denominator: str, batch: int) -> str | None:
    value = report.paired_ratio(result, numerator, denominator, batch)
    cell = report.paired_cell(result, numerator, denominator, batch)
    if value is None:
        return None
    spread = f" (per repetition {cell['min']:.3g}–{cell['max']:.3g})" if cell.get("median") is not None else ""
    return f"{value:.3g}{spread}"


def verdict_lines(bench: Mapping[str, Any]) -> list[str]:
    """One line per model: the median of the per-repetition ratios (with their min–max) where the bench paired
    its repetitions, else the ratio of the two median rates (a bench recorded before the pairing)."""
    lines = []
    for model, result in bench.get("models", {}).items():
        parts = [f"{name} at B={batch}: {value}"
                 for batch in result.get("batches", [])
                 for name, value in (("IPC graphs / plain graphs",
                                      _verdict_ratio(result, "afd_ipc_graphs", "plain_graphs", batch)),
                                     ("IPC eager / gloo eager",
                                      _verdict_ratio(result, "afd_ipc_eager", "afd_eager", batch)))
                 if value is not None]
        if parts:
            lines.append(f"- **{model}** (tok/s): " + "; ".join(parts))
    return lines


def markdown_lines(summary: Mapping[str, Any]) -> list[str]:
    """The IPC block of summary.md: verdict, throughput, floor and serving / floor."""
    phases = summary.get("phases", {})
    bench, floor = phases.get("bench", {}), phases.get("ipcfloor", {})
    blocks = [throughput_lines(bench), floor_lines(floor, bench)]
    verdict = verdict_lines(bench)
    lines = (["### AFD over CUDA IPC: verdict", ""] + verdict) if verdict else []
    for block in blocks:
        if block:
            lines += ([""] if lines else []) + block
    return lines


def render_markdown(summary: Mapping[str, Any]) -> str:
    """summary.md with the IPC block after the round-trip tables."""
    return report.render_markdown(summary, extra=markdown_lines(summary))
