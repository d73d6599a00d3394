"""Probe CPU worker (V1 CPU runner): counts `_make_model_runner` calls, then `super()`.

On the V1 runner it builds `ProbeCPUModelRunner`, which records every question of the DP-1
micro-batch hook (`should_ubatch_without_dp`) and answers what vLLM's default answers.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from afd_hook_probe import record
from afd_hook_probe.workers import ProbeWorkerMixin


class ProbeCPUModelRunner(CPUModelRunner):
    def should_ubatch_without_dp(self, num_tokens: int, uniform_decode: bool, allow_microbatching: bool) -> bool:
        answer = super().should_ubatch_without_dp(num_tokens, uniform_decode, allow_microbatching)
        record("should_ubatch_without_dp", num_tokens=num_tokens, uniform_decode=uniform_decode,
               allow_microbatching=allow_microbatching, answer=answer)
        return answer


class ProbeCPUWorker(ProbeWorkerMixin, CPUWorker):
    def _make_model_runner(self) -> Any:
        if self.use_v2_model_runner:
            runner = super()._make_model_runner()
        else:  # as vLLM's V1 branch builds it
            runner = ProbeCPUModelRunner(self.vllm_config, torch.device("cpu"))
        record("make_model_runner", worker=type(self).__name__, runner=type(runner).__name__)
        return runner
