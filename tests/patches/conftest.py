"""Fixtures for the tests of scripts/apply_patches.py: a temp vLLM-like tree, a pin file,
patch series written from literal mini-diffs, and (for `wheel` tests) the official wheels
fetched into the cache by the same code the script uses."""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

import _patchlib as pl  # noqa: E402
import _wheel as wh  # noqa: E402
import apply_patches  # noqa: E402

VERSION_PY = b"__version__ = version = '0.30.0'\n__commit_id__ = commit_id = 'gced6857af'\n"
HEADER = (b"Subject: t: test patch\nCategory: seam\nWhy: test\nHow: test\nUpstream: local only\n"
          b"Anchor: vllm/a.py::f\nRemove-When: never\nUsed-By: tests\nUpstream-Pin: ced6857\n"
          b"Last-Update: 2026-11-29\n")


def pin_text(**extra: str) -> str:
    lines = ["commit = ced6857afa0ea7b2e3f0846a62e1394e90f15607", "short = ced6857",
             "version = 0.30.0", "commit_id = gced6857af"]
    lines += [f"{k.replace('_', '.', 1)} = {v}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture
def pin(tmp_path: Path) -> Path:
    path = tmp_path / "VLLM_PIN"
    path.write_text(pin_text())
    return path


def code_file(num_funcs: int = 12, eol: bytes = b"\n") -> bytes:
    return b"".join(b"def f%d():%s    return %d%s%s" % (i, eol, i, eol, eol) for i in range(num_funcs))


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """vllm/_version.py, vllm/a.py (LF) and vllm/b.py (CRLF)."""
    root = tmp_path / "tree"
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "_version.py").write_bytes(VERSION_PY)
    (root / "vllm" / "a.py").write_bytes(code_file())
    (root / "vllm" / "b.py").write_bytes(code_file(eol=b"\r\n"))
    return root


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
    return pl.make_patch(header, [(path, data, hook_edit(data, func, stem, eol))])


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def run(capsys):
    """Call main(argv) and return (exit code, stdout + stderr)."""
    def call(*argv: str | Path) -> tuple[int, str]:
        code = apply_patches.main([str(a) for a in argv])
        captured = capsys.readouterr()
        return code, captured.out + captured.err
    return call


# --------------------------------------------------------------------------- official wheels

def wheel_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "afd-vllm-wheels"


@pytest.fixture(scope="session")
def official_wheels() -> dict[str, Path]:
    """The pinned cuda and cpu wheels, from the cache or `pip download` (sha256-checked)."""
    pinned = pl.read_pin(ROOT / "VLLM_PIN")
    wheels = {}
    for flavor in ("cuda", "cpu"):
        path = wh.fetch_wheel(pinned[f"{flavor}.dist"], pinned["version"], wheel_cache(),
                              filename=pinned[f"{flavor}.wheel"], timeout_s=1800)
        assert wh.sha256_file(path) == pinned[f"{flavor}.sha256"], f"{path}: sha256 differs from VLLM_PIN"
        wheels[flavor] = path
    return wheels


@pytest.fixture(scope="session")
def real_series() -> Path:
    pdir = ROOT / "patches"
    if not (pdir / "series").is_file():
        pytest.skip("patches/series not written yet")
    return pdir


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
