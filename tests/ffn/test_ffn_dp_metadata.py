"""The FFN runner's forward context at FFN DP > 1 (docs/ffn.md#per-step-compute): every (layer, stage) MoE call
sees the FFN-level `DPMetadata` of its stage; at FFN DP 1 none.  And the FFN worker's dummy batch is a no-op
(docs/ffn.md#threads-and-vllms-groups).

The runner is the real `AFDFFNModelRunner` on a real VllmConfig of a config-only tiny Qwen3-MoE (building it
communicates nothing); its model and connector, overlay attributes, are recording stand-ins: the connector
adopts payloads into a real `StepState`, the model records `get_forward_context()` per call.
"""

from __future__ import annotations

import contextlib

import pytest

pytest.importorskip("vllm")
from tests.connectors._vllm_configs import make_vllm_config

from vllm_afd.config import parse_afd_config
from vllm_afd.wire.messages import A2FBatch, ControlPayload
from vllm_afd.wire.placement import Placement
from vllm_afd.wire.steps import StepState

HIDDEN = 128  # TINY_QWEN3_MOE: 4 layers "DMMM", 8 experts
MOE_LAYERS = (1, 2, 3)


class RecordingConnector:
    """The FFN end's surface `_forward` uses; a real StepState sizes every receive."""

    def __init__(self, placement: Placement, log: list) -> None:
        self.steps = StepState(placement, exchanges_per_stage=4, connector_name="RecordingConnector")
        self.log = log

    def recv_a2f(self, stage, routing=None):
        import torch

        self.log.append(("recv", stage))
        state = self.steps.stage(stage)
        logits = None if routing is None else torch.zeros(state.own_rows, routing.width, dtype=routing.dtype)
        return A2FBatch(torch.zeros(state.own_rows, HIDDEN), logits, state.peer_rows)

    def send_f2a(self, stage, output) -> None:
        self.log.append(("send", stage, output.shape[0]))

    def wait_sends(self) -> None:
        self.log.append(("wait",))

    def take_records(self) -> list:
        return []

    def close(self) -> None:
        pass


class RecordingModel:
    """The FFN half's entry points: records what each call finds in the forward context, returns its rows."""

    def __init__(self, log: list) -> None:
        self.log = log

    def get_experts_layer_indices(self) -> tuple[int, ...]:
        return MOE_LAYERS

    def get_experts_routing_spec(self, layer_idx):
        import torch

        return 8, torch.float32

    def _record(self, hidden_states, layer_idx):
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
        meta = context.dp_metadata
        counts = None if meta is None else meta.num_tokens_across_dp_cpu.tolist()
        self.log.append(("moe", layer_idx, context.moe_layer_index, counts, meta))
        return hidden_states

    def compute_ffn_output(self, hidden_states, layer_idx):
        return self._record(hidden_states, layer_idx)

    def compute_experts_output(self, hidden_states, layer_idx, router_logits):
        return self._record(hidden_states, layer_idx)


@contextlib.contextmanager
def recording_runner(model_dir, *, num_attention: int, num_ffn: int, role_rank: int, gate_on_attention=False):
    """The real runner of FFN rank `role_rank` (FFN TP 1, so FFN DP = num_ffn), with recording model and connector;
    shut down on exit (its metrics watcher thread too)."""
    import torch

    from vllm_afd.ffn.runner import AFDFFNModelRunner
    from vllm_afd.workers.common import make_role_vllm_config

    vllm_config = make_vllm_config(
        model_dir, data_parallel=(num_ffn, role_rank), role="ffn", connector="P2pGlooAFDConnector",
        num_attention_ranks=num_attention, num_ffn_ranks=num_ffn, reform_timeout_s=0,
        compute_gate_on_attention=gate_on_attention)
    afd_config = parse_afd_config(vllm_config)
    placement = Placement("ffn", role_rank, num_attention, num_ffn, dp_size=num_ffn, tp_size=1)
    runner = AFDFFNModelRunner(make_role_vllm_config(vllm_config, afd_config), torch.device("cpu"), afd_config,
                               placement)
    runner.connector.close()  # the real end was never initialised; the recording one replaces it
    log: list = []
    runner.connector = RecordingConnector(placement, log)
    runner.model = RecordingModel(log)
    runner._moe_position = {layer: position for position, layer in enumerate(MOE_LAYERS)}
    try:
        yield runner, log
    finally:
        runner.shutdown()


