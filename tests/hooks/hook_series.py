"""The patch series on disk and the pinned wheel: read, extract, apply (used by conftest and tests)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROBE_SRC = REPO / "tests" / "hook_probe"
SUBPROCESS_TIMEOUT_S = float(os.environ.get("AFD_HOOK_TEST_TIMEOUT_S", "600"))


def pin_file() -> Path:
    """The pin of the release under test: the installed vLLM's (vllm_afd/releases.py), else VLLM_PIN."""
    try:
        from vllm_afd.releases import installed

        return REPO / installed().pin_file
    except ImportError:
        return REPO / "VLLM_PIN"


def read_pin() -> dict[str, str]:
    pin: dict[str, str] = {}
    for line in pin_file().read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            key, value = (part.strip() for part in line.split("=", 1))
            pin[key] = value
    return pin


PATCHES = REPO / read_pin().get("patches", "patches")


def series_names() -> list[str]:
    lines = (PATCHES / "series").read_text().splitlines()
    return [x.strip() for x in lines if x.strip() and not x.lstrip().startswith("#")]


def touched_files() -> list[str]:
    paths: set[str] = set()
    for name in series_names():
        text = (PATCHES / name).read_text(encoding="utf-8")
        paths.update(re.findall(r"^diff --git a/(\S+) b/", text, flags=re.M))
    return sorted(paths)


# Files the contract tests read besides the series' own: a seam upstream absorbed
# (Worker._make_model_runner, upstream from 0.32) is held to the same contract.
CONTRACT_FILES = ("vllm/v1/worker/gpu_worker.py",)


def contract_files() -> list[str]:
    return sorted(set(touched_files()) | set(CONTRACT_FILES))


def find_pinned_wheel(pin: dict[str, str]) -> Path | None:
    """The pinned official wheel (CUDA, else CPU) from the wheel cache, sha256-checked."""
    cache = os.environ.get("AFD_VLLM_WHEEL_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "afd-vllm-wheels"
    )
    for flavor in ("cuda", "cpu"):
        path = Path(cache) / pin[f"{flavor}.wheel"]
        if path.is_file():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            assert digest == pin[f"{flavor}.sha256"], (
                f"tests/hooks: {path} has sha256 {digest}; expected {pin[f'{flavor}.sha256']} "
                "from VLLM_PIN. Delete the file and download the pinned wheel again."
            )
            return path
    return None


def apply_series(root: Path, flavor: str) -> str:
    """Apply the series to `root` (contains vllm/ of the `flavor` wheel); returns the output."""
    applier = REPO / "scripts" / "apply_patches.py"
    if applier.is_file():
        done = subprocess.run(
            [sys.executable, str(applier), "--apply-to", str(root), "--flavor", flavor,
             "--pin", str(pin_file())],
            cwd=REPO, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S,
        )
        assert done.returncode == 0, f"apply_patches.py --apply-to failed:\n{done.stdout}{done.stderr}"
        return done.stdout + done.stderr
    return apply_series_with_gnu_patch(root)


def apply_series_with_gnu_patch(root: Path) -> str:
    """GNU patch, fuzz 0, in series order; fails on any offset or fuzz."""
    if shutil.which("patch") is None:
        pytest.skip("GNU patch is not installed and scripts/apply_patches.py does not exist yet")
    output = []
    for name in series_names():
        done = subprocess.run(
            ["patch", "-p1", "-F0", "-N", "--no-backup-if-mismatch", "-i", str(PATCHES / name)],
            cwd=root, capture_output=True, text=True, timeout=60,
        )
        output.append(done.stdout + done.stderr)
        assert done.returncode == 0, f"{name} does not apply:\n{output[-1]}"
        assert not re.search(r"offset|fuzz", output[-1], re.I), f"{name}: {output[-1]}"
    return "".join(output)


def extract_pinned(wheel: Path, dest: Path, paths: list[str]) -> None:
    with zipfile.ZipFile(wheel) as zf:
        for path in [*paths, "vllm/_version.py"]:
            target = dest / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(path))
