"""attention/step_gate.py: the attention ranks of one server raise a connector failure together, at a step's
edges, or not at all (docs/failures.md#22-the-attention-tp-2-stall).

Two processes join a real gloo group, as vLLM's tensor-parallel CPU group is; their connectors are recording
fakes whose failure the test sets per step.
"""

from __future__ import annotations

import datetime
import multiprocessing
import socket

import pytest

from vllm_afd.attention.step_gate import LocalStepGate, TensorParallelStepGate, make_step_gate
from vllm_afd.wire.errors import AFDPeerLostError


class GateConnector:
    """The connector surface a gate uses: its failure, recording one, raising it."""

    def __init__(self, rank: int) -> None:
        self.placement = type("Placement", (), {"label": f"attention rank {rank}"})()
        self.failure: BaseException | None = None

    def fail(self, exc: BaseException) -> BaseException:
        if self.failure is None:
            self.failure = exc
        return self.failure

    def check_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    def take_step_failure(self) -> BaseException | None:
        return self.failure


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tp_rank(rank: int, port: int, failing: list[int | None], results) -> None:
    """Run one gate check per step; ``failing[i]`` is the rank whose connector fails before step i."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    connector = GateConnector(rank)
    gate = TensorParallelStepGate(connector, dist.group.WORLD)
    outcomes = []
    for failing_rank in failing:
        if failing_rank == rank:
            connector.fail(AFDPeerLostError(f"AFD peer lost: ffn rank 0 silent for 5.0s (seen by rank {rank})"))
        try:
            gate.check()
            outcomes.append("ran")
        except AFDPeerLostError as exc:
            outcomes.append(str(exc))
    results.put((rank, outcomes))
    dist.destroy_process_group()


def test_one_ranks_failure_is_raised_on_every_tensor_parallel_rank_and_none_raises_without_one():
    """Regression: one TP rank refused a step alone (its watchdog had fired) and the other waited in the step's
    first all-reduce for good: the attention server hung with no error (the TP 2 stall)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    failing = [None, None, 1]  # two healthy steps, then rank 1's connector fails
    ranks = [context.Process(target=_tp_rank, args=(rank, port, failing, results)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    outcomes = dict(results.get(timeout=60) for _ in ranks)
    for process in ranks:
        process.join(30)

    assert outcomes[0][:2] == outcomes[1][:2] == ["ran", "ran"]
    assert outcomes[1][2] == "AFD peer lost: ffn rank 0 silent for 5.0s (seen by rank 1)"
    assert outcomes[0][2].startswith("AFD peer lost: another tensor-parallel rank of this attention server lost "
                                     "its FFN peer")
    assert "attention rank 0 leaves the step with it" in outcomes[0][2]


def test_a_single_rank_gate_raises_its_own_failure_and_nothing_else():
    connector = GateConnector(0)
    gate = make_step_gate(connector, 1, cpu_group=None)

    gate.check()
    connector.fail(AFDPeerLostError("gone"))

    assert isinstance(gate, LocalStepGate)
    with pytest.raises(AFDPeerLostError, match="gone"):
        gate.check()
