"""The graph-manager subclass of the CUDA attention runner (`FULL_DECODE_ONLY` graphs).

vLLM's Model Runner V2 builds its `ModelCudaGraphManager` from the runner's class-valued
`cudagraph_manager_cls` (patch `mrv2-add-cudagraph-manager-cls`), rebuilt for graph-memory
profiling and again for real, so binding the subclass to the runner covers both.  Its
capture hook (patch `cudagraph-add-before-capture-forward`) fires before each warm-up and
each recorded forward, outside `torch.cuda.graph`: there it publishes the payload that
makes the FFN run an eager step alongside the warm-up, or record its own graph.

vLLM builds the forward context of a FULL warm-up or recorded forward without a batch
descriptor, like the KV connector's side contexts, which run no model.  So the hook also arms
the runner's `CaptureArm`: the next context without a descriptor is that forward's and gets a
(published) sidecar; any other descriptor-less context gets none.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager

from vllm_afd.attention.payloads import capture_counts


class CaptureArm:
    """One sidecar per capture-hook publish, for the forward context that follows it."""

    def __init__(self) -> None:
        self._armed = False

    def arm(self) -> None:
        """The capture hook published; the next descriptor-less context runs that forward."""
        self._armed = True

    def runs_model(self, has_batch_descriptor: bool) -> bool:
        """Whether a new context runs the model: executed steps carry a descriptor; an armed
        capture forward takes the arm; other descriptor-less contexts (KV connector) run none."""
        if has_batch_descriptor:
            return True
        armed, self._armed = self._armed, False
        return armed


class AFDModelCudaGraphManager(ModelCudaGraphManager):
    """Publishes warm-up and capture payloads; replay is published by the runner."""

    afd_runner: Any = None  # set on the per-runner subclass made by bind_cudagraph_manager

    def before_capture_forward(self, desc: Any, warmup: bool) -> None:
        super().before_capture_forward(desc, warmup)
        connector = self.afd_runner.afd_connector
        connector.publish({0: capture_counts(desc.num_tokens, connector.placement.dp_size)},
                          is_warmup=warmup, is_graph_capturing=not warmup)
        self.afd_runner.afd_capture_arm.arm()


def bind_cudagraph_manager(runner: Any) -> type[AFDModelCudaGraphManager]:
    """A manager subclass of our own that knows its runner (vLLM builds the instance)."""
    return type("BoundAFDModelCudaGraphManager", (AFDModelCudaGraphManager,),
                {"afd_runner": runner})
