"""One FFN DP rank of tests/ffn/test_ffn_pool_reform.py, in a fresh process (vLLM's groups are per process).

    python -m tests.ffn._pool_rank MODEL_DIR OUT_FILE PORT      (env RANK: this FFN DP rank)

FFN DP 2 with expert parallelism (external launcher, gloo), 2A2F: the real `AFDFFNModelRunner` on the tiny
Qwen3-MoE under the real `FFNLoop` and its `DPPool` (reform_timeout_s 60).  Only the connector is a stand-in
(`ScriptedConnector`): it serves each rank a script of payloads and losses, feeds rows that depend only on
(layer, stage), so steps of equal counts compute equal outputs, keeps the outputs by step and counts the
re-formations.  The scripts put both failure shapes of decision 48 in one run:

* step 1: rank 0 loses its attention at layer 1, mid-step, while rank 1's step goes on (the drain);
* step 3: rank 0 loses its attention before the payload, while rank 1 has step 3's (the start agreement).
"""

from __future__ import annotations

import os
import sys
import types

import torch

from afd_harness.ffn_rank import ffn_rank
from tests.ffn._ep_rank import FeedingConnector
from vllm_afd.wire.errors import AFDPeerLostError
from vllm_afd.wire.messages import A2FBatch, ControlPayload

COUNTS = {0: (2, 3)}  # every step: attention 0 sends 2 rows (to FFN 0), attention 1 sends 3 (to FFN 1)
LOST = "lost before the payload"
SCRIPTS = {  # per FFN DP rank: step ids, LOST, or (step id, the layer whose receive fails)
    0: [0, (1, 1), 2, LOST, 4],
    1: [0, 1, 2, 3, 4],
}


class ScriptedConnector(FeedingConnector):
    """The stand-in connector the loop and the runner talk to; see the module docstring."""

    def __init__(self, placement, hidden_size: int, script: list) -> None:
        super().__init__(placement, hidden_size)
        self.script = list(script)
        self.spec = types.SimpleNamespace(hidden_size=hidden_size, dtype=torch.get_default_dtype(),
                                          device=torch.device("cpu"))
        self.is_initialized, self.can_reform = True, True
        self.fail_at_layer: int | None = None
        self.reformations = 0
        self.events: list[str] = []

    def init(self) -> None:
        self.events.append("init")

    def check_failed(self) -> None:
        pass

    def next_step(self) -> ControlPayload:
        if not self.script:
            self.is_initialized = False  # the runner's next_step returns None: the loop ends
            return None
        entry = self.script.pop(0)
        if entry == LOST:
            self.events.append("lost before a payload")
            raise AFDPeerLostError("AFD peer lost: control receive from attention rank 0 failed (scripted)")
        step, self.fail_at_layer = entry if isinstance(entry, tuple) else (entry, None)
        payload = ControlPayload(COUNTS)
        self.adopt(payload)
        self.step = step
        self.events.append(f"step {step}")
        return payload

    def recv_a2f(self, stage: int, routing=None) -> A2FBatch:
        if self.layer() == self.fail_at_layer:
            self.events.append(f"lost at layer {self.fail_at_layer}")
            raise AFDPeerLostError("AFD peer lost: a2f receive from attention rank 0 failed (scripted)")
        step, self.step = self.step, 0  # the rows depend on (layer, stage) only
        try:
            return super().recv_a2f(stage, routing)
        finally:
            self.step = step

    def reform(self, timeout_s: float) -> None:
        self.reformations += 1
        self.events.append("re-formed")


def main(model_dir: str, out_file: str, port: int) -> None:
    from vllm_afd.ffn.loop import FFNLoop
    from vllm_afd.ffn.pool import DPPool, make_pool

    rank = int(os.environ["RANK"])
    afd = {"num_attention_ranks": 2, "num_ffn_ranks": 2, "reform_timeout_s": 60}

    def scripted_connector(placement, hidden_size: int) -> ScriptedConnector:
        return ScriptedConnector(placement, hidden_size, SCRIPTS[rank])

    with ffn_rank(model_dir, afd, scripted_connector, rank=rank, port=port, expert_parallel=True) as (
            runner, scripted):
        pool = make_pool(runner.vllm_config.parallel_config, runner.reform_timeout_s, scripted.placement.label)
        assert isinstance(pool, DPPool) and runner.drains_failed_steps

        loop = FFNLoop(runner, terminate_on_error=False, pool=pool)
        loop.start()
        loop._thread.join(float(os.environ.get("AFD_POOL_JOIN_S", "240")))
        assert not loop._thread.is_alive(), f"rank {rank}: the FFN loop is stuck after {scripted.events}"
        loop.raise_if_failed()
        torch.save({"outputs": scripted.outputs, "events": scripted.events, "num_steps": loop.num_steps,
                    "num_reformations": loop.num_reformations}, out_file)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
