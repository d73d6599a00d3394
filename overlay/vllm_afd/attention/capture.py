"""The graph-manager subclass of the CUDA attention runner (`FULL_DECODE_ONLY` graphs).

vLLM's Model Runner V2 builds its `ModelCudaGraphManager` from the runner's class-valued
`cudagraph_manager_cls` (patch `mrv2-add-cudagraph-manager-cls`), rebuilt for graph-memory
profiling and again for real, so binding the subclass to the runner covers both.  Its
capture hook (patch `cudagraph-add-before-capture-forward`) fires before each warm-up and
each recorded forward, outside `torch.cuda.graph`: there it publishes the payload that
makes the FFN run an eager step alongside the warm-up, or record its own graph.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager

from vllm_afd.attention.payloads import capture_counts


class AFDModelCudaGraphManager(ModelCudaGraphManager):
    """Publishes warm-up and capture payloads; replay is published by the runner."""

    afd_runner: Any = None  # set on the per-runner subclass made by bind_cudagraph_manager

    def before_capture_forward(self, desc: Any, warmup: bool) -> None:
        super().before_capture_forward(desc, warmup)
        connector = self.afd_runner.afd_connector
        connector.publish({0: capture_counts(desc.num_tokens, connector.placement.dp_size)},
                          is_warmup=warmup, is_graph_capturing=not warmup)


def bind_cudagraph_manager(runner: Any) -> type[AFDModelCudaGraphManager]:
    """A manager subclass of our own that knows its runner (vLLM builds the instance)."""
    return type("BoundAFDModelCudaGraphManager", (AFDModelCudaGraphManager,),
                {"afd_runner": runner})
