"""The FFN pool's parts with fakes (docs/ffn.md#re-forming-a-pool): the drain, and the loop's two agreements.

Two real processes over gloo are in test_ffn_pool_reform.py; here a recording connector and a recording pool.
"""

from __future__ import annotations

import queue
import threading
import types

import pytest

pytest.importorskip("vllm")
import torch  # noqa: E402

from vllm_afd.ffn.loop import FFNLoop  # noqa: E402
from vllm_afd.ffn.pool import LOCAL_POOL, DrainingExchanges, reforms_as_pool  # noqa: E402
from vllm_afd.wire.errors import AFDPeerLostError, AFDProtocolError  # noqa: E402
from vllm_afd.wire.messages import A2FBatch, RoutingSpec  # noqa: E402


class RecordingConnector:
    """Receives rows of ones until ``fail_at`` receives have run, then raises; records every call."""

    def __init__(self, fail_at: int | None, error: BaseException | None = None) -> None:
        self.calls: list[str] = []
        self.fail_at = fail_at
        self.error = error or AFDPeerLostError("AFD peer lost: a2f receive from attention rank 0 failed")
        self.spec = types.SimpleNamespace(hidden_size=4, dtype=torch.float32, device=torch.device("cpu"))
        self.placement = types.SimpleNamespace(label="ffn rank 0")
        stage = types.SimpleNamespace(own_rows=3, peer_rows=(1, 2))
        self.steps = types.SimpleNamespace(stage=lambda index: stage)

    def recv_a2f(self, stage: int, routing=None) -> A2FBatch:
        self.calls.append("recv")
        if self.fail_at is not None and self.calls.count("recv") > self.fail_at:
            raise self.error
        return A2FBatch(torch.ones(3, 4), None, (1, 2))

    def send_f2a(self, stage: int, output: torch.Tensor) -> None:
        self.calls.append("send")

    def wait_sends(self) -> None:
        self.calls.append("wait")


def run_layers(exchanges, num_layers: int, routing=None) -> list[A2FBatch]:
    batches = []
    for _ in range(num_layers):
        batch = exchanges.recv_a2f(0, routing)
        batches.append(batch)
        exchanges.send_f2a(0, batch.hidden_states)
    exchanges.wait_sends()
    return batches


def test_a_failed_receive_finishes_the_step_on_zero_rows_and_raises_at_its_end():
    connector = RecordingConnector(fail_at=1)
    exchanges = DrainingExchanges(connector)

    with pytest.raises(AFDPeerLostError) as info:
        run_layers(exchanges, num_layers=3)

    assert info.value is connector.error
    assert connector.calls == ["recv", "send", "recv"]  # nothing reaches the connector after the loss


def test_the_zero_rows_have_the_steps_counts_and_the_routing_width():
    connector = RecordingConnector(fail_at=0)
    exchanges = DrainingExchanges(connector)
    routing = RoutingSpec(8, torch.float32)

    batch = exchanges.recv_a2f(0, routing)

    assert batch.hidden_states.shape == (3, 4) and not batch.hidden_states.any()
    assert batch.router_logits.shape == (3, 8) and batch.router_logits.dtype == torch.float32
    assert batch.peer_rows == (1, 2)


def test_a_step_without_a_loss_passes_through():
    connector = RecordingConnector(fail_at=None)

    batches = run_layers(DrainingExchanges(connector), num_layers=2)

    assert connector.calls == ["recv", "send", "recv", "send", "wait"]
    assert all(batch.hidden_states.all() for batch in batches)


def test_an_error_that_is_not_a_loss_is_not_drained():
    connector = RecordingConnector(fail_at=0, error=AFDProtocolError("bad rows"))

    with pytest.raises(AFDProtocolError):
        DrainingExchanges(connector).recv_a2f(0)


@pytest.mark.parametrize("dp, reform_timeout_s, pooled", [(1, 600.0, False), (2, 0.0, False), (2, 600.0, True)])
def test_only_ffn_dp_with_re_forming_is_a_pool(dp, reform_timeout_s, pooled):
    assert reforms_as_pool(dp, reform_timeout_s) is pooled


class ScriptedRunner:
    """Payloads (or losses) from a queue; records steps and re-formations."""

    def __init__(self) -> None:
        self.payloads: queue.Queue = queue.Queue()
        self.steps: list[object] = []
        self.reformed: list[str] = []

    def init_connector(self) -> None:
        pass

    def next_step(self) -> object:
        item = self.payloads.get(timeout=10)
        if isinstance(item, BaseException):
            raise item
        return item

    def run_step(self, payload: object) -> None:
        self.steps.append(payload)

    def reform(self, cause: BaseException) -> None:
        self.reformed.append(str(cause))

    def close_connector(self) -> None:
        pass

    def shutdown(self) -> None:
        self.payloads.put(None)


class RecordingPool:
    """Records each agreement; a peer's loss is scripted by the step it comes at."""

    def __init__(self, peer_lost_at: dict[tuple[object, str], str]) -> None:
        self.peer_lost_at = peer_lost_at
        self.agreements: list[tuple[str, bool]] = []
        self.current: object = None

    def agree(self, lost, where):
        self.agreements.append((where, lost is None))
        peer = self.peer_lost_at.get((len(self.agreements), where))
        return lost if lost is not None else (AFDPeerLostError(peer) if peer else None)


def run_loop(pool, items: list) -> ScriptedRunner:
    runner = ScriptedRunner()
    loop = FFNLoop(runner, terminate_on_error=False, pool=pool)
    for item in items:
        runner.payloads.put(item)
    runner.payloads.put(None)  # the connector closes: the loop ends
    loop.start()
    loop._thread.join(10)
    assert loop.error is None
    return runner


def test_every_step_is_agreed_at_its_start_and_end():
    pool = RecordingPool({})

    runner = run_loop(pool, ["p0", "p1"])

    assert runner.steps == ["p0", "p1"] and runner.reformed == []
    assert pool.agreements == [("step start", True), ("step end", True)] * 2


def test_a_loss_before_the_payload_skips_the_step_through_the_start_agreement_and_re_forms():
    pool = RecordingPool({})

    runner = run_loop(pool, [AFDPeerLostError("AFD peer lost: control"), "p1"])

    assert pool.agreements[0] == ("step start", False)
    assert runner.steps == ["p1"] and runner.reformed == ["AFD peer lost: control"]


def test_a_peer_ranks_loss_at_the_step_end_re_forms_this_rank_too():
    pool = RecordingPool({(2, "step end"): "another FFN DP rank lost its attention peers"})

    runner = run_loop(pool, ["p0", "p1"])

    assert runner.steps == ["p0", "p1"]
    assert runner.reformed == ["another FFN DP rank lost its attention peers"]


def test_a_peer_ranks_loss_at_the_start_skips_this_ranks_payload():
    pool = RecordingPool({(1, "step start"): "another FFN DP rank lost its attention peers"})

    runner = run_loop(pool, ["p0", "p1"])

    assert runner.steps == ["p1"] and len(runner.reformed) == 1


def test_the_local_pool_returns_the_ranks_own_verdict():
    lost = AFDPeerLostError("x")

    assert LOCAL_POOL.agree(lost, "step end") is lost and LOCAL_POOL.agree(None, "step start") is None


def test_the_loop_stops_without_an_agreement_once_stopped():
    pool = RecordingPool({})
    runner = ScriptedRunner()
    loop = FFNLoop(runner, terminate_on_error=False, pool=pool)

    loop.start()
    threading.Event().wait(0.1)
    loop.stop()

    assert pool.agreements == [] and loop.error is None
