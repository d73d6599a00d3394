"""Probe CUDA worker: builds the probe MRV2 runner through `_make_model_runner`."""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.gpu_worker import Worker

from afd_hook_probe import record
from afd_hook_probe.workers import ProbeWorkerMixin


class ProbeGPUWorker(ProbeWorkerMixin, Worker):
    def _make_model_runner(self) -> Any:
        if self.use_v2_model_runner and not self.vllm_config.is_mm_encoder_only:
            from afd_hook_probe.mrv2 import ProbeMRV2Runner

            runner = ProbeMRV2Runner(self.vllm_config, self.device)
        else:
            runner = super()._make_model_runner()
        record("make_model_runner", worker=type(self).__name__, runner=type(runner).__name__)
        return runner
