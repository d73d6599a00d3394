"""Probe workers: count runner construction, executed steps and model forwards.

The probe's config hook names these classes while `worker_cls` is "auto" (or a test
passes one as `worker_cls`). They override the `_make_model_runner` factory added by
the patch series and call `super()`, like the AFD workers will.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker

from afd_hook_probe import install, is_active, is_capturing, record


def _on_model_forward(module: Any, args: Any) -> None:
    record("model_forward", capturing=is_capturing())


class _ProbeWorkerMixin:
    """Records factory calls, worker steps and (via a torch pre-hook) model forwards."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if is_active():
            install()  # also covers runs that pass worker_cls without the entry point
        super().__init__(*args, **kwargs)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        self.model_runner.get_model().register_forward_pre_hook(_on_model_forward)

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        record(
            "execute_model",
            num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
        )
        return super().execute_model(scheduler_output, *args, **kwargs)


class ProbeCPUWorker(_ProbeWorkerMixin, CPUWorker):
    def _make_model_runner(self) -> Any:
        runner = super()._make_model_runner()
        record("make_model_runner", worker=type(self).__name__, runner=type(runner).__name__)
        return runner


class ProbeGPUWorker(_ProbeWorkerMixin, Worker):
    def _make_model_runner(self) -> Any:
        if self.use_v2_model_runner and not self.vllm_config.is_mm_encoder_only:
            from afd_hook_probe.mrv2 import ProbeMRV2Runner

            runner = ProbeMRV2Runner(self.vllm_config, self.device)
        else:
            runner = super()._make_model_runner()
        record("make_model_runner", worker=type(self).__name__, runner=type(runner).__name__)
        return runner
