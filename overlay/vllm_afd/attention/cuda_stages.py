"""The CUDA attention's micro-batch stages: vLLM's own `UBatchRunner`, told AFD's count
(docs/pingpong.md#41-model-runner-v2-cuda).

Model Runner V2 already runs a step as micro-batches: `UBatchRunner.prepare` slices the batch and
builds one forward context per micro-batch, `run` runs the native model forward once per
micro-batch on its own thread, and the threads hand the GPU to each other at every `dbo_yield()`
(`vllm/v1/worker/ubatching.py`); a FULL CUDA graph of a split step records the interleaved kernel
order with the threads parked outside it and replays it with no thread at all.  vLLM builds that
runner only for DBO at DP > 1; the seam `mrv2-add-num-ubatches` lets the AFD runner build it with
`num_stages` (`AFDAttentionModelRunner.build_ubatch_runner`).  What AFD adds here:

* `AFDUBatchRunner.prepare` arms the runner's `CaptureArm` with one stage per micro-batch before
  vLLM builds their forward contexts (which carry no batch descriptor), so the forward-context hook
  gives context j a sidecar of stage j; every caller of `prepare` (an eager step, a FULL replay's
  metadata refresh, a capture's warm-up and recorded forward) goes through it.
* `AFDUBatchRunner.num_ubatches_for` (seam `mrv2-add-ubatch-vote`): how many stages a uniform decode
  step runs, by the planner (`attention/stages.py`, with `min_tokens_per_stage`).  At DP 1 the graph
  manager's `dispatch` asks it (capture.py); at DP > 1 vLLM's DP vote asks it with the fewest tokens
  on any rank, so every rank splits and pads alike or none does
  (docs/pingpong.md#31-stage-count-and-ranges-attentionstagespy); and vLLM's capture rule asks it which
  sizes get a split twin graph (seam `cudagraph-ask-runner-for-ubatch-twin`).
* `DBO_BATON`: the send op's yield (`attention/step.py`), which is vLLM's `dbo_yield` (a no-op outside
  the micro-batch threads), so stage j+1 issues its attention while stage j's rows travel and the
  FFN computes them: the (layer, stage) order that cannot deadlock
  (docs/pingpong.md#5-ordering-why-the-receives-cannot-deadlock).

Sends stay on the stage's compute stream: an IPC send is one copy and one flag write, so the
ordering of the compute stream is the overlap (stage j+1's attention kernels run while the FFN
waits on stage j's flag, then computes); an NCCL send already runs on its own comm stream
(`wire/transports/nccl.py`).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.gpu.ubatch_utils import UBatchRunner
from vllm.v1.worker.ubatching import dbo_yield

from vllm_afd.attention.capture import CaptureArm
from vllm_afd.attention.stages import stages_for_step

__all__ = ["DBO_BATON", "AFDUBatchRunner"]


class _DBOBaton:
    """The CUDA stages' baton: vLLM's handoff between its micro-batch threads."""

    def yield_stage(self) -> None:
        dbo_yield()


DBO_BATON = _DBOBaton()


class AFDUBatchRunner(UBatchRunner):
    """vLLM's micro-batch runner whose `prepare` first arms one sidecar per stage (module docstring)."""

    def __init__(self, *args: Any, arm: CaptureArm, min_tokens_per_stage: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.afd_arm = arm
        self.afd_min_tokens_per_stage = min_tokens_per_stage

    def num_ubatches_for(self, num_tokens: int, uniform_decode: bool) -> int:
        """Patch `mrv2-add-ubatch-vote`: a uniform decode step of `num_tokens` (at DP > 1: the fewest on any
        rank) runs the planner's stage count; any other step runs whole (docs/decisions.md#39-the-cuda-stages)."""
        if not uniform_decode:
            return 1
        return stages_for_step(self.num_ubatches, num_tokens, min_tokens_per_stage=self.afd_min_tokens_per_stage)

    def prepare(self, *args: Any, **kwargs: Any) -> Any:
        self.afd_arm.arm(self.num_ubatches)  # NOTE: vLLM builds the stages' contexts in stage order
        return super().prepare(*args, **kwargs)
