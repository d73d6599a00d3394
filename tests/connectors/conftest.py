"""Shared fixtures of the multi-process connector tests: one worker pool per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# NOTE: spawned workers import `_harness` / `_scenarios` by name; this folder must be on their path.
sys.path.insert(0, str(Path(__file__).parent))

from _harness import WorkerPool  # noqa: E402


@pytest.fixture(scope="session")
def pool():
    workers = WorkerPool(3)
    yield workers
    workers.close()
