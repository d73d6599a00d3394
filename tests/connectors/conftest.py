"""Shared fixtures of the multi-process connector tests: one worker pool per session."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

# NOTE: spawned workers import `_harness` / `_scenarios` by name; this folder must be on their path
# (spawn hands the parent's sys.path to its children).
sys.path.insert(0, str(Path(__file__).parent))
if importlib.util.find_spec("vllm_afd") is None:  # a bare checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "overlay"))

from _harness import WorkerPool  # noqa: E402


@pytest.fixture(scope="session")
def pool():
    workers = WorkerPool(3)
    yield workers
    workers.close()
