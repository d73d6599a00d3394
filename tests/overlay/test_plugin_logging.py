"""The overlay's log lines reach the server log: `vllm_afd` goes through vLLM's handlers (plugin.py).

Regression: on the H200 (run 10 of evidence/gpu-log.md) an FFN server's log held no AFD line at
all, because vLLM configures only its `vllm` logger namespace.
"""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = r"""
import argparse, logging, vllm.logger  # 0.30 configures vLLM's namespace at import
from vllm_afd.plugin import route_afd_logs_to_vllm
from vllm_afd.releases import installed

if not installed().configures_logging_at_import:  # 0.32: as its server entry points do
    vllm.logger.configure_logging_from_args(argparse.Namespace())

route_afd_logs_to_vllm()
route_afd_logs_to_vllm()  # idempotent: handlers are not added twice
ours, theirs = logging.getLogger("vllm_afd"), logging.getLogger("vllm")
assert ours.handlers == theirs.handlers and ours.handlers, (ours.handlers, theirs.handlers)
assert ours.propagate is False
logging.getLogger("vllm_afd.ffn.runner").info("AFD FFN: captured a CUDA graph for step counts X")
"""


def test_afd_info_lines_are_written_by_vllms_handler():
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)

    assert result.returncode == 0, result.stderr
    assert "AFD FFN: captured a CUDA graph for step counts X" in result.stdout + result.stderr


def test_nothing_is_routed_when_vllm_logging_is_off():
    code = CHILD.split("route_afd_logs_to_vllm()\n")[0] + (
        "route_afd_logs_to_vllm()\n"
        "assert logging.getLogger('vllm_afd').handlers == [], logging.getLogger('vllm_afd').handlers\n")

    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "VLLM_CONFIGURE_LOGGING": "0"})

    assert result.returncode == 0, result.stderr
