"""Probe Model Runner V2 (CUDA only): records the per-step and capture hooks.

`ProbeMRV2Runner` overrides `before_model_forward` and selects its graph manager through
`cudagraph_manager_cls`; `ProbeCudaGraphManager` overrides `before_capture_forward` and
marks its `capture()` windows and FULL replays in the event stream, so a reader can
check that capture hooks fire only inside capture and never around a replay.
"""

from __future__ import annotations

from typing import Any

from vllm.forward_context import is_forward_context_available
from vllm.v1.worker.gpu.cudagraph_utils import (
    BatchExecutionDescriptor,
    ModelCudaGraphManager,
)
from vllm.v1.worker.gpu.model_runner import GPUModelRunner

from afd_hook_probe import is_capturing, record


class ProbeCudaGraphManager(ModelCudaGraphManager):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.probe_in_capture = False  # inside capture()
        self.probe_in_replay = False  # inside run_fullgraph()

    def capture(self, *args: Any, **kwargs: Any) -> None:
        record("capture_begin", manager=id(self), num_graphs=len(self.graphs))
        self.probe_in_capture = True
        try:
            super().capture(*args, **kwargs)
        finally:
            self.probe_in_capture = False
        record("capture_end", manager=id(self), num_graphs=len(self.graphs))

    def before_capture_forward(self, desc: BatchExecutionDescriptor, warmup: bool) -> None:
        record(
            "before_capture_forward",
            manager=id(self),
            desc=repr(desc),
            cg_mode=desc.cg_mode.name,
            num_tokens=desc.num_tokens,
            warmup=warmup,
            in_capture=self.probe_in_capture,
            in_replay=self.probe_in_replay,
            capturing=is_capturing(),
        )
        super().before_capture_forward(desc, warmup)

    def run_fullgraph(self, desc: BatchExecutionDescriptor) -> Any:
        record("replay", cg_mode=desc.cg_mode.name, num_tokens=desc.num_tokens)
        self.probe_in_replay = True
        try:
            return super().run_fullgraph(desc)
        finally:
            self.probe_in_replay = False


class ProbeMRV2Runner(GPUModelRunner):
    @property
    def cudagraph_manager_cls(self) -> type[ModelCudaGraphManager]:
        return ProbeCudaGraphManager

    def before_model_forward(
        self,
        batch_desc: Any,
        input_batch: Any,
        dp_sync: Any,
        ubatch_state: Any,
    ) -> None:
        record(
            "before_model_forward",
            cg_mode=batch_desc.cg_mode.name,
            num_tokens=batch_desc.num_tokens,
            num_real_tokens=input_batch.num_tokens,
            has_forward_context=is_forward_context_available(),
            capturing=is_capturing(),
        )
        super().before_model_forward(batch_desc, input_batch, dp_sync, ubatch_state)
