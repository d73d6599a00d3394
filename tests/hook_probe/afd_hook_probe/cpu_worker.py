"""Probe CPU worker (V1 CPU runner): counts `_make_model_runner` calls, then `super()`."""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker

from afd_hook_probe import record
from afd_hook_probe.workers import ProbeWorkerMixin


class ProbeCPUWorker(ProbeWorkerMixin, CPUWorker):
    def _make_model_runner(self) -> Any:
        runner = super()._make_model_runner()
        record("make_model_runner", worker=type(self).__name__, runner=type(runner).__name__)
        return runner
