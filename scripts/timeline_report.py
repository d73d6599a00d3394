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

With several FFN ranks (an FFN pool: FFN DP > 1, or TP) a second table has one row per FFN rank: its steps,
rows, FFN compute and idle, and how long after the first FFN rank its rows arrived (a late rank holds the
others in the EP collectives, which FFN compute then includes). The picture draws one lane per rank, the
attention ranks above the FFN ranks, for one step that every file holds.

Marks of two ranks share one clock only on one host (host clock) or one GPU (device clock); the picture
draws every lane on attention rank 0's axis when all lanes name its clock, else each from its own first
mark, and the arrival column needs one clock for all FFN ranks.
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


def rank_key(stem: str) -> tuple[int, int, str]:
    """Sort order of file stems: attention ranks, then FFN ranks, each by rank number; anything else last."""
    role, _, number = stem.rpartition("-")
    order = {"attention": 0, "ffn": 1}.get(role, 2)
    return (order, int(number), stem) if number.isdigit() and order < 2 else (2, 0, stem)


def role_stems(ranks: dict[str, list[StepRecord]], role: str) -> list[str]:
    """The file stems of one role (``ffn-0``, ``ffn-1``, ...), by rank number."""
    return sorted((s for s in ranks if s.rpartition("-")[0] == role and s.rpartition("-")[2].isdigit()),
                  key=rank_key)


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


def ffn_ranks(ranks: dict[str, list[StepRecord]]) -> list[dict[str, Any]]:
    """One row per FFN rank: steps (joined: also on attention rank 0), rows, compute and idle medians (ms), and
    the median of how long after the first FFN rank its rows arrived, per exchange (one clock only)."""
    stems = role_stems(ranks, "ffn")
    attention_seqs = {r.step_seq for r in ranks.get("attention-0", [])}
    by_rank = {stem: {r.step_seq: r for r in ranks[stem]} for stem in stems}
    common = set.intersection(*(set(records) for records in by_rank.values())) if stems else set()
    clocks = {by_rank[stem][seq].clock for stem in stems for seq in common}
    lags: dict[str, list[int]] = {stem: [] for stem in stems}
    if len(clocks) == 1 and clocks != {"device"}:  # device clocks of two GPUs do not compare
        for seq in common:
            arrived = {stem: _marks(by_rank[stem][seq], "a2f_recv_end") for stem in stems}
            for key in set.intersection(*(set(a) for a in arrived.values())):
                first = min(a[key] for a in arrived.values())
                for stem in stems:
                    lags[stem].append(arrived[stem][key] - first)
    rows = []
    for stem in stems:
        records = ranks[stem]
        rows.append({
            "FFN rank": stem.rpartition("-")[2], "steps": len(records),
            "joined": len({r.step_seq for r in records} & attention_seqs),
            "rows": statistics.median_low([r.rows for r in records]) if records else None,
            "FFN compute": _median_ms([s for r in records for s in r.ffn_compute_ns()]),
            "FFN idle": _median_ms([s for r in records for s in r.spans_ns("a2f_recv_start", "a2f_recv_end")]),
            "rows arrive after first": _median_ms(lags[stem]),
        })
    return rows


def _marks(record: StepRecord, kind: str) -> dict[tuple[int, int], int]:
    return {(m.exchange, m.stage): m.t_ns for m in record.marks if m.kind == kind}


def _step_periods(records: list[StepRecord], selected: set[int]) -> list[int]:
    """Host ns from a selected step's start to the next step's start (consecutive step numbers only)."""
    by_seq = {r.step_seq: r for r in records}
    return [by_seq[s + 1].opened_ns - by_seq[s].opened_ns for s in sorted(selected) if s + 1 in by_seq]


