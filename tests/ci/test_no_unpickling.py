"""The unpickling gate catches every form of unpickling and passes the real overlay."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GATE = ROOT / "ci" / "check_no_unpickling.py"


def run_gate(*paths):
    return subprocess.run([sys.executable, str(GATE), *map(str, paths)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("snippet, expected", [
    ("import pickle\n", "imports pickle"),
    ("import pickle as p\np.loads(b'')\n", "calls p.loads"),
    ("import pickle\npickle.load(open('f', 'rb'))\n", "calls pickle.load"),
    ("from pickle import loads\n", "imports from pickle"),
    ("from pickle import load as undo\n", "imports from pickle"),
    ("import _pickle\n", "imports _pickle"),
    ("import cloudpickle\n", "imports cloudpickle"),
    ("import marshal\n", "imports marshal"),
    ("__import__('pickle')\n", "imports pickle (__import__)"),
    ("import importlib\nimportlib.import_module('pickle')\n", "imports pickle (importlib.import_module)"),
    ("def f(group):\n    return group.broadcast_obj(None, src=0)\n", "uses group.broadcast_obj"),
    ("def f(group):\n    return group.recv_obj(src=0)\n", "uses group.recv_obj"),
    ("from vllm.distributed.utils import StatelessProcessGroup\n", "imports StatelessProcessGroup"),
    ("import vllm.distributed.utils as u\nu.StatelessProcessGroup(rank=0, world_size=2, store=None)\n",
     "uses u.StatelessProcessGroup"),
    ("import torch.distributed as dist\ndist.broadcast_object_list([None])\n", "uses dist.broadcast_object_list"),
    ("def f(group):\n    return getattr(group, 'recv_obj')(src=0)\n", "uses recv_obj through getattr"),
])
def test_each_unpickling_form_is_reported(tmp_path, snippet, expected):
    (tmp_path / "bad.py").write_text(snippet)

    done = run_gate(tmp_path)

    assert done.returncode == 1, done.stdout
    assert expected in done.stdout
    assert "bad.py:" in done.stdout


def test_json_other_loads_and_suppressed_lines_pass(tmp_path):
    (tmp_path / "ok.py").write_text(textwrap.dedent("""\
        import json
        import pickle  # noqa: AFD-UNPICKLE(test of the suppression)
        data = json.loads("{}")
        def f(safetensors):
            return safetensors.load(b"")
    """))

    done = run_gate(tmp_path)

    assert done.returncode == 0, done.stdout
    assert "suppressed:" in done.stdout and "1 suppressed" in done.stdout


def test_the_overlay_unpickles_nothing():
    done = run_gate(ROOT / "overlay")

    assert done.returncode == 0, done.stdout
    assert "0 unpickling uses" in done.stdout


def test_a_missing_path_or_no_argument_is_a_usage_error(tmp_path):
    assert run_gate(tmp_path / "absent").returncode == 2
    assert run_gate().returncode == 2
