#!/usr/bin/env python3
"""Where AFD's step time goes: a breakdown table and a timeline picture from the ranks' timeline files.

    python scripts/timeline_report.py DIR [--png timeline.png] [--markdown out.md]

DIR holds the ``<role>-<rank>.jsonl`` files the ranks of one deployment appended (AFD config
``timeline_dir``, docs/timeline.md). Steps are joined across roles by step number; warm-up, profile and
capture steps are left out. Per kind of step (graph replay or eager) and row count, medians per crossing
layer (ms):

  attention compute   FFN output of layer l received -> layer l+1 sent (the attention's own work)
  round trip          attention: send start -> FFN output received
  FFN compute         FFN: all rows received -> first byte sent back
  transport           round trip - FFN compute (both directions, plus any wait for the other role)
  FFN idle            FFN: receive started -> rows arrived (it waits for the attention)
  step                host time from one step's start to the next's, per layer: everything above plus
                      the host's share (scheduling, sampling, launches), 'other' = step - the rest

Marks of the two roles share one clock only on one host (host clock) or one GPU (device clock); the
picture draws both roles on the attention's axis when they do, else each from its own first mark.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from vllm_afd.wire.timeline import StepRecord, read_records

COLUMNS = ("attention compute", "round trip", "FFN compute", "transport", "FFN idle", "step", "other")


def load(directory: Path) -> dict[str, list[StepRecord]]:
    """Records per file stem (``attention-0``, ``ffn-0``, ...), measured steps only."""
    ranks: dict[str, list[StepRecord]] = {}
    files = sorted(directory.glob("*.jsonl"))
    if not files:
        raise SystemExit(f"timeline_report: no *.jsonl in {directory}; pass the timeline_dir the ranks wrote to")
    for path in files:
        try:
            records = read_records(path)
        except ValueError as exc:
            raise SystemExit(f"timeline_report: {exc}") from exc
        ranks[path.stem] = [r for r in records if not (r.warmup or r.profile) and r.marks]
    return ranks


def _median_ms(values: list[int]) -> float | None:
    return statistics.median(values) / 1e6 if values else None


def breakdown(ranks: dict[str, list[StepRecord]]) -> list[dict[str, Any]]:
    """One row per (kind of step, rows of attention rank 0): medians per crossing layer in ms."""
    attention = ranks.get("attention-0", [])
    ffn_by_seq = {r.step_seq: r for r in ranks.get("ffn-0", [])}
    groups: dict[tuple[bool, int], list[StepRecord]] = defaultdict(list)
    for record in attention:
        groups[(record.graph_replay, record.rows)].append(record)
    rows = []
    for (replay, num_rows), records in sorted(groups.items()):
        ffn = [ffn_by_seq[r.step_seq] for r in records if r.step_seq in ffn_by_seq]
        layers = len({m.exchange for m in records[0].marks}) or 1  # crossing layers, whatever the stages
        periods = _step_periods(attention, {r.step_seq for r in records})
        row = {
            "kind": "graph replay" if replay else "eager", "rows": num_rows, "steps": len(records),
            "layers": layers,
            "attention compute": _median_ms([s for r in records for s in r.attention_compute_ns()]),
            "round trip": _median_ms([s for r in records for s in r.round_trips_ns()]),
            "FFN compute": _median_ms([s for r in ffn for s in r.ffn_compute_ns()]),
            "FFN idle": _median_ms([s for r in ffn for s in r.spans_ns("a2f_recv_start", "a2f_recv_end")]),
            "step": _median_ms([p // layers for p in periods]),
            "host syncs": statistics.median_low([r.host_syncs for r in records]),
            "FFN host syncs": statistics.median_low([r.host_syncs for r in ffn]) if ffn else None,
        }
        if row["round trip"] is not None and row["FFN compute"] is not None:
            row["transport"] = row["round trip"] - row["FFN compute"]
        if None not in (row["step"], row["round trip"], row["attention compute"]):
            row["other"] = row["step"] - row["round trip"] - row["attention compute"]
        rows.append(row)
    return rows


def _step_periods(records: list[StepRecord], selected: set[int]) -> list[int]:
    """Host ns from a selected step's start to the next step's start (consecutive step numbers only)."""
    by_seq = {r.step_seq: r for r in records}
    return [by_seq[s + 1].opened_ns - by_seq[s].opened_ns for s in sorted(selected) if s + 1 in by_seq]


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ["kind", "rows", "steps", "layers", *COLUMNS, "host syncs", "FFN host syncs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row.get(name) for name in head]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    lines.append("")
    lines.append("Medians per crossing layer in ms (docs/timeline.md#report); transport = round trip - FFN compute.")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def draw(ranks: dict[str, list[StepRecord]], path: Path, *, replay: bool | None = None) -> int | None:
    """One measured step of attention rank 0 and FFN rank 0 as lanes; returns the step drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attention = [r for r in ranks.get("attention-0", []) if replay is None or r.graph_replay == replay]
    ffn_by_seq = {r.step_seq: r for r in ranks.get("ffn-0", [])}
    candidates = [r for r in attention if r.step_seq in ffn_by_seq]
    if not candidates:
        return None
    record = candidates[len(candidates) // 2]
    ffn = ffn_by_seq[record.step_seq]
    shared = record.clock == ffn.clock
    origin = record.marks[0].t_ns
    lanes = [("attention", record, [("a2f_send_start", "f2a_recv_end", "tab:gray", "round trip")],
              origin),
             ("FFN", ffn, [("a2f_recv_start", "a2f_recv_end", "lightgray", "waits for rows"),
                           ("a2f_recv_end", "f2a_send_start", "tab:orange", "FFN compute"),
                           ("f2a_send_start", "f2a_send_end", "tab:green", "send back")],
              origin if shared else ffn.marks[0].t_ns)]
    fig, ax = plt.subplots(figsize=(12, 2.8))
    labelled: set[str] = set()
    for y, (_name, rec, spans, zero) in enumerate(lanes):
        for start, end, color, label in spans:
            starts = {(m.exchange, m.stage): m.t_ns for m in rec.marks if m.kind == start}
            for m in rec.marks:
                if m.kind == end and (m.exchange, m.stage) in starts:
                    t0 = (starts[(m.exchange, m.stage)] - zero) / 1e3
                    ax.broken_barh([(t0, (m.t_ns - starts[(m.exchange, m.stage)]) / 1e3)], (y - 0.35, 0.7),
                                   color=color, label=None if label in labelled else label)
                    labelled.add(label)
    ends = [m for m in record.marks if m.kind == "f2a_recv_end"]
    starts = [m for m in record.marks if m.kind == "a2f_send_start"]
    for a, b in zip(ends, starts[1:]):
        ax.broken_barh([((a.t_ns - origin) / 1e3, (b.t_ns - a.t_ns) / 1e3)], (-0.35, 0.7), color="tab:blue",
                       label=None if "attention compute" in labelled else "attention compute")
        labelled.add("attention compute")
    ax.set_yticks([0, 1], ["attention 0", "FFN 0"])
    ax.set_xlabel("µs from the step's first mark" + ("" if shared else " (each role on its own clock)"))
    kind = "graph replay" if record.graph_replay else "eager"
    ax.set_title(f"AFD step {record.step_seq} ({kind}, {record.rows} rows, {record.clock} clock)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=5, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return record.step_seq


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--png", type=Path, help="draw one measured step of attention 0 and FFN 0")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    ranks = load(args.directory)
    text = markdown(breakdown(ranks))
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.png:
        try:
            step = draw(ranks, args.png, replay=True)
            if step is None:
                step = draw(ranks, args.png)
        except ImportError as exc:  # the GPU machine may lack matplotlib: draw from the copied files later
            print(f"no timeline picture ({exc}); run this script where matplotlib is installed")
            return 0
        print(f"timeline picture: {args.png} (step {step})" if step is not None else "no joined step to draw")
    return 0


if __name__ == "__main__":
    sys.exit(main())
