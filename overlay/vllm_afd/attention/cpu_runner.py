"""The attention runner on CPU: vLLM's V1 CPU runner plus the AFD mixin.

CPU vLLM runs the V1 runner (Model Runner V2 needs Triton's CPU backend).  V1 needs no
per-step hook: its forward contexts carry no batch descriptor and its dummy runs call
the model directly, so the control payload is published lazily by the first AFD op of
each forward context (docs/attention.md#publish-rule), which sees every model forward.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from vllm_afd.attention.mixin import AFDAttentionRunnerMixin


class AFDCPUAttentionModelRunner(AFDAttentionRunnerMixin, CPUModelRunner):
    """V1 CPU runner whose model is the attention half; all AFD logic is in the mixin."""
