"""One FFN rank of tests/ffn/test_ffn_dp_expert_parallel.py, in a fresh process (vLLM's groups are per process).

    python -m tests.ffn._ep_rank MODE MODEL_DIR OUT_FILE PORT      (env RANK: this FFN DP rank)

MODE "ref": FFN DP 1, one FFN rank serving all 4 attention ranks.  MODE "dp" / "dp-ep": FFN DP 2 (external
launcher, gloo), 2 attention ranks per FFN rank, without / with --enable-expert-parallel.  The real
`AFDFFNModelRunner` (afd_harness.ffn_rank) loads the FFN half and runs `STEPS` on a thread as the FFN loop
does; its connector is a stand-in that hands every FFN rank its block's rows of the same seeded hidden states
(the rows attention rank j sends are the same in every mode) and keeps what the runner sends back:
{(step, layer, stage): [rows, hidden]}.
"""

from __future__ import annotations

import os
import sys
import threading

import torch

from afd_harness.ffn_rank import SeededRowsConnector, ffn_rank
from vllm_afd.wire.messages import ControlPayload

NUM_ATTENTION = 4
# Per step and stage, tokens per attention rank (FFN 0 serves attention 0-1, FFN 1 serves 2-3 at FFN DP 2).
STEPS = (
    {0: (1, 2, 3, 4), 1: (0, 0, 5, 0)},
    {0: (6, 0, 0, 1)},
    {0: (0, 0, 0, 0)},  # every attention rank idle: one dummy row each
)


class FeedingConnector(SeededRowsConnector):
    """Keeps every output: {(step, layer, stage): [rows, hidden] float32}."""

    def __init__(self, placement, hidden_size: int) -> None:
        super().__init__(placement, hidden_size)
        self.outputs: dict[tuple[int, int, int], torch.Tensor] = {}

    def keep(self, stage: int, output: torch.Tensor) -> None:
        self.outputs[(self.step, self.layer(), stage)] = output.detach().clone().float()


def main(mode: str, model_dir: str, out_file: str, port: int) -> None:
    dp = 1 if mode == "ref" else 2
    rank = int(os.environ.get("RANK", "0"))
    afd = {"num_attention_ranks": NUM_ATTENTION, "num_ffn_ranks": dp, "reform_timeout_s": 0}
    with ffn_rank(model_dir, afd, FeedingConnector, rank=rank, port=port,
                  expert_parallel=mode == "dp-ep") as (runner, feeder):
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
