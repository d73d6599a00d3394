"""Patch-series engine of scripts/apply_patches.py: parse, place, apply in memory, write diffs.

unidiff only parses, so placement (exact -> offset -> reverse "already applied" -> fuzz as a
diagnostic), byte-exact line endings, `\\ No newline at end of file`, file creation/deletion
and the in-order series simulation are ours (PATCH_TOOLING.md §3).  Everything here works on
bytes and writes no file; callers decide what to do with a `SeriesResult`.

The diff writer (`make_patch`) is what tests use to generate patches and what patch authors
use to regenerate one:

    python scripts/apply_patches.py --make-patch --header HDR.txt \\
        --orig PRISTINE_DIR --new EDITED_DIR --out patches/NAME.patch vllm/a.py vllm/b.py

HDR.txt holds the `Field: value` header (PATCH_TOOLING.md §2); the output is the header, a
`---` line and a git-style diff (blob ids computed here, 3 lines of context, files sorted).
"""
from __future__ import annotations

import difflib
import hashlib
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable

import unidiff

FORMAT_VERSION = "1"
PATCH_NAME_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*\.patch$")
HEADER_FIELD_RE = re.compile(rb"^([A-Z][A-Za-z-]*):[ \t]?(.*?)\s*$")
INDEX_RE = re.compile(r"^index ([0-9a-f]+)\.\.([0-9a-f]+)(?: (\d+))?\s*$")
MARKER_RE = re.compile(rb"^([ \t]*)# ### PATCH (START|END): (\S+)[ \t]*\r?\n?$")
ZERO_BLOB = "0" * 40
CONTEXT = 3  # context lines per hunk side that the diff writer emits and the lint expects

# Hunk statuses, as printed by --check and the rebase report.
CLEAN, OFFSET, FUZZ = "clean", "offset", "needs fuzz"
CONFLICT, AMBIGUOUS = "conflict", "ambiguous"
APPLIED, UPSTREAM = "already applied", "already upstream"


class ConfigError(Exception):
    """Bad series, patch file or VLLM_PIN (exit 2)."""


class PatchApplyError(Exception):
    """The series cannot be applied or written (exit 1, or 6 for a tree in an unknown state)."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


# --------------------------------------------------------------------------- pin and series

def read_pin(path: Path) -> dict[str, str]:
    """Parse VLLM_PIN (`key = value`, `#` comments) into a dict."""
    pin: dict[str, str] = {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the pin file ({exc.strerror}); expected "
                          f"`key = value` lines. Pass --pin FILE.") from exc
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ConfigError(f"{path}:{lineno}: not a `key = value` line ({raw!r}); "
                              "expected e.g. `version = 0.30.0`. Fix the line.")
        pin[key.strip()] = value.strip()
    for key in ("commit", "version"):
        if key not in pin:
            raise ConfigError(f"{path}: key `{key}` missing (have {sorted(pin)}); "
                              f"expected `commit` and `version`. Add it.")
    return pin


def parse_series(path: Path) -> list[tuple[str, int]]:
    """Return (patch name, line number) for every entry of a quilt `series` file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the series ({exc.strerror}); expected one "
                          "patch name per line. Create it or pass --patches DIR.") from exc
    entries = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if len(words) > 1:
            raise ConfigError(f"{path}:{lineno}: options after a patch name are not supported "
                              f"({raw.strip()!r}); expected a bare name. Remove them.")
        if words:
            entries.append((words[0], lineno))
    return entries


# --------------------------------------------------------------------------- patch model

