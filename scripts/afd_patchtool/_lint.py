"""`apply_patches.py --lint`: static rules for patches/ (docs/patch-tooling.md#lint-rules, exit 4).

Violations fail the lint; warnings (recommended header fields, context width) are printed
but do not change the exit code.  Blank added lines directly after an END or before a START
marker count as spacing, not as unfenced code.  Nothing here reads vLLM: the rules are about the patch
files themselves, so the lint runs in CI's first tier without any wheel.
"""
from __future__ import annotations

import re
from pathlib import Path

from afd_patchtool import _diff
from afd_patchtool import _series

REQUIRED = ("Subject", "Why", "Upstream", "Remove-When")
RECOMMENDED = ("Category", "How", "Anchor", "Used-By", "Upstream-Pin", "Last-Update")
CATEGORIES = ("seam", "backport", "pin-fix")
ANCHOR_RE = re.compile(r"^vllm/[\w/.-]+\.py(::[\w.]+)?$")


def lint_series(patches_dir: Path, pin: dict[str, str]) -> tuple[list[str], list[str]]:
    """Return (violations, warnings) as `where: what` strings."""
    errors: list[str] = []
    warnings: list[str] = []
    series = patches_dir / "series"
    try:
        entries = _series.parse_series(series)
    except _series.ConfigError as exc:
        return [str(exc)], []
    listed: dict[str, int] = {}
    for name, lineno in entries:
        where = f"{series}:{lineno}: {name}"
        if name in listed:
            errors.append(f"{where}: listed twice (first on line {listed[name]}); expected once")
            continue
        listed[name] = lineno
        if not _series.PATCH_NAME_RE.match(name):
            errors.append(f"{where}: name does not match {_series.PATCH_NAME_RE.pattern}; "
                          "expected <area>-<verb>-<object>.patch")
        if not (patches_dir / name).is_file():
            errors.append(f"{where}: file missing; expected {patches_dir / name}")
    for path in sorted(patches_dir.glob("*.patch")):
        if path.name not in listed:
            errors.append(f"{path}: not listed in series; expected every patch listed once")
    for name in listed:
        if (patches_dir / name).is_file():
            lint_patch(name, (patches_dir / name).read_bytes(), pin, errors, warnings)
    return errors, warnings


def lint_patch(name: str, data: bytes, pin: dict[str, str], errors: list[str],
               warnings: list[str]) -> None:
    where = f"patches/{name}"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        errors.append(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})")
    if not data.endswith(b"\n"):
        errors.append(f"{where}: no final newline; expected the file to end with \\n")
    head, _, _ = _series.split_patch(data)
    if not head:
        errors.append(f"{where}: no header before a `---` line; expected `Field: value` lines")
    if any(line.endswith(b"\r\n") for line in head):
        errors.append(f"{where}: header lines end in CRLF; expected LF")
    try:
        patch = _series.parse_patch(name, data)
    except _series.ConfigError as exc:
        errors.append(str(exc))
        return
    errors.extend(f"{where}: {msg}" for msg in patch.header_errors)
    errors.extend(f"{where}: {msg}; expected plain text edits" for msg in patch.unsupported)
    _lint_header(where, patch, pin, errors, warnings)
    seen = set()
    for fp in patch.files:
        if fp.path in seen:
            errors.append(f"{where}: {fp.path} appears twice; expected one diff per file")
        seen.add(fp.path)
        if not fp.path.startswith("vllm/") or ".." in fp.path.split("/") or "\\" in fp.path:
            errors.append(f"{where}: touches {fp.path}; expected paths under vllm/ only "
                          "(setup.py, csrc/, tests/ are not in the wheel)")
        last_end = 0
        for hunk in fp.hunks:
            if hunk.source_start < last_end:
                errors.append(f"{where}: {fp.path} hunk {hunk.index} overlaps or precedes the previous one")
            last_end = hunk.source_start + hunk.source_length
            lead = hunk.num_lead
            if fp.kind == "modify" and lead != _diff.CONTEXT and hunk.source_start != 1:
                warnings.append(f"{where}: {fp.path} hunk {hunk.index} has {lead} leading context "
                                "lines; expected 3 (regenerate with --make-patch)")
        _lint_markers(where, patch.stem, fp, errors)


