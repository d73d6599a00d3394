"""The probe plugin registers its hooks once per interpreter, forked children included.

vLLM's `LLM` front end loads general plugins, then forks the engine core, which loads them
again (and the probe workers call `install()` too).  A forked child inherits the parent's
registries, so registering there again made every probe hook fire twice per call; the GPU
hook check then counted two forward contexts per model forward.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this interpreter")
try:
    import vllm.forward_context as forward_context_module
except ImportError as exc:  # pragma: no cover - depends on the interpreter
    pytest.skip(f"vLLM does not import here ({exc})", allow_module_level=True)
if not hasattr(forward_context_module, "register_forward_context_hook"):
    pytest.skip("this interpreter's vLLM lacks the patch series", allow_module_level=True)

pytestmark = pytest.mark.vllm
PROBE_DIR = Path(__file__).resolve().parents[1] / "hook_probe"


@pytest.fixture
def probe(monkeypatch):
    monkeypatch.syspath_prepend(str(PROBE_DIR))
    return importlib.import_module("afd_hook_probe")


def _probe_hooks(afd_hook_probe) -> int:
    return sum(hook is afd_hook_probe._on_forward_context for hook in forward_context_module._forward_context_hooks)


def test_forked_child_keeps_one_registration_and_records_its_process(probe, tmp_path, monkeypatch):
    afd_hook_probe = probe
    monkeypatch.setenv(afd_hook_probe.OUT_ENV, str(tmp_path))
    monkeypatch.setattr(afd_hook_probe, "_hooks_registered", False)
    monkeypatch.setattr(afd_hook_probe, "_process_recorded_pid", None)
    before = list(forward_context_module._forward_context_hooks)
    try:
        afd_hook_probe.install()
        afd_hook_probe.install()
        assert _probe_hooks(afd_hook_probe) == 1
        read_fd, write_fd = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - runs in the child
            afd_hook_probe.install()
            os.write(write_fd, str(_probe_hooks(afd_hook_probe)).encode())
            os._exit(0)
        os.close(write_fd)
        child_count = int(os.read(read_fd, 16).decode())
        os.waitpid(child, 0)
        assert child_count == 1
        events = [json.loads(line)
                  for path in tmp_path.glob("events-*.jsonl") for line in path.read_text().splitlines()]
        assert sorted(e["pid"] for e in events if e["event"] == "process") == sorted([os.getpid(), child])
    finally:
        forward_context_module._forward_context_hooks[:] = before
        from vllm.config import vllm as config_module
        config_module._vllm_config_hooks[:] = [h for h in config_module._vllm_config_hooks
                                               if h is not afd_hook_probe._on_vllm_config]