@dataclass(frozen=True)
class Hunk:
    """One hunk; `lines` are (tag, bytes) with tag in ' -+' and the EOL the file must have."""

    index: int
    count: int
    source_start: int
    source_length: int
    target_start: int
    target_length: int
    lines: tuple[tuple[str, bytes], ...]

    @property
    def old(self) -> list[bytes]:
        return [b for t, b in self.lines if t != "+"]

    @property
    def new(self) -> list[bytes]:
        return [b for t, b in self.lines if t != "-"]

    @property
    def base(self) -> int:
        """0-based index where the hunk's old lines start (insert position when empty)."""
        return self.source_start - 1 if self.source_length else self.source_start

    def reversed(self) -> "Hunk":
        swap = {" ": " ", "-": "+", "+": "-"}
        return replace(self, source_start=self.target_start, source_length=self.target_length,
                       target_start=self.source_start, target_length=self.source_length,
                       lines=tuple((swap[t], b) for t, b in self.lines))

    @property
    def num_lead(self) -> int:
        """Leading context lines."""
        return next((i for i, (t, _) in enumerate(self.lines) if t != " "), len(self.lines))

    @property
    def num_trail(self) -> int:
        """Trailing context lines."""
        return next((i for i, (t, _) in enumerate(reversed(self.lines)) if t != " "), len(self.lines))

    def trimmed(self, num_lines: int) -> tuple["Hunk", int]:
        """Drop up to `num_lines` leading and trailing context lines (fuzz); return (hunk, lead)."""
        lead, trail = min(num_lines, self.num_lead), min(num_lines, self.num_trail)
        return replace(self, lines=self.lines[lead:len(self.lines) - trail]), lead


@dataclass(frozen=True)
class FilePatch:
    path: str
    kind: str  # "modify", "create" or "delete"
    hunks: tuple[Hunk, ...]
    old_blob: str = ""
    new_blob: str = ""

    def reversed(self) -> "FilePatch":
        kind = {"create": "delete", "delete": "create"}.get(self.kind, self.kind)
        return replace(self, kind=kind, hunks=tuple(h.reversed() for h in self.hunks),
                       old_blob=self.new_blob, new_blob=self.old_blob)


@dataclass
class Patch:
    name: str
    data: bytes
    header: dict[str, list[str]]
    header_errors: list[str]
    files: list[FilePatch]
    unsupported: list[str] = field(default_factory=list)  # binary/rename/mode entries
    lineno: int = 0  # line in `series`

    @property
    def stem(self) -> str:
        return self.name[:-len(".patch")] if self.name.endswith(".patch") else self.name

    def first(self, key: str, default: str = "") -> str:
        return (self.header.get(key) or [default])[0]

    def reversed(self) -> "Patch":
        return replace(self, files=[f.reversed() for f in self.files])


def split_patch(data: bytes) -> tuple[list[bytes], bytes, int]:
    """Split a patch file into header lines, diff bytes and the diff's first line number."""
    lines = data.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.rstrip(b"\r\n") == b"---":
            return lines[:i], b"".join(lines[i + 1:]), i + 2
    return [], data, 1


def parse_header(lines: list[bytes]) -> tuple[dict[str, list[str]], list[str]]:
    """Parse `Field: value` lines (indented lines continue a value); return fields and problems."""
    fields: dict[str, list[str]] = {}
    errors: list[str] = []
    last = None
    for lineno, raw in enumerate(lines, 1):
        text = raw.rstrip(b"\r\n")
        if not text.strip():
            last = None
            continue
        if text[:1] in (b" ", b"\t") and last is not None:
            fields[last][-1] = (fields[last][-1] + " " + text.strip().decode("utf-8", "replace"))
            continue
        match = HEADER_FIELD_RE.match(text)
        if not match:
            errors.append(f"header line {lineno} is not `Field: value` ({text[:60]!r})")
            last = None
            continue
        last = match.group(1).decode()
        fields.setdefault(last, []).append(match.group(2).decode("utf-8", "replace"))
    return fields, errors


