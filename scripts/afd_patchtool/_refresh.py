"""--refresh of scripts/apply_patches.py: regenerate patch files from an edited, patched tree.

A patch author edits the patched vLLM tree (an `--apply-to` scratch tree), then runs

    python scripts/apply_patches.py --refresh DIR [--patch NAME] [--dry-run]

Every change between the pristine vLLM and DIR is assigned to a patch by the fence that holds it
(`# ### PATCH START: <stem>` ... `END: <stem>`); a change outside every fence, or touching two
fences at once, is an error that names the lines.  The patches' states are rebuilt in series
order (patch k = pristine + the changes owned by patches 1..k, diffed against 1..k-1) and written
with the byte-stable diff writer; headers are kept as they are.  `--refresh` without DIR refreshes
the tree the series itself produces: it must reproduce every patch byte for byte, which is the
"patches are up to date" gate CI runs (`--dry-run`: exit 3 where a byte would change).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from afd_patchtool import _diff
from afd_patchtool import _placement
from afd_patchtool import _series
from afd_patchtool._report import Out
from afd_patchtool._upstream import pristine_sources, read_file

Read = Callable[[str], "bytes | None"]


@dataclass(frozen=True)
class Change:
    """One non-equal opcode of pristine -> edited lines, and the patch stem owning it."""

    # Pristine lines [old_start, old_stop) become edited lines [new_start, new_stop).
    old_start: int
    old_stop: int
    new_start: int
    new_stop: int
    owner: str


def fence_owners(path: str, lines: list[bytes]) -> list[str | None]:
    """The fence stem each line lies in (its START and END lines included); None outside fences."""
    owners: list[str | None] = []
    open_stem: str | None = None
    for lineno, line in enumerate(lines, 1):
        match = _series.MARKER_RE.match(line)
        if match is None:
            owners.append(open_stem)
            continue
        kind, stem = match.group(2).decode(), match.group(3).decode()
        if kind == "START":
            if open_stem is not None:
                raise _series.ConfigError(
                    f"{path}:{lineno}: PATCH START: {stem} inside the open fence {open_stem}; expected "
                    "fences not to nest. Close the first fence before opening the next.")
            open_stem = stem
            owners.append(stem)
        else:
            if open_stem != stem:
                raise _series.ConfigError(
                    f"{path}:{lineno}: PATCH END: {stem} closes {open_stem or 'no open fence'}; expected "
                    f"END: {open_stem or stem} to match its START. Fix the fence.")
            owners.append(stem)
            open_stem = None
    if open_stem is not None:
        raise _series.ConfigError(f"{path}: PATCH START: {open_stem} is never closed; expected a "
                                  f"matching '# ### PATCH END: {open_stem}'. Add it.")
    return _own_spacing(lines, owners)


def _own_spacing(lines: list[bytes], owners: list[str | None]) -> list[str | None]:
    """Blank lines right after an END or right before a START belong to that fence (as in the lint)."""
    owned = list(owners)
    for index, line in enumerate(lines):
        if owners[index] is not None or line.strip():
            continue
        before = next((i for i in range(index - 1, -1, -1) if lines[i].strip()), None)
        after = next((i for i in range(index + 1, len(lines)) if lines[i].strip()), None)
        for near, kind in ((before, b"END"), (after, b"START")):
            match = None if near is None else _series.MARKER_RE.match(lines[near])
            if match is not None and match.group(2) == kind:
                owned[index] = match.group(3).decode()
                break
    return owned


def file_changes(path: str, old: bytes | None, new: bytes, stems: set[str],
                 sole_owner: str | None, deleters: set[str] = frozenset()) -> list[Change]:
    """The owned changes of one file.

    `sole_owner` is the one patch of the series touching this file (None if none or several): it
    owns the file when the pristine tree lacks it, and an unfenced pure deletion when its header
    allows deletions (`Allow-Delete`, a stem in `deleters`), as the lint accepts them.
    """
    old_lines, new_lines = _series.split_lines(old or b""), _series.split_lines(new)
    owners = fence_owners(path, new_lines)
    matcher = difflib.SequenceMatcher(None, old_lines, new_lines, autojunk=False)
    changes = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        if j1 < j2:
            found = set(owners[j1:j2])
        else:  # a pure deletion belongs to the fence around the gap it leaves
            before, after = (owners[j1 - 1] if j1 else None), (owners[j1] if j1 < len(owners) else None)
            found = {before} if before == after else {None}
        if (old is None or (j1 == j2 and sole_owner in deleters)) and sole_owner is not None:
            found = {sole_owner}
        where = f"{path}:{j1 + 1}" + (f"-{j2}" if j2 > j1 + 1 else "")
        if None in found or len(found) != 1:
            named = sorted(s for s in found if s)
            raise _series.ConfigError(
                f"{where}: a change {'outside every PATCH fence' if None in found else 'spanning the fences'}"
                f"{' of ' + ', '.join(named) if named else ''}; expected each change inside one "
                "'# ### PATCH START/END: <patch stem>' fence. Wrap it in the fence of the patch it "
                "belongs to (or separate two patches' edits by an unchanged line).")
        (owner,) = found
        if owner not in stems:
            raise _series.ConfigError(
                f"{where}: fence {owner!r} names no patch in the series (have {', '.join(sorted(stems))}); "
                f"expected a patch stem. Rename the fence or add {owner}.patch to patches/series.")
        changes.append(Change(i1, i2, j1, j2, owner))
    return changes


def compose(old: bytes | None, new: bytes, changes: list[Change], keep: set[str]) -> bytes | None:
    """Pristine `old` with the changes of the stems in `keep` applied; None where the file is absent."""
    chosen = [c for c in changes if c.owner in keep]
    if old is None and not chosen:
        return None
    old_lines, new_lines = _series.split_lines(old or b""), _series.split_lines(new)
    out: list[bytes] = []
    pos = 0
    for change in changes:
        out.extend(old_lines[pos:change.old_start])
        source = new_lines[change.new_start:change.new_stop] if change in chosen else \
            old_lines[change.old_start:change.old_stop]
        out.extend(source)
        pos = change.old_stop
    out.extend(old_lines[pos:])
    return b"".join(out)


def refresh_series(patches: list[_series.Patch], pristine: Read, edited: Read,
                   extra_paths: list[str]) -> dict[str, bytes]:
    """Patch name -> regenerated bytes (header kept) for every patch of the series."""
    stems = {p.stem for p in patches}
    touched: dict[str, list[str]] = {}
    for patch in patches:
        for fp in patch.files:
            touched.setdefault(fp.path, []).append(patch.stem)
    paths = sorted(set(touched) | set(extra_paths))
    deleters = {p.stem for p in patches if p.first("Allow-Delete").strip()}
    per_file: dict[str, tuple[bytes | None, bytes | None, list[Change]]] = {}
    for path in paths:
        old, new = pristine(path), edited(path)
        if new is None:
            raise _series.ConfigError(
                f"{path}: missing from the edited tree; expected the patched file. Deleting files is "
                "not supported by --refresh: edit the patch by hand.")
        sole = touched[path][0] if len(touched.get(path, [])) == 1 else None
        per_file[path] = (old, new, file_changes(path, old, new, stems, sole, deleters))
    result: dict[str, bytes] = {}
    for index, patch in enumerate(patches):
        before, upto = {p.stem for p in patches[:index]}, {p.stem for p in patches[:index + 1]}
        files = []
        for path, (old, new, changes) in per_file.items():
            if not any(c.owner == patch.stem for c in changes):
                continue
            files.append((path, compose(old, new, changes, before), compose(old, new, changes, upto)))
        if not files:
            raise _series.ConfigError(
                f"{patch.name}: no change in the edited tree is fenced '{patch.stem}'; expected at least "
                f"one. Restore its edits, or remove {patch.name} from patches/series.")
        header = b"".join(_series.split_patch(patch.data)[0])
        result[patch.name] = _diff.make_patch(header, files)
    return result


def run_refresh(args, pin: dict[str, str], patches: list[_series.Patch], out: Out) -> int:
    """Write (or with --dry-run compare) the regenerated patch files; exit 3 where stale."""
    if args.refresh:
        root = Path(args.refresh)
        if not (root / "vllm").is_dir():
            raise _series.ConfigError(f"--refresh {root}: no vllm/ inside; expected the patched tree "
                                      "(the DIR given to --apply-to). Fix the path.")
        extra = _marked_files(root)
    else:
        root, extra = None, []
    # The patched files are equal in both flavors: the first source is the pristine one.
    source_name, pristine = pristine_sources(args, pin, patches, out, widen=False, extra=extra)[0]
    if root is None:
        series = _placement.apply_series(patches, pristine)
        bad = [o.name for o in series.outcomes if o.status != "applied"]
        if bad:
            raise _series.PatchApplyError(f"--refresh: {', '.join(bad)} do not apply to {source_name}; "
                                          "expected the series to apply. Run --check -v.")
        edited, target = series.after.get, f"the series applied to {source_name}"
    else:
        def edited(path: str) -> bytes | None:
            return read_file(root, path)
        target = str(root)
    chosen = [p for p in patches if not args.patch or p.name in (args.patch, f"{args.patch}.patch")]
    if args.patch and not chosen:
        raise _series.ConfigError(f"--patch {args.patch}: not in patches/series; expected one of "
                                  f"{', '.join(p.name for p in patches)}.")
    fresh = refresh_series(patches, pristine, edited, extra)
    stale = [p.name for p in chosen if fresh[p.name] != p.data]
    for name in stale:
        if args.dry_run:
            out.error(f"{name}: out of date with {target}; rerun without --dry-run to rewrite it")
        else:
            (Path(args.patches) / name).write_bytes(fresh[name])
            out.info(f"refreshed {name}")
    if args.dry_run:
        verdict = f"{len(stale)} of {len(chosen)} patches would change" if stale else "up to date"
        out.info(f"{'DRIFT' if stale else 'OK'}: {verdict} ({target}); --dry-run: nothing written")
        return 3 if stale else 0
    out.info(f"OK: {len(stale)} of {len(chosen)} patches rewritten from {target}")
    return 0


def _marked_files(root: Path) -> list[str]:
    """Files under root/vllm that hold a fence: a patch may own a file the series does not touch yet."""
    found = []
    for path in sorted((root / "vllm").rglob("*.py")):
        if b"# ### PATCH START: " in path.read_bytes():
            found.append(path.relative_to(root).as_posix())
    return found