def run(runner, payload: ControlPayload) -> None:
    runner.connector.steps.adopt(payload)  # as next_step does
    runner.run_step(payload)


def moe_calls(log: list) -> list[tuple]:
    return [entry[1:4] for entry in log if entry[0] == "moe"]


def test_every_moe_call_of_a_stage_sees_that_stages_ffn_dp_counts(model_dir):
    """4A2F, FFN rank 1 (FFN DP rank 1): attention ranks 2 and 3 are its peers."""
    with recording_runner(model_dir, num_attention=4, num_ffn=2, role_rank=1) as (runner, log):
        run(runner, ControlPayload({0: (1, 2, 3, 4), 1: (0, 0, 5, 0)}))

    assert moe_calls(log) == [
        (layer, position, counts)
        for layer, position in ((0, 0), (1, 0), (2, 1), (3, 2))  # the dense layer 0 is computed too
        for counts in ([3, 7], [2, 6])  # stage 0: rows 1+2 | 3+4; stage 1: 1+1 | 5+1 (idle ranks send 1 row)
    ]
    assert [entry for entry in log if entry[0] == "send"] == [("send", stage, rows) for _ in range(4)
                                                              for stage, rows in ((0, 7), (1, 6))]
    metas = [entry[4] for entry in log if entry[0] == "moe"]  # one DPMetadata per stage, built once per step
    assert all(meta is metas[0] for meta in metas[0::2]) and all(meta is metas[1] for meta in metas[1::2])


@pytest.mark.parametrize("role_rank, own_rows", [(0, 1), (1, 4)])
def test_an_idle_attention_rank_still_gives_its_ffn_dp_rank_one_row(model_dir, role_rank, own_rows):
    """2A2F, attention 0 idle: both FFN DP ranks run every MoE call, sized [1, 4]."""
    with recording_runner(model_dir, num_attention=2, num_ffn=2, role_rank=role_rank) as (runner, log):
        run(runner, ControlPayload({0: (0, 4)}))

    assert [call[2] for call in moe_calls(log)] == [[1, 4]] * 4
    assert {entry for entry in log if entry[0] == "send"} == {("send", 0, own_rows)}


def test_gate_on_attention_moe_calls_see_the_dp_counts_too(model_dir):
    with recording_runner(model_dir, num_attention=3, num_ffn=2, role_rank=0, gate_on_attention=True) as (runner, log):
        run(runner, ControlPayload({0: (2, 3, 4)}))

    assert moe_calls(log) == [(layer, position, [5, 4]) for position, layer in enumerate(MOE_LAYERS)]


def test_at_ffn_dp_1_no_moe_call_sees_dp_metadata(model_dir):
    with recording_runner(model_dir, num_attention=2, num_ffn=1, role_rank=0) as (runner, log):
        run(runner, ControlPayload({0: (3, 5), 1: (1, 1)}))

    assert moe_calls(log) == [(layer, position, None) for layer, position in ((0, 0), (1, 0), (2, 1), (3, 2))
                              for _ in range(2)]


def test_the_ffn_workers_dummy_batch_runs_nothing():
    """vLLM's DP engine core may call it in a wave; only the FFN loop thread may use the DP/EP groups."""
    from vllm.v1.worker.cpu_worker import CPUWorker

    from vllm_afd.ffn.worker import FFNWorkerMixin
    from vllm_afd.workers.cpu import AFDCPUFFNWorker

    class Worker(FFNWorkerMixin):
        """The mixin over a base of our own: no model runner, so any forward would raise."""

    assert Worker().execute_dummy_batch() is None
    assert AFDCPUFFNWorker.execute_dummy_batch is FFNWorkerMixin.execute_dummy_batch
    assert CPUWorker.execute_dummy_batch is not FFNWorkerMixin.execute_dummy_batch