def _convert_hunk(hunk: unidiff.Hunk, index: int, count: int) -> Hunk:
    lines: list[tuple[str, bytes]] = []
    for line in hunk:
        if line.line_type == "\\":
            if lines:
                tag, value = lines[-1]
                lines[-1] = (tag, value[:-1] if value.endswith(b"\n") else value)
            continue
        if line.line_type not in (" ", "-", "+"):
            continue  # blank separator lines unidiff appends after a hunk
        lines.append((line.line_type, line.value.encode("utf-8", "surrogateescape")))
    return Hunk(index, count, hunk.source_start, hunk.source_length,
                hunk.target_start, hunk.target_length, tuple(lines))


def parse_patch(name: str, data: bytes) -> Patch:
    """Parse one patch file (bytes, so CRLF content survives); raise ConfigError if unreadable."""
    head, diff, _ = split_patch(data)
    header, header_errors = parse_header(head)
    try:
        patch_set = unidiff.PatchSet.from_string(diff, encoding="utf-8", errors="surrogateescape")
    except unidiff.UnidiffParseError as exc:
        raise ConfigError(f"patches/{name}: the diff does not parse ({exc}); expected a git-style "
                          "unified diff after the `---` line. Regenerate it with --make-patch.") from exc
    files, unsupported = [], []
    for pf in patch_set:
        path = pf.path
        if pf.is_binary_file or pf.is_rename or pf.is_symlink or pf.is_submodule:
            unsupported.append(f"{path}: binary, rename, symlink or submodule entry")
            continue
        if pf.source_mode and pf.target_mode and pf.source_mode != pf.target_mode:
            unsupported.append(f"{path}: mode change {pf.source_mode} -> {pf.target_mode}")
        old_blob = new_blob = ""
        for info in pf.patch_info or []:
            match = INDEX_RE.match(info.rstrip("\r\n"))
            if match:
                old_blob, new_blob = match.group(1), match.group(2)
        kind = ("create" if pf.source_file == "/dev/null" else
                "delete" if pf.target_file == "/dev/null" else "modify")
        hunks = tuple(_convert_hunk(h, i, len(pf)) for i, h in enumerate(pf, 1))
        files.append(FilePatch(path, kind, hunks, old_blob, new_blob))
    if not files and not unsupported:
        raise ConfigError(f"patches/{name}: no file diff found; expected `diff --git a/P b/P` "
                          "after the `---` line. Regenerate it with --make-patch.")
    return Patch(name, data, header, header_errors, files, unsupported)


def load_series(patches_dir: Path) -> list[Patch]:
    """Parse `series` and every patch it lists, before any file is touched."""
    patches_dir = Path(patches_dir)
    entries = parse_series(patches_dir / "series")
    seen: dict[str, int] = {}
    patches = []
    for name, lineno in entries:
        if name in seen:
            raise ConfigError(f"{patches_dir}/series:{lineno}: {name} is listed twice (first on "
                              f"line {seen[name]}); expected each patch once. Remove one entry.")
        seen[name] = lineno
        try:
            data = (patches_dir / name).read_bytes()
        except OSError as exc:
            raise ConfigError(f"{patches_dir}/series:{lineno}: {name} cannot be read "
                              f"({exc.strerror}); expected a file in {patches_dir}. "
                              "Add it or remove the entry.") from exc
        patches.append(replace(parse_patch(name, data), lineno=lineno))
    return patches


def series_sha256(patches: Iterable[Patch]) -> str:
    """Digest over the ordered patch names and bytes (series comments do not count)."""
    digest = hashlib.sha256()
    for patch in patches:
        digest.update(b"%s\n%d\n" % (patch.name.encode(), len(patch.data)))
        digest.update(patch.data)
    return digest.hexdigest()


def local_label(commit: str, patches: list[Patch]) -> str:
    """`afd.g<10 hex>` of sha256(commit || series || format version); never contains `cpu`."""
    digest = hashlib.sha256(b"\n".join(
        [commit.encode(), series_sha256(patches).encode(), FORMAT_VERSION.encode()]))
    return "afd.g" + digest.hexdigest()[:10]


