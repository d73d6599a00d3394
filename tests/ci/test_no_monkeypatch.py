"""The AST gate catches every run-time patch pattern and passes the real overlay."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GATE = ROOT / "ci" / "check_no_monkeypatch.py"


def run_gate(*paths):
    return subprocess.run([sys.executable, str(GATE), *map(str, paths)],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("snippet, expected", [
    ("import torch\ntorch.set_num_threads = print\n", "assigns torch.set_num_threads"),
    ("import vllm.forward_context as fc\nfc._forward_context = None\n", "assigns fc._forward_context"),
    ("from vllm.v1.worker import gpu_worker\nsetattr(gpu_worker, 'Worker', object)\n", "setattr on gpu_worker"),
    ("from vllm.v1.worker.gpu_worker import Worker\nWorker.init_device = print\n", "assigns Worker.init_device"),
    ("from vllm.v1.worker.gpu_worker import Worker\ndel Worker.init_device\n", "assigns Worker.init_device"),
    ("import sys\nsys.modules['vllm'] = None\n", "writes sys.modules"),
    ("import sys\nsys.modules.setdefault('vllm', None)\n", "writes sys.modules"),
    ("from unittest import mock\n", "imports unittest.mock"),
    ("import importlib\nimportlib.reload(importlib)\n", "importlib.reload"),
    ("import vllm\nhasattr(vllm, 'x')\n", "hasattr probe of vllm"),
    ("import vllm\ngetattr(vllm, 'x', None)\n", "getattr-with-default probe"),
    ("class A: pass\na = A()\na.__class__ = int\n", "assigns a.__class__"),
])
def test_each_patch_pattern_is_reported(tmp_path, snippet, expected):
    (tmp_path / "bad.py").write_text(snippet)

    done = run_gate(tmp_path)

    assert done.returncode == 1
    assert expected in done.stdout


def test_own_objects_and_suppressed_lines_pass(tmp_path):
    (tmp_path / "ok.py").write_text(textwrap.dedent("""\
        import torch
        class Mine:
            pass
        mine = Mine()
        mine.value = torch.zeros(1)
        context = object()
        torch.x = 1  # noqa: AFD-MONKEYPATCH(test of the suppression)
    """))

    done = run_gate(tmp_path)

    assert done.returncode == 0, done.stdout
    assert "suppressed:" in done.stdout and "1 suppressed" in done.stdout


def test_the_overlay_and_scripts_have_no_monkeypatch():
    done = run_gate(ROOT / "overlay", ROOT / "scripts")

    assert done.returncode == 0, done.stdout
