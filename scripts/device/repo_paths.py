"""The repository's import roots for the device scripts, on a machine where nothing of it is installed.

The GPU machine has no pip (README.md here): gpu_e2e.py runs from the copied working tree, so this
module appends overlay/ (`vllm_afd`), tests/harness/ (`afd_harness`) and scripts/ (`stage_model`) to
sys.path where they do not import already.  In a venv set up by ci/setup_env.sh all three are
installed (`pip install -e . -e tests/harness -e scripts -e scripts/device`) and it changes nothing.
Subprocesses get their roots through `Run.env()` instead.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = {"vllm_afd": REPO / "overlay", "afd_harness": REPO / "tests" / "harness", "stage_model": REPO / "scripts"}

sys.path += [str(root) for module, root in ROOTS.items() if importlib.util.find_spec(module) is None]