def blob_id(data: bytes | None) -> str:
    """Git blob id of `data` (40 zeros for an absent file)."""
    if data is None:
        return ZERO_BLOB
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def required_files(patches: Iterable[Patch]) -> list[str]:
    return sorted({f.path for p in patches for f in p.files})


# --------------------------------------------------------------------------- placement

def split_lines(data: bytes) -> list[bytes]:
    """Split on LF only, keeping each line's EOL (a lone CR is content, as in diff)."""
    parts = data.split(b"\n")
    lines = [p + b"\n" for p in parts[:-1]]
    return lines + [parts[-1]] if parts[-1] else lines


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
        for method, want, start, limit in attempts:
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


# --------------------------------------------------------------------------- diff writer

_DEF_RE = re.compile(rb"^([ \t]*)(async[ \t]+def|def|class)[ \t]+\w")


def _section(lines: list[bytes], start: int) -> bytes:
    """Nearest preceding less-indented def/class line, like git's funcname (ours, stable)."""
    ref = None
    for line in lines[start:]:
        if line.strip():
            ref = len(line) - len(line.lstrip(b" \t"))
            break
    for line in reversed(lines[:start]):
        match = _DEF_RE.match(line)
        if match and (ref is None or ref == 0 or len(match.group(1)) < ref):
            return line.rstrip()[:80]
    return b""


def _range(start: int, stop: int) -> str:
    length = stop - start
    if length == 1:
        return str(start + 1)
    return f"{start + 1 if length else start},{length}"


def _emit(tag: bytes, line: bytes) -> bytes:
    if line.endswith(b"\n"):
        return tag + line
    return tag + line + b"\n\\ No newline at end of file\n"


def diff_file(path: str, old: bytes | None, new: bytes | None, context: int = 3) -> bytes:
    """Git-style diff of one file (`old`/`new` None = absent); b'' when identical."""
    if old == new:
        return b""
    a = split_lines(old or b"")
    b = split_lines(new or b"")
    p = path.encode()
    out = [b"diff --git a/%s b/%s\n" % (p, p)]
    if old is None:
        out.append(b"new file mode 100644\nindex %s..%s\n" % (ZERO_BLOB.encode(), blob_id(new).encode()))
    elif new is None:
        out.append(b"deleted file mode 100644\nindex %s..%s\n" % (blob_id(old).encode(), ZERO_BLOB.encode()))
    else:
        out.append(b"index %s..%s 100644\n" % (blob_id(old).encode(), blob_id(new).encode()))
    if not a and not b:
        return b"".join(out)
    out.append(b"--- %s\n" % (b"/dev/null" if old is None else b"a/" + p))
    out.append(b"+++ %s\n" % (b"/dev/null" if new is None else b"b/" + p))
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    for group in matcher.get_grouped_opcodes(context):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        section = _section(a, i1)
        out.append(b"@@ -%s +%s @@%s\n" % (_range(i1, i2).encode(), _range(j1, j2).encode(),
                                           b" " + section if section else b""))
        for tag, x1, x2, y1, y2 in group:
            if tag == "equal":
                out.extend(_emit(b" ", line) for line in a[x1:x2])
                continue
            out.extend(_emit(b"-", line) for line in a[x1:x2])
            out.extend(_emit(b"+", line) for line in b[y1:y2])
    return b"".join(out)


def make_patch(header: bytes, files: Iterable[tuple[str, bytes | None, bytes | None]]) -> bytes:
    """Header + `---` + the sorted per-file diffs; the bytes a patch file holds."""
    head = header.rstrip(b"\n")
    if head.endswith(b"\n---") or head == b"---":
        head = head[:-3].rstrip(b"\n")
    body = b"".join(diff_file(path, old, new) for path, old, new in sorted(files, key=lambda f: f[0]))
    return (head + b"\n" if head else b"") + b"---\n" + body
