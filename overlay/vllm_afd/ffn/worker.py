"""FFN worker overrides, shared by the CPU and CUDA FFN workers.

vLLM 0.30's engine already serves attention-free models: when every worker reports an
empty KV-cache spec it skips memory profiling and allocates no KV cache.  The FFN worker
reports exactly that, does no warm-up, and starts the FFN loop in
`compile_or_warm_up_model`, the last engine start-up call, so the engine reports ready
without waiting for the attention role.  The scheduler stays idle: the FFN's API server
vetoes generation requests (plugin.py).  After start-up only the FFN loop thread runs forwards, so
only it uses vLLM's DP/EP groups at FFN DP > 1 (docs/ffn.md#threads-and-vllms-groups).
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger
from vllm.v1.worker.worker_base import CompilationTimes

from vllm_afd.ffn.loop import FFNLoop
from vllm_afd.ffn.pool import make_pool

logger = init_logger(__name__)


class FFNWorkerMixin:
    """Mixed in before vLLM's `Worker`/`CPUWorker`; every override is a few lines."""

    _ffn_loop: FFNLoop | None = None

    def get_kv_cache_spec(self) -> dict[str, Any]:
        return {}

    def determine_available_memory(self) -> int:
        return 0

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        if kv_cache_config.kv_cache_groups:
            raise RuntimeError(
                "AFD FFN worker: the engine planned a KV cache "
                f"({len(kv_cache_config.kv_cache_groups)} groups); expected none because "
                "FFN workers report an empty KV-cache spec."
            )

    def compile_or_warm_up_model(self) -> CompilationTimes:
        self.start_ffn_loop()
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def execute_model(self, scheduler_output: Any) -> None:
        raise RuntimeError(
            "AFD FFN workers are connector-driven; scheduler-driven execute_model() is "
            "not supported."
        )

    def sample_tokens(self, grammar_output: Any) -> None:
        raise RuntimeError("FFN runners do not sample tokens")

    def execute_dummy_batch(self) -> None:
        # NOTE: a no-op on purpose.  At DP > 1 vLLM's DP engine core calls this on an idle rank while a DP
        # "wave" runs (a stray START_DP_WAVE, a dev /pause); its own wave all-reduce is on the engine core's
        # separate group and completes without it.  The FFN's MoE collectives run only on the FFN loop
        # thread, driven by attention payloads (every FFN DP rank gets every step, >= 1 row each); a forward
        # from this (main) thread would issue collectives on the same DP/EP group as the loop thread.
        return None

    def start_ffn_loop(self) -> None:
        """Start the FFN loop once; a live loop only re-raises a stored error."""
        if self._ffn_loop is None:
            runner = self.model_runner
            pool = make_pool(runner.vllm_config.parallel_config, runner.reform_timeout_s,
                             runner.connector.placement.label)
            self._ffn_loop = FFNLoop(runner, pool=pool)
            self._ffn_loop.start()
        self._ffn_loop.raise_if_failed()

    def stop_ffn_loop(self) -> None:
        loop, self._ffn_loop = self._ffn_loop, None
        if loop is not None:
            loop.stop()

    def check_health(self) -> None:
        if self._ffn_loop is not None:
            self._ffn_loop.raise_if_failed()

    def shutdown(self) -> None:
        try:
            self.stop_ffn_loop()
        finally:
            super().shutdown()
