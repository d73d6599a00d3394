"""The attention runner on CUDA: vLLM's Model Runner V2 plus the AFD mixin.

Be paranoid about changing this class, and even more about adding lines to it: it only
routes vLLM's own seams to AFD modules.  Model Runner V2 replays FULL CUDA graphs with no
forward context, so the control payload is published from the per-step hook
`before_model_forward` (patch `mrv2-add-before-model-forward`), which runs once per
executed step, eager or replay, dummy and profile steps included; capture forwards
publish from the graph manager's capture hook (capture.py).

With `num_stages` > 1 the runner hands vLLM its stage count and micro-batch runner (patch
`mrv2-add-num-ubatches`, attention/cuda_stages.py); the graph manager decides which steps split
(capture.py), and `before_model_forward` publishes every stage's rows.

Graphs record the pairing they were captured under (the peer's IPC slots, the NCCL communicator),
so after the connector re-formed with a restarted FFN (attention/healing.py) the next step first
drops them (patch `cudagraph-add-release-graphs`, vLLM 0.32's `release_graphs`) and records them
again, which also makes the new FFN record its own; no replay of an old graph comes first.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.config import CUDAGraphMode
from vllm.forward_context import ForwardContext
from vllm.v1.worker.gpu.model_runner import GPUModelRunner

from vllm_afd.attention.capture import CaptureArm, bind_cudagraph_manager
from vllm_afd.attention.cuda_stages import DBO_BATON, AFDUBatchRunner
from vllm_afd.attention.mixin import AFDAttentionRunnerMixin

logger = logging.getLogger(__name__)


class AFDAttentionModelRunner(AFDAttentionRunnerMixin, GPUModelRunner):
    """Model Runner V2 whose model is the attention half."""

    afd_publishes_per_step = True
    afd_stage_baton = DBO_BATON

    def __init__(self, vllm_config: Any, device: Any, afd_config: Any, placement: Any):
        self.afd_capture_arm = CaptureArm()  # before super(): the context hook is live from there
        # The connector's re-formation count when the graphs were recorded; None: no graphs.
        self._afd_graphs_pairing: int | None = None
        super().__init__(vllm_config, device, afd_config, placement)
        self._afd_cudagraph_manager_cls = bind_cudagraph_manager(self)

    @property
    def cudagraph_manager_cls(self) -> type:
        return self._afd_cudagraph_manager_cls

    @property
    def num_ubatches(self) -> int:
        """Patch `mrv2-add-num-ubatches`: one attention metadata builder per stage."""
        return self.afd_num_stages

    def build_ubatch_runner(self) -> Any:
        """Patch `mrv2-add-num-ubatches`: vLLM's micro-batch runner with AFD's stage count and planner (its
        `num_ubatches_for` answers vLLM's DP vote at DP > 1, cuda_stages.py), or none for one stage."""
        if self.afd_num_stages == 1:
            return super().build_ubatch_runner()
        return AFDUBatchRunner(self.vllm_config, self.device, self.model_state, self.attn_groups,
                               self.kv_cache_config, self.max_num_reqs, num_ubatches=self.afd_num_stages,
                               arm=self.afd_capture_arm, min_tokens_per_stage=self.afd_min_tokens_per_stage)

    def capture_model(self, *args: Any, **kwargs: Any) -> int:
        size = super().capture_model(*args, **kwargs)
        if self.cudagraph_manager is not None and self.cudagraph_manager.needs_capture():
            self._afd_graphs_pairing = self.afd_connector.reformations
        return size

    def _afd_before_step(self) -> None:
        """Record the graphs again if the connector re-formed since they were recorded (the step gate passed)."""
        if self._afd_graphs_pairing in (None, self.afd_connector.reformations):
            return
        logger.info("AFD attention: re-recording CUDA graphs for the re-formed pairing (re-formation %d)",
                    self.afd_connector.reformations)
        self.cudagraph_manager.release_graphs()
        self.capture_model()

    def before_model_forward(self, batch_desc: Any, input_batch: Any, dp_sync: Any,
                             ubatch_state: Any) -> None:
        super().before_model_forward(batch_desc, input_batch, dp_sync, ubatch_state)
        self.afd_step.publish_executed(
            batch_desc.num_tokens,
            None if dp_sync is None else dp_sync.num_tokens_across_dp.tolist(),
            None if ubatch_state is None else [s.num_tokens for s in ubatch_state.slices],
            is_graph_replaying=batch_desc.cg_mode == CUDAGraphMode.FULL,
        )

    def _afd_context_stage(self, context: ForwardContext) -> int | None:
        # The capture hook or the micro-batch runner arms the contexts of capture forwards and stages (capture.py).
        return self.afd_capture_arm.stage_of(context)
