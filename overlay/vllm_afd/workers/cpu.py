"""CPU role workers: `CPUWorker` subclasses for the attention and FFN roles."""

from __future__ import annotations

import torch
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_afd.ffn.worker import FFNWorkerMixin
from vllm_afd.workers.common import check_worker_start, make_role_runner


class AFDCPUAttentionWorker(CPUWorker):
    """Native CPU worker whose runner is the AFD attention runner (V1 runner on CPU)."""

    def init_device(self) -> None:
        self.afd_config = check_worker_start(self.vllm_config, type(self).__name__,
                                             "attention", "cpu")
        super().init_device()

    def _make_model_runner(self):
        from vllm_afd.attention.cpu_runner import AFDCPUAttentionModelRunner

        return make_role_runner(AFDCPUAttentionModelRunner, self.vllm_config, self.afd_config, torch.device("cpu"))

    def compile_or_warm_up_model(self):
        times = super().compile_or_warm_up_model()
        self.model_runner.afd_mark_startup_done()
        return times


class AFDCPUFFNWorker(FFNWorkerMixin, CPUWorker):
    """Native CPU worker turned into a connector-driven FFN loop host."""

    def init_device(self) -> None:
        self.afd_config = check_worker_start(self.vllm_config, type(self).__name__,
                                             "ffn", "cpu")
        super().init_device()

    def _make_model_runner(self):
        from vllm_afd.ffn.runner import AFDFFNModelRunner

        return make_role_runner(AFDFFNModelRunner, self.vllm_config, self.afd_config, torch.device("cpu"))
