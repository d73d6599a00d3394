"""Reporting of scripts/apply_patches.py: progress and error lines, exit-code severity.

Human lines go to stdout and errors to stderr (`Out`); one simulated series becomes the
`Applying NAME (k/n): status` lines, the per-hunk lines and the "does not apply" errors, and
its exit code (docs/patch-tooling.md#modes-and-exit-codes).  When several checks fail, `worst`
keeps the most severe code (70 > 5 > 6 > 1 > 7 > 4 > 3 > 0).
"""
from __future__ import annotations

import sys

from afd_patchtool import _placement
from afd_patchtool import _series

SEVERITY = (70, 5, 6, 1, 7, 4, 3, 0)
STATUS_EXIT = {"failed": 1, "partial": 6, "fuzz": 3}
STATUS_WORDS = {("Checking", "applied"): "applies", ("Reverting", "applied"): "reverted",
                ("Reverting", "already applied"): "not applied"}


def worst(*codes: int) -> int:
    return min(codes, key=SEVERITY.index) if codes else 0


class Out:
    """Human lines on stdout, errors on stderr; -q hides progress, -v shows hunks."""

    def __init__(self, verbose: int, quiet: bool):
        self.verbose, self.quiet = verbose, quiet

    def info(self, msg: str) -> None:
        if not self.quiet:
            print(msg, flush=True)

    def detail(self, msg: str) -> None:
        if self.verbose and not self.quiet:
            print(msg, flush=True)

    def error(self, msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)


def hunk_summary(records: list[_placement.HunkRecord]) -> str:
    order = (_placement.CLEAN, _placement.OFFSET, _placement.FUZZ, _placement.APPLIED,
             _placement.UPSTREAM, _placement.AMBIGUOUS, _placement.CONFLICT)
    counts = {s: sum(1 for r in records if r.status == s) for s in order}
    parts = ", ".join(f"{n} {'exact' if s == _placement.CLEAN else s}" for s, n in counts.items() if n)
    return f"{len(records)} hunks ({parts})"


def report_result(result: _placement.SeriesResult, patches: list[_series.Patch], out: Out, *, verb: str,
                  hunks: bool, target: str) -> int:
    """Print progress and error lines for one simulated series; return its exit code."""
    code, by_name = 0, {p.name: p for p in patches}
    for k, outcome in enumerate(result.outcomes, 1):
        shown = STATUS_WORDS.get((verb, outcome.status), outcome.status)
        out.info(f"{verb} {outcome.name} ({k}/{len(result.outcomes)}): {shown}")
        for rec in outcome.records:
            line = f"  {rec.path} hunk {rec.index}/{rec.count}: {rec.label}"
            line += f" at line {rec.found}" if rec.found else ""
            line += " (eol-normalized)" if rec.eol_normalized else ""
            (out.info if hunks or outcome.status not in ("applied", "already applied") else out.detail)(line)
        code = worst(code, STATUS_EXIT.get(outcome.status, 0))
        for rec in outcome.records:
            if rec.status in (_placement.CONFLICT, _placement.AMBIGUOUS):
                patch = by_name[outcome.name]
                out.error(f"patches/series:{patch.lineno}: {outcome.name}: hunk {rec.index}/{rec.count} "
                          f"does not apply to {rec.path} ({rec.status}: {rec.detail}); expected the "
                          f"text recorded for {target}. Nothing was written. Run --rebase-report for "
                          "the per-hunk report, then refresh the patch (--make-patch).")
    return code
