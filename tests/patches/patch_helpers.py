"""Helpers shared by the tests of scripts/apply_patches.py: temp vLLM-like trees, pin text,
literal mini-patches.  A uniquely named module, so no other conftest.py can shadow it."""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT / "scripts", ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import _diff  # noqa: E402

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
