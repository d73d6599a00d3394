"""The graph-manager subclass of the CUDA attention runner, and the arm that tells which contexts run the model.

vLLM's Model Runner V2 builds its `ModelCudaGraphManager` from the runner's class-valued
`cudagraph_manager_cls` (patch `mrv2-add-cudagraph-manager-cls`), rebuilt for graph-memory
profiling and again for real, so binding the subclass to the runner covers both.  Its
capture hook (patch `cudagraph-add-before-capture-forward`) fires before each warm-up and
each recorded forward, outside `torch.cuda.graph`: there it publishes the payload that
makes the FFN run an eager step alongside the warm-up, or record its own graph.

Which forward contexts run the model, and as which stage, is the runner's `CaptureArm`: the
capture hook arms it for the one context its forward builds next, and `AFDUBatchRunner.prepare`
for the k micro-batch contexts vLLM's UBatchRunner builds in stage order; an armed context takes
its stage whatever it carries.  Unarmed, a context with a batch descriptor is an executed step
(stage 0) and one without is a side context that runs no model (the KV connector's), which gets
no sidecar.  The arm comes first because the descriptor no longer tells a capture forward apart:
up to 0.32 vLLM built a FULL warm-up or recorded forward's context without a descriptor, since
0.33 `set_forward_context` attaches one whenever it is given a token count, which capture passes.
On all three releases executed steps carry a descriptor, side contexts none, micro-batch contexts
none, and no context is built between an arm and the contexts it is for
(tests/attention/test_capture_arm.py builds them with vLLM's own code).

With `num_stages` > 1 (docs/pingpong.md#41-model-runner-v2-cuda,
docs/pingpong.md#9-cuda-graphs-full_decode_only) the manager also decides, per step, whether
a uniform decode step splits (`dispatch`); which capture sizes get a split twin graph is vLLM's own
rule, which asks the micro-batch runner's `num_ubatches_for` (seam `cudagraph-ask-runner-for-ubatch-twin`,
attention/cuda_stages.py).
"""

from __future__ import annotations

from typing import Any

from vllm.forward_context import ForwardContext
from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager

from vllm_afd.attention.stages import stage_sizes


class CaptureArm:
    """Which forward contexts run the model, and as which stage (module docstring)."""

    def __init__(self) -> None:
        self._stages: list[int] = []

    def arm(self, num_stages: int = 1) -> None:
        """The next `num_stages` contexts run stages 0, 1, … of one forward: a capture hook's forward (1),
        or the micro-batches vLLM's UBatchRunner builds in stage order (k).  A new arm replaces a stale one."""
        self._stages = list(range(num_stages))

    def stage_of(self, context: ForwardContext) -> int | None:
        """The stage a new context runs, or None when it runs no model: an armed context takes the arm
        (a capture forward carries a descriptor since vLLM 0.33, not before); else a descriptor means an
        executed step (stage 0: a split step's own stages were armed and built before it)."""
        if self._stages:
            return self._stages.pop(0)
        return 0 if context.batch_descriptor is not None else None


class AFDModelCudaGraphManager(ModelCudaGraphManager):
    """Publishes warm-up and capture payloads and picks the stage count; replay is published by the runner."""

    afd_runner: Any = None  # set on the per-runner subclass made by bind_cudagraph_manager

    def before_capture_forward(self, desc: Any, warmup: bool) -> None:
        super().before_capture_forward(desc, warmup)
        if desc.num_ubatches == 1:  # a split forward's stage contexts were armed by AFDUBatchRunner.prepare
            self.afd_runner.afd_capture_arm.arm()
        self.afd_runner.afd_step.publish_capture(stage_sizes(desc.num_tokens, desc.num_ubatches), warmup=warmup)

    def dispatch(self, num_reqs: int, num_tokens: int, uniform_token_count: int | None, num_active_loras: int,
                 max_query_len: int | None = None, num_ubatches: int = 1) -> Any:
        """At DP 1, a uniform decode step splits into the planner's stage count: its split graph, else eager stages.

        Only uniform decodes split on the CUDA attention: a decode reads no KV another request of the
        step writes, so vLLM's prefix-cache veto (`_allow_microbatching`, V1 only) is never needed
        (docs/decisions.md#39-the-cuda-stages).  At DP > 1 vLLM's DP vote decides (seam `mrv2-add-ubatch-vote`,
        `AFDUBatchRunner.num_ubatches_for`) and passes its count here; deciding again on one rank's
        dispatch would split a step the vote kept whole (an idle rank's dummy run has no attention to split).
        """
        if num_ubatches == 1 and self.ubatch_runner is not None and self.afd_runner.dp_size == 1:
            num_ubatches = self.ubatch_runner.num_ubatches_for(num_tokens,
                                                               uniform_token_count == self.decode_query_len)
        return super().dispatch(num_reqs, num_tokens, uniform_token_count, num_active_loras,
                                max_query_len=max_query_len, num_ubatches=num_ubatches)


def bind_cudagraph_manager(runner: Any) -> type[AFDModelCudaGraphManager]:
    """A manager subclass of our own that knows its runner (vLLM builds the instance)."""
    return type("BoundAFDModelCudaGraphManager", (AFDModelCudaGraphManager,),
                {"afd_runner": runner})
