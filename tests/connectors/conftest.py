"""Shared fixtures of the multi-process connector tests: one worker pool per session."""

from __future__ import annotations

import pytest

# NOTE: spawned workers import `tests.connectors._harness` / `_scenarios` by name: pytest puts the
# repository root on sys.path for the `tests` package, and spawn hands the parent's sys.path to its children.
from tests.connectors._harness import WorkerPool


@pytest.fixture(scope="session")
def pool():
    workers = WorkerPool(3)
    yield workers
    workers.close()
