"""Placement of scripts/apply_patches.py: hunks onto in-memory line lists, the series in order.

unidiff only parses, so placement (exact -> offset -> reverse "already applied" -> fuzz as a
diagnostic), byte-exact line endings, `\\ No newline at end of file`, file creation/deletion
and the in-order series simulation are ours (docs/patch-tooling.md#placement).  Everything here works on
bytes and writes no file; callers decide what to do with a `SeriesResult`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from afd_patchtool._series import FilePatch, Hunk, Patch, blob_id, split_lines

# Hunk statuses, as printed by --check and the rebase report.
CLEAN, OFFSET, FUZZ = "clean", "offset", "needs fuzz"
CONFLICT, AMBIGUOUS = "conflict", "ambiguous"
APPLIED, UPSTREAM = "already applied", "already upstream"


# --------------------------------------------------------------------------- placement

def _key(line: bytes) -> bytes:
    """Line identity for matching: content plus whether it ends a line, CRLF == LF."""
    return line[:-2] + b"\n" if line.endswith(b"\r\n") else line


def _dominant_eol(lines: list[bytes]) -> bytes:
    num_crlf = sum(1 for line in lines if line.endswith(b"\r\n"))
    return b"\r\n" if num_crlf * 2 > len(lines) else b"\n"


@dataclass
class HunkRecord:
    patch: str
    path: str
    index: int
    count: int
    expected: int  # 1-based line the hunk was made for (after earlier hunks)
    found: int | None = None
    offset: int | None = None
    fuzz: int = 0
    method: str = ""  # exact, offset, fuzz, reverse, create, delete, upstream, none
    status: str = CONFLICT
    eol_normalized: bool = False
    detail: str = ""

    @property
    def label(self) -> str:
        if self.status == OFFSET:
            return f"offset {self.offset:+d}"
        if self.status == FUZZ:
            return f"needs fuzz {self.fuzz}" + (f" (offset {self.offset:+d})" if self.offset else "")
        return self.status


def _find(keys: list[bytes], want: list[bytes], expected: int, max_offset: int | None,
          edges: tuple[bool, bool] = (False, False)) -> tuple[int | None, bool]:
    """Exact match of `want` at `expected`, else the nearest one; (pos, ambiguous).

    edges = (at_start, at_end): a hunk with less leading (trailing) context than the patch's
    widest was made at the start (end) of the file and may only match there, as in GNU patch.
    """
    expected = min(max(expected, 0), len(keys))
    if not want:  # a context-free hunk comes only from an empty file: it must still be empty
        return (0, False) if not keys else (None, False)
    size = len(want)
    if edges[0] or edges[1]:
        places = {0} if edges[0] else {len(keys) - size}
        if edges[0] and edges[1]:
            places &= {len(keys) - size}
        hits = [p for p in places if p >= 0 and keys[p:p + size] == want]
    elif keys[expected:expected + size] == want:
        return expected, False
    else:
        first = want[0]
        hits = [p for p in range(len(keys) - size + 1) if keys[p] == first and keys[p:p + size] == want]
    if max_offset is not None:
        hits = [p for p in hits if abs(p - expected) <= max_offset]
    if not hits:
        return None, False
    # NOTE: away from the expected line, a second copy of the hunk's text means we cannot
    # know which one the patch meant (the nearest may be the wrong one): ambiguous.
    return min(hits, key=lambda p: (abs(p - expected), p)), len(hits) > 1


def _splice(work: list[bytes], pos: int, hunk: Hunk, eol: bytes | None) -> None:
    out, k = [], pos
    for tag, value in hunk.lines:
        if tag == " ":
            out.append(work[k])
            k += 1
        elif tag == "-":
            k += 1
        elif eol is not None and value.endswith(b"\n"):
            out.append(_key(value)[:-1] + eol)
        else:
            out.append(value)
    work[pos:k] = out


def place_hunks(patch_name: str, fp: FilePatch, lines: list[bytes], *, fuzz: int = 0,
                max_offset: int | None = None) -> tuple[list[bytes], list[HunkRecord]]:
    """Place every hunk of one file patch on `lines`: exact -> offset -> reverse -> fuzz."""
    work, records, failed = list(lines), [], False
    delta = last_offset = 0
    # As GNU patch: a side with less context than the patch's widest is at a file edge.
    context = max((max(h.num_lead, h.num_trail) for h in fp.hunks), default=0)
    for hunk in fp.hunks:
        nominal = hunk.base + delta
        expected = nominal + last_offset
        rec = HunkRecord(patch_name, fp.path, hunk.index, hunk.count, nominal + 1)
        records.append(rec)
        keys = [_key(line) for line in work]
        old = [_key(b) for b in hunk.old]
        new = [_key(b) for b in hunk.new]
        attempts = [("exact", old, expected, 0), ("reverse", new, expected, 0),
                    ("offset", old, expected, max_offset), ("reverse", new, expected, max_offset)]
        edges = (hunk.num_lead < context, hunk.num_trail < context)
        pos = None
        for method, want, start, limit in attempts:  # noqa: B007 - read after the loop
            pos, ambiguous = _find(keys, want, start, limit, edges)
            if ambiguous:
                rec.status, rec.method = AMBIGUOUS, "none"
                rec.detail = (f"the hunk's text occurs more than once away from line {expected + 1} "
                              f"(nearest at line {pos + 1}); refusing to guess")
                break
            if pos is not None:
                break
        if rec.status == AMBIGUOUS:
            failed = True
            continue
        used, lead = hunk, 0
        if pos is None:
            for num_fuzz in range(1, fuzz + 1):
                used, lead = hunk.trimmed(num_fuzz)
                want = [_key(b) for b in used.old]
                pos, ambiguous = _find(keys, want, expected + lead, max_offset)
                if pos is not None and want and not ambiguous:
                    method, rec.fuzz, pos = "fuzz", num_fuzz, pos - lead
                    break
                pos = None
            if pos is None:
                rec.method, rec.detail = "none", _nearest_hint(keys, old, expected)
                failed = True
                continue
        if method == "exact" and pos != nominal:
            method = "offset"
        rec.found, rec.offset, rec.method = pos + 1, pos - nominal, method
        if method == "reverse":
            rec.status = APPLIED
        else:
            rec.status = FUZZ if method == "fuzz" else (OFFSET if pos != nominal else CLEAN)
            window = work[pos + lead:pos + lead + len(used.old)]
            rec.eol_normalized = window != used.old
            _splice(work, pos + lead, used, _dominant_eol(work) if rec.eol_normalized else None)
        delta += len(hunk.new) - len(hunk.old)
        last_offset = pos - nominal
    return (list(lines) if failed else work), records


def _nearest_hint(keys: list[bytes], want: list[bytes], expected: int) -> str:
    """Say where the best partial match is, for the error message."""
    if not want:
        return "no lines to match"
    best_pos, best_score = None, 0
    for pos in range(max(0, len(keys) - len(want) + 1)):
        score = sum(1 for a, b in zip(keys[pos:pos + len(want)], want) if a == b)
        if score > best_score or (score == best_score and best_pos is not None
                                  and abs(pos - expected) < abs(best_pos - expected)):
            best_pos, best_score = pos, score
    if best_pos is None:
        return "no line of the hunk found"
    differing = [i + 1 for i, (a, b) in enumerate(zip(keys[best_pos:], want)) if a != b]
    return (f"nearest candidate at line {best_pos + 1} matches {best_score}/{len(want)} lines; "
            f"differs in hunk line(s) {differing[:5]}")


# --------------------------------------------------------------------------- series simulation

@dataclass
class PatchOutcome:
    name: str
    status: str  # applied, already applied, partial, failed, fuzz
    records: list[HunkRecord]
    blobs: dict[str, tuple[str, str]] = field(default_factory=dict)  # path -> (pre, post) ids


@dataclass
class SeriesResult:
    outcomes: list[PatchOutcome]
    before: dict[str, bytes | None]
    after: dict[str, bytes | None]

    @property
    def changed(self) -> list[str]:
        return sorted(p for p in self.after if self.after[p] != self.before[p])

    @property
    def records(self) -> list[HunkRecord]:
        return [r for o in self.outcomes for r in o.records]


def _place_file(name: str, fp: FilePatch, lines: list[bytes] | None, *, fuzz: int,
                max_offset: int | None) -> tuple[list[bytes] | None, list[HunkRecord]]:
    if fp.kind == "modify":
        if lines is None:
            rec = HunkRecord(name, fp.path, 1, len(fp.hunks), 1, method="none",
                             detail="file is absent")
            return None, [rec]
        return place_hunks(name, fp, lines, fuzz=fuzz, max_offset=max_offset)
    rec = HunkRecord(name, fp.path, 1, 1, 1, method=fp.kind)
    content = [b for h in fp.hunks for b in (h.new if fp.kind == "create" else h.old)]
    if fp.kind == "create":
        if lines is None:
            rec.status, rec.found, rec.offset = CLEAN, 1, 0
            return content, [rec]
        same = [_key(b) for b in lines] == [_key(b) for b in content]
        rec.status, rec.detail = (APPLIED, "") if same else (CONFLICT, "file exists")
        return lines, [rec]
    if lines is None:
        rec.status = APPLIED
        return None, [rec]
    if [_key(b) for b in lines] == [_key(b) for b in content]:
        rec.status, rec.found, rec.offset = CLEAN, 1, 0
        return None, [rec]
    rec.detail = "file content differs from the deleted text"
    return lines, [rec]


def patch_status(records: list[HunkRecord]) -> str:
    statuses = {r.status for r in records}
    if statuses & {CONFLICT, AMBIGUOUS, UPSTREAM}:
        return "failed"
    if statuses == {APPLIED}:
        return "already applied"
    if APPLIED in statuses:
        return "partial"
    return "fuzz" if FUZZ in statuses else "applied"


def apply_series(patches: list[Patch], read: Callable[[str], bytes | None], *,
                 reverse: bool = False, fuzz: int = 0,
                 max_offset: int | None = None) -> SeriesResult:
    """Simulate the series in order on files from `read(path)`; a failed patch changes nothing.

    With reverse=True the patches are un-applied last to first.
    """
    state: dict[str, list[bytes] | None] = {}
    before: dict[str, bytes | None] = {}
    outcomes = []
    ordered = [p.reversed() for p in reversed(patches)] if reverse else patches
    for patch in ordered:
        staged: dict[str, list[bytes] | None] = {}
        records: list[HunkRecord] = []
        for fp in patch.files:
            if fp.path not in state:
                before[fp.path] = read(fp.path)
                state[fp.path] = None if before[fp.path] is None else split_lines(before[fp.path])
            current = staged[fp.path] if fp.path in staged else state[fp.path]
            new_lines, file_records = _place_file(patch.name, fp, current, fuzz=fuzz,
                                                  max_offset=max_offset)
            staged[fp.path] = new_lines
            records.extend(file_records)
        status = patch_status(records)
        outcome = PatchOutcome(patch.name, status, records)
        if status in ("applied", "fuzz"):
            for path, lines in staged.items():
                pre, post = state[path], lines
                outcome.blobs[path] = (blob_id(None if pre is None else b"".join(pre)),
                                       blob_id(None if post is None else b"".join(post)))
            state.update(staged)
        outcomes.append(outcome)
    if reverse:
        outcomes.reverse()
    after = {p: (None if lines is None else b"".join(lines)) for p, lines in state.items()}
    return SeriesResult(outcomes, before, after)
