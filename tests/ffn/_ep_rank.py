"""One FFN rank of tests/ffn/test_ffn_dp_expert_parallel.py, in a fresh process (vLLM's groups are per process).

    python -m tests.ffn._ep_rank MODE MODEL_DIR OUT_FILE PORT      (env RANK: this FFN DP rank)

MODE "ref": FFN DP 1, one FFN rank serving all 4 attention ranks.  MODE "dp" / "dp-ep": FFN DP 2 (external
launcher, gloo), 2 attention ranks per FFN rank, without / with --enable-expert-parallel.  The real
`AFDFFNModelRunner` loads the FFN half and runs `STEPS` on a thread as the FFN loop does; its connector is a
stand-in that hands every FFN rank its block's rows of the same seeded hidden states (the rows attention rank j
sends are the same in every mode) and keeps what the runner sends back: {(step, layer, stage): [rows, hidden]}.
"""

from __future__ import annotations

import os
import sys
import threading

import torch

from vllm_afd.wire.messages import A2FBatch, ControlPayload
from vllm_afd.wire.placement import Placement
from vllm_afd.wire.steps import StepState
from vllm_afd.wire.topology import rows

NUM_ATTENTION = 4
# Per step and stage, tokens per attention rank (FFN 0 serves attention 0-1, FFN 1 serves 2-3 at FFN DP 2).
STEPS = (
    {0: (1, 2, 3, 4), 1: (0, 0, 5, 0)},
    {0: (6, 0, 0, 1)},
    {0: (0, 0, 0, 0)},  # every attention rank idle: one dummy row each
)


class FeedingConnector:
    """Hands out this rank's rows of seeded hidden states per (step, layer, stage) and keeps the outputs."""

    def __init__(self, placement: Placement, hidden_size: int) -> None:
        self.placement = placement
        self.steps = StepState(placement, exchanges_per_stage=1, connector_name="FeedingConnector")
        self.hidden_size = hidden_size
        self.step = -1
        self.layer_calls = 0
        self.outputs: dict[tuple[int, int, int], torch.Tensor] = {}

    def adopt(self, payload: ControlPayload) -> None:
        self.steps.adopt(payload)
        self.step += 1
        self.layer_calls = 0

    def _layer(self) -> int:
        return self.layer_calls // len(self.steps.stages)

    def recv_a2f(self, stage: int, routing=None) -> A2FBatch:
        state = self.steps.stage(stage)
        per_rank = [rows(n) for n in state.counts]
        generator = torch.Generator().manual_seed(1000 * self.step + 10 * self._layer() + stage)
        every_row = torch.randn(sum(per_rank), self.hidden_size, generator=generator)
        peers = self.placement.attention_peers
        start = sum(per_rank[: peers.start])
        hidden = every_row[start : start + state.own_rows]
        return A2FBatch(hidden.to(torch.get_default_dtype()), None, state.peer_rows)

    def send_f2a(self, stage: int, output: torch.Tensor) -> None:
        self.outputs[(self.step, self._layer(), stage)] = output.detach().clone().float()
        self.layer_calls += 1

    def wait_sends(self) -> None:
        pass

    def take_records(self) -> list:
        return []

    def close(self) -> None:
        pass


def main(mode: str, model_dir: str, out_file: str, port: int) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_afd.config import parse_afd_config
    from vllm_afd.connect import build_placement
    from vllm_afd.ffn.runner import AFDFFNModelRunner
    from vllm_afd.workers.common import make_role_vllm_config

    # NOTE: as in an FFN worker process, whose module imports vLLM's CPUWorker: on 0.32 that import installs
    # vLLM's CPU shims for torch (vllm/v1/worker/cpu/shm.py), without which its model loader's
    # torch.accelerator.empty_cache() fails on a CPU-only torch.
    import vllm_afd.workers.cpu  # noqa: F401

    dp = 1 if mode == "ref" else 2
    rank = int(os.environ.get("RANK", "0"))
    afd = {"role": "ffn", "connector": "P2pGlooAFDConnector", "num_attention_ranks": NUM_ATTENTION,
           "num_ffn_ranks": dp, "reform_timeout_s": 0}
    engine_args = dict(model=model_dir, enforce_eager=True, skip_tokenizer_init=True, dtype="float32",
                       max_model_len=256, max_num_batched_tokens=256, additional_config={"afd": afd})
    if dp > 1:
        engine_args.update(data_parallel_size=dp, distributed_executor_backend="external_launcher",
                           enable_expert_parallel=mode == "dp-ep")
    config = EngineArgs(**engine_args).create_engine_config()
    afd_config = parse_afd_config(config)
    with set_current_vllm_config(config), set_default_torch_dtype(config.model_config.dtype):
        init_distributed_environment(world_size=dp, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=rank, backend="gloo")
        ensure_model_parallel_initialized(1, 1)
        placement = build_placement(config, afd_config)
        runner = AFDFFNModelRunner(make_role_vllm_config(config, afd_config), torch.device("cpu"), afd_config,
                                   placement)
        runner.connector.close()  # never initialised: the feeding stand-in replaces it
        runner.connector = feeder = FeedingConnector(placement, config.model_config.get_hidden_size())
        runner.load_model()

        errors: list[BaseException] = []

        def loop() -> None:  # as the FFN loop: every step on one daemon thread
            try:
                for counts in STEPS:
                    payload = ControlPayload(counts)
                    feeder.adopt(payload)
                    runner.run_step(payload)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
                errors.append(exc)

        thread = threading.Thread(target=loop, name="afd-ffn-loop", daemon=True)
        thread.start()
        thread.join(240)
        assert not thread.is_alive(), f"{mode} rank {rank}: the FFN steps did not finish within 240 s"
        if errors:
            raise errors[0]
        torch.save(feeder.outputs, out_file)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