def _lint_header(where: str, patch: _series.Patch, pin: dict[str, str], errors: list[str],
                 warnings: list[str]) -> None:
    header = patch.header
    for key in REQUIRED:
        if not any(v.strip() for v in header.get(key, [])):
            errors.append(f"{where}: header field {key}: missing; required ({', '.join(REQUIRED)})")
    for key in RECOMMENDED:
        if not any(v.strip() for v in header.get(key, [])):
            warnings.append(f"{where}: header field {key}: missing (recommended)")
    has_minus = any(t == "-" for fp in patch.files for h in fp.hunks for t, _ in h.lines)
    if has_minus and not patch.first("Allow-Delete").strip():
        errors.append(f"{where}: removes lines but has no Allow-Delete; expected a reason")
    if not has_minus and "Allow-Delete" in header:
        errors.append(f"{where}: Allow-Delete set but the diff removes no line; expected it only with `-` lines")
    category = patch.first("Category")
    if category and category not in CATEGORIES:
        warnings.append(f"{where}: Category {category!r}; expected one of {CATEGORIES}")
    for anchor in header.get("Anchor", []):
        if not ANCHOR_RE.match(anchor):
            warnings.append(f"{where}: Anchor {anchor!r}; expected vllm/<path>.py::<Qual.name>")
    upstream_pin = patch.first("Upstream-Pin")
    if upstream_pin and not pin["commit"].startswith(upstream_pin):
        warnings.append(f"{where}: Upstream-Pin {upstream_pin} is not VLLM_PIN {pin['commit'][:7]}")
    last_update = patch.first("Last-Update")
    if last_update and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", last_update):
        warnings.append(f"{where}: Last-Update {last_update!r}; expected YYYY-MM-DD")


def _lint_markers(where: str, stem: str, fp: _series.FilePatch, errors: list[str]) -> None:
    """Every `+` line inside a START/END fence of this patch's stem; fences balanced and aligned."""
    open_indent: bytes | None = None
    check_indent: bytes | None = None
    for hunk in fp.hunks:
        for num, (tag, line) in enumerate(hunk.lines, 1):
            at = f"{where}: {fp.path} hunk {hunk.index} line {num}"
            match = _series.MARKER_RE.match(line)
            if match and tag == "+":
                indent, kind, marker_stem = match.groups()
                if marker_stem.decode() != stem:
                    errors.append(f"{at}: marker carries stem {marker_stem.decode()!r}; expected {stem!r}")
                if kind == b"START":
                    if open_indent is not None:
                        errors.append(f"{at}: START inside an open fence; expected END first")
                    open_indent = check_indent = indent
                elif open_indent is None:
                    errors.append(f"{at}: END without START")
                else:
                    if indent != open_indent:
                        errors.append(f"{at}: END indented {len(indent)}, START {len(open_indent)}; expected equal")
                    open_indent = None
                continue
            if tag == "+":
                if open_indent is None and not _blank_next_to_fence(hunk.lines, num - 1):
                    errors.append(f"{at}: added line outside a `# ### PATCH START: {stem}` fence")
                body = line.rstrip(b"\n")
                body = body[:-1] if body.endswith(b"\r") else body
                if body != body.rstrip():
                    errors.append(f"{at}: trailing whitespace in an added line")
            if check_indent is not None and line.strip() and tag != "-":
                indent = line[:len(line) - len(line.lstrip(b" \t"))]
                if indent != check_indent:
                    errors.append(f"{at}: START marker indented {len(check_indent)}, the code after "
                                  f"it {len(indent)}; expected the surrounding code's indentation")
                check_indent = None
    if open_indent is not None:
        errors.append(f"{where}: {fp.path}: START without END")


def _blank_next_to_fence(lines, index: int) -> bool:
    """A blank added line right after an added END or right before an added START is spacing."""
    if lines[index][1].strip():
        return False
    before = next((x for x in reversed(lines[:index]) if x[1].strip()), None)
    after = next((x for x in lines[index + 1:] if x[1].strip()), None)
    return any(x is not None and x[0] == "+" and _series.MARKER_RE.match(x[1]) and
               (x is before) == (b"PATCH END" in x[1]) for x in (before, after))


def run_lint(patches_dir: Path, pin: dict[str, str], out) -> int:
    errors, warnings = lint_series(patches_dir, pin)
    for msg in warnings:
        out.error(f"warning: {msg}")
    for msg in errors:
        out.error(msg)
    if errors:
        out.error(f"FAILED: lint: {len(errors)} violations ({len(warnings)} warnings); "
                  "fix them (docs/patch-tooling.md#patch-files, #lint-rules)")
        return 4
    num = len(_series.parse_series(patches_dir / "series"))
    out.info(f"OK: lint: {num} patches, no violations ({len(warnings)} warnings)")
    return 0