def markdown(rows: list[dict[str, Any]], pool: list[dict[str, Any]] | None = None) -> str:
    lines = _table(["kind", "rows", "steps", "layers", *COLUMNS, "host syncs", "FFN host syncs"], rows)
    lines.append("")
    lines.append("Medians per crossing layer in ms (docs/timeline.md#report); transport = round trip - FFN compute.")
    if pool and len(pool) > 1:
        lines += ["", *_table(list(pool[0]), pool), "",
                  "Per FFN rank, medians per crossing layer in ms; joined = steps attention rank 0 also holds."]
    return "\n".join(lines)


def _table(head: list[str], rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(name)) for name in head) + " |")
    return lines


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


# Spans each role's lane draws: (start mark, end mark, colour, legend label).
LANE_SPANS = {
    "attention": [("a2f_send_start", "f2a_recv_end", "tab:gray", "round trip")],
    "ffn": [("a2f_recv_start", "a2f_recv_end", "lightgray", "waits for rows"),
            ("a2f_recv_end", "f2a_send_start", "tab:orange", "FFN compute"),
            ("f2a_send_start", "f2a_send_end", "tab:green", "send back")],
}


def pick_step(ranks: dict[str, list[StepRecord]], replay: bool | None = None) -> dict[str, StepRecord]:
    """One measured step of attention rank 0 that every rank's file holds: its record per file stem, or {}."""
    stems = role_stems(ranks, "attention") + role_stems(ranks, "ffn")
    if "attention-0" not in stems or not role_stems(ranks, "ffn"):
        return {}
    by_rank = {stem: {r.step_seq: r for r in ranks[stem]} for stem in stems}
    candidates = [r for r in ranks["attention-0"] if (replay is None or r.graph_replay == replay)
                  and all(r.step_seq in records for records in by_rank.values())]
    if not candidates:
        return {}
    seq = candidates[len(candidates) // 2].step_seq
    return {stem: by_rank[stem][seq] for stem in stems}


def draw(ranks: dict[str, list[StepRecord]], path: Path, *, replay: bool | None = None) -> int | None:
    """One measured step, one lane per rank (attention ranks, then FFN ranks); returns the step drawn."""
    step = pick_step(ranks, replay)
    if not step:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record = step["attention-0"]
    shared = len({r.clock for r in step.values()}) == 1
    origin = record.marks[0].t_ns
    lanes = list(step.items())
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.8 * len(lanes)))
    labelled: set[str] = set()

    def bar(y: int, t0_ns: int, length_ns: int, color: str, label: str) -> None:
        ax.broken_barh([(t0_ns / 1e3, length_ns / 1e3)], (y - 0.35, 0.7), color=color,
                       label=None if label in labelled else label)
        labelled.add(label)

    for y, (_stem, rec) in enumerate(lanes):
        zero = origin if shared else rec.marks[0].t_ns
        for start, end, color, label in LANE_SPANS[rec.role]:
            starts = _marks(rec, start)
            for m in rec.marks:
                if m.kind == end and (m.exchange, m.stage) in starts:
                    bar(y, starts[(m.exchange, m.stage)] - zero, m.t_ns - starts[(m.exchange, m.stage)], color, label)
        if rec.role == "attention":
            ends = _marks(rec, "f2a_recv_end")
            for m in rec.marks:  # the attention's own layer, per stage (StepRecord.attention_compute_ns)
                if m.kind == "a2f_send_start" and (m.exchange - 1, m.stage) in ends:
                    t0 = ends[(m.exchange - 1, m.stage)]
                    bar(y, t0 - zero, m.t_ns - t0, "tab:blue", "attention compute")
    ax.set_yticks(range(len(lanes)), [stem.replace("-", " ").replace("ffn", "FFN") for stem, _ in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("µs from the step's first mark" + ("" if shared else " (each rank on its own clock)"))
    kind = "graph replay" if record.graph_replay else "eager"
    ax.set_title(f"AFD step {record.step_seq} ({kind}, {record.rows} rows on attention 0, {record.clock} clock)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.5 / len(lanes) ** 0.5), ncol=5, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return record.step_seq


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--png", type=Path, help="draw one measured step, one lane per rank")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    ranks = load(args.directory)
    text = markdown(breakdown(ranks), ffn_ranks(ranks))
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
