"""What the probe workers share: counting executed steps and model forwards.

The workers live in `cpu_worker.py` and `gpu_worker.py` and this module imports neither
vLLM worker: importing `vllm.v1.worker.cpu_worker` patches torch process-wide for CPU
(`vllm/v1/worker/cpu/shm.py`: `torch.cuda.Stream`, `Tensor.pin_memory`, UVA buffers), which
breaks a CUDA worker ("Pointer argument ... cannot be accessed from Triton (cpu tensor?)").
"""

from __future__ import annotations

from typing import Any

from afd_hook_probe import install, is_active, is_capturing, record


def _on_model_forward(module: Any, args: Any) -> None:
    record("model_forward", capturing=is_capturing())


class ProbeWorkerMixin:
    """Records worker steps and (through a torch pre-forward hook) model forwards."""

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
