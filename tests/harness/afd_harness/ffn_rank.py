"""One FFN rank in this process: the real `AFDFFNModelRunner` on a model's FFN half, fed by a stand-in connector.

For the FFN-pool tests (tests/ffn/_ep_rank.py, tests/ffn/_pool_rank.py) and the FFN-pool benchmark
(scripts/bench_ffn_ep_cpu.py): each starts one process per FFN DP rank (vLLM's groups are per process),
builds the rank with `ffn_rank` and drives `runner.run_step` (or the FFN loop) itself.  Only the connector is
a stand-in: `SeededRowsConnector` hands the rank its block of seeded hidden states per (step, layer, stage).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


class SeededRowsConnector:
    """Hands out this rank's rows of seeded hidden states per (step, layer, stage); `keep` sees each output.

    The rows attention rank j sends depend only on (step, layer, stage), so every FFN layout of the same
    attention ranks computes the same rows.
    """

    def __init__(self, placement: Any, hidden_size: int) -> None:
        from vllm_afd.wire.steps import StepState

        self.placement = placement
        self.steps = StepState(placement, exchanges_per_stage=1, connector_name=type(self).__name__)
        self.hidden_size = hidden_size
        self.step = -1
        self.layer_calls = 0  # sends this step: layer × stages

    def adopt(self, payload: Any) -> None:
        self.steps.adopt(payload)
        self.step += 1
        self.layer_calls = 0

    def layer(self) -> int:
        return self.layer_calls // len(self.steps.stages)

    def recv_a2f(self, stage: int, routing: Any = None) -> Any:
        from vllm_afd.wire.messages import A2FBatch
        from vllm_afd.wire.topology import rows

        state = self.steps.stage(stage)
        per_rank = [rows(n) for n in state.counts]
        generator = torch.Generator().manual_seed(1000 * self.step + 10 * self.layer() + stage)
        every_row = torch.randn(sum(per_rank), self.hidden_size, generator=generator)  # [rows of A, hidden]
        start = sum(per_rank[: self.placement.attention_peers.start])
        hidden = every_row[start : start + state.own_rows]  # [own rows, hidden]
        return A2FBatch(hidden.to(torch.get_default_dtype()), None, state.peer_rows)

    def send_f2a(self, stage: int, output: torch.Tensor) -> None:
        self.keep(stage, output)
        self.layer_calls += 1

    def keep(self, stage: int, output: torch.Tensor) -> None:
        """What a subclass does with one (layer, stage) output [own rows, hidden]; nothing here."""

    def wait_sends(self) -> None:
        pass

    def take_records(self) -> list:
        return []

    def close(self) -> None:
        pass


@contextlib.contextmanager
def ffn_rank(
    model_dir: str,
    afd: dict[str, Any],
    connector: Callable[[Any, int], SeededRowsConnector],
    *,
    rank: int = 0,
    port: int,
    expert_parallel: bool = False,
    max_model_len: int = 256,
    load_format: str = "auto",
) -> Iterator[tuple[Any, SeededRowsConnector]]:
    """Yield (runner, stand-in) for FFN DP rank `rank` of `afd["num_ffn_ranks"]`, inside its vLLM config.

    FFN DP > 1 uses vLLM's external launcher over gloo on 127.0.0.1:`port` (every rank the same port);
    float32, eager.  `connector(placement, hidden_size)` makes the stand-in that replaces the runner's own.
    """
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.torch_utils import set_default_torch_dtype

    # NOTE: as in an FFN worker process, whose module imports vLLM's CPUWorker: on 0.32 that import installs
    # vLLM's CPU shims for torch (vllm/v1/worker/cpu/shm.py), without which its model loader's
    # torch.accelerator.empty_cache() fails on a CPU-only torch.
    import vllm_afd.workers.cpu  # noqa: F401
    from vllm_afd.config import parse_afd_config
    from vllm_afd.connect import build_placement
    from vllm_afd.ffn.runner import AFDFFNModelRunner
    from vllm_afd.workers.common import make_role_vllm_config

    dp = afd.get("num_ffn_ranks", 1)
    engine_args: dict[str, Any] = dict(
        model=model_dir, enforce_eager=True, skip_tokenizer_init=True, dtype="float32",
        max_model_len=max_model_len, max_num_batched_tokens=max_model_len, load_format=load_format,
        additional_config={"afd": {"role": "ffn", "connector": "P2pGlooAFDConnector", **afd}})
    if dp > 1:
        engine_args.update(data_parallel_size=dp, distributed_executor_backend="external_launcher",
                           enable_expert_parallel=expert_parallel)
    config = EngineArgs(**engine_args).create_engine_config()
    afd_config = parse_afd_config(config)
    with set_current_vllm_config(config), set_default_torch_dtype(config.model_config.dtype):
        init_distributed_environment(world_size=dp, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        ensure_model_parallel_initialized(1, 1)
        placement = build_placement(config, afd_config)
        runner = AFDFFNModelRunner(make_role_vllm_config(config, afd_config), torch.device("cpu"), afd_config,
                                   placement)
        runner.connector.close()  # never initialised: the stand-in replaces it
        runner.connector = stand_in = connector(placement, config.model_config.get_hidden_size())
        runner.load_model()
        yield runner, stand_in
