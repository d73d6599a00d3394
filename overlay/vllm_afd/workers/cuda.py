"""CUDA role workers: `Worker` subclasses for the attention (Model Runner V2) and FFN roles."""

from __future__ import annotations

from vllm.v1.worker.gpu_worker import Worker

from vllm_afd.ffn.worker import FFNWorkerMixin
from vllm_afd.releases import installed
from vllm_afd.workers.common import check_worker_start, make_role_runner


class AFDAttentionWorker(Worker):
    """Native GPU worker whose runner is the AFD subclass of Model Runner V2."""

    def init_device(self) -> None:
        self.afd_config = check_worker_start(self.vllm_config, type(self).__name__,
                                             "attention", "cuda")
        # NOTE: 0.34 removed Model Runner V1 and with it `use_v2_model_runner` (V2 is the only runner).
        if installed().has_model_runner_v1 and not self.use_v2_model_runner:
            raise ValueError(
                "AFD on CUDA requires Model Runner V2; unset VLLM_USE_V2_MODEL_RUNNER=0."
            )
        super().init_device()

    def _make_model_runner(self):
        from vllm_afd.attention.runner import AFDAttentionModelRunner

        return make_role_runner(AFDAttentionModelRunner, self.vllm_config, self.afd_config, self.device)

    def compile_or_warm_up_model(self):
        times = super().compile_or_warm_up_model()
        self.model_runner.afd_mark_startup_done()
        return times


class AFDFFNWorker(FFNWorkerMixin, Worker):
    """Native GPU worker turned into a connector-driven FFN loop host."""

    def init_device(self) -> None:
        self.afd_config = check_worker_start(self.vllm_config, type(self).__name__,
                                             "ffn", "cuda")
        super().init_device()

    def _make_model_runner(self):
        from vllm_afd.ffn.runner import AFDFFNModelRunner

        return make_role_runner(AFDFFNModelRunner, self.vllm_config, self.afd_config, self.device)
