"""AFDConnector with micro-batch stages (docs/pingpong.md#6-wire-changes), in one process.

Sends are issued, never waited where they are issued: the attention waits a stage's pending send
in that stage's ``recv_f2a``, the FFN all of a step's in ``wait_sends``; the watchdog times those
waits; the FFN refuses a payload with more stages than the handshake agreed. The wire is the
in-memory ``QueueTransport`` of tests/connectors/_harness.py, whose handles record their waits.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.connectors._harness import (QueueTransport, free_port, init_all, make_connector, make_placement, make_spec,
                                       new_wire)

from vllm_afd.wire.errors import AFDProtocolError

BF16 = torch.bfloat16


class RecordingSend:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(f"wait {self.name}")


class RecordingTransport(QueueTransport):
    """``QueueTransport`` whose ``isend`` and ``recv`` calls, and handle waits, land in one log."""

    def __init__(self, wire, log: list[str]) -> None:
        super().__init__(wire)
        self.log = log
        self.issued = {"a2f": 0, "f2a": 0}

    def isend(self, channel, tensor, dst):
        self.send(channel, tensor, dst)
        name = f"{channel}#{self.issued[channel]}"
        self.issued[channel] += 1
        self.log.append(f"isend {name}")
        return RecordingSend(self.log, name)

    def recv(self, channel, tensor, src):
        self.log.append(f"recv {channel}")
        super().recv(channel, tensor, src)


@pytest.fixture
def pair():
    """A 1A1F deployment agreeing on 3 stages over a recording wire: (log, ffn, attention)."""
    port, wire, log = free_port(), new_wire(), []
    spec = make_spec(port, exchanges_per_stage=1, num_stages=3)
    ffn = make_connector(spec, make_placement("ffn", 0, 1, 1), transport=RecordingTransport(wire, log))
    attention = make_connector(spec, make_placement("attention", 0, 1, 1), transport=RecordingTransport(wire, log))
    init_all([ffn, attention])
    yield log, ffn, attention
    attention.close()
    ffn.close()


def test_attention_sends_of_all_stages_issue_before_any_wait_and_each_receive_waits_its_own(pair):
    log, ffn, attention = pair
    attention.publish({0: [1], 1: [2], 2: [1]})
    ffn.next_step()
    hidden = {stage: torch.full((rows, 64), float(stage), dtype=BF16) for stage, rows in ((0, 1), (1, 2), (2, 1))}
    log.clear()

    for stage in range(3):
        attention.send_a2f(stage, hidden[stage])
    assert log == ["isend a2f#0", "isend a2f#1", "isend a2f#2"]  # nothing waited: the peer may not have posted

    for stage in range(3):
        ffn.send_f2a(stage, ffn.recv_a2f(stage).hidden_states * 2)
    assert "wait f2a#0" not in log  # the FFN's sends wait until the end of its step
    ffn.wait_sends()
    assert log[-3:] == ["wait f2a#0", "wait f2a#1", "wait f2a#2"]

    log.clear()
    outs = [attention.recv_f2a(stage, hidden[stage]) for stage in range(3)]  # in (layer, stage) order
    # Each stage waits its own send, then receives its result into the tensor just sent.
    assert log == ["wait a2f#0", "recv f2a", "wait a2f#1", "recv f2a", "wait a2f#2", "recv f2a"]
    assert torch.equal(outs[1], torch.full((2, 64), 2.0, dtype=BF16)) and outs[1] is hidden[1]


def test_a_stage_sent_twice_waits_its_earlier_send_first(pair):
    log, ffn, attention = pair
    attention.publish({0: [1]})
    ffn.next_step()
    rows = torch.ones(1, 64, dtype=BF16)
    attention.send_a2f(0, rows)
    log.clear()

    attention.send_a2f(0, rows)

    assert log == ["wait a2f#0", "isend a2f#1"]


@pytest.mark.parametrize("agreed", [1, 2])
def test_the_ffn_refuses_a_payload_with_more_stages_than_the_handshake_agreed(agreed):
    port, wire = free_port(), new_wire()
    spec = make_spec(port, num_stages=agreed)
    ffn, attention = (make_connector(spec, make_placement(role, 0, 1, 1), transport=QueueTransport(wire))
                      for role in ("ffn", "attention"))
    init_all([ffn, attention])
    try:
        attention.publish({stage: [1] for stage in range(agreed + 1)})

        with pytest.raises(AFDProtocolError, match=f"has stages \\[0, .*{agreed}\\]; the handshake agreed on "
                                                   f"num_stages={agreed} .* Run the same vllm_afd version"):
            ffn.next_step()
        assert ffn.steps.payload is None  # nothing adopted
    finally:
        attention.close()
        ffn.close()


def test_a_pending_send_wait_is_timed_by_the_watchdog(pair):
    log, ffn, attention = pair
    attention.publish({0: [1]})
    ffn.next_step()
    seen = []

    class Probe:
        def wait(self) -> None:
            seen.append(attention._watchdog._transfer_what)

    attention.send_a2f(0, torch.ones(1, 64, dtype=BF16))
    attention._pending_a2f[0] = [Probe()]
    ffn.send_f2a(0, ffn.recv_a2f(0).hidden_states)

    attention.recv_f2a(0, torch.ones(1, 64, dtype=BF16))

    assert seen == ["a2f send to ffn rank 0"]
    assert attention._watchdog._transfer_since is None  # the bracket closed


def test_staged_sends_stamp_their_own_exchange_in_the_timeline():
    """A stage sends before the previous stage's exchange finished: its marks must still land in its own slot
    (they went to the finished-exchange count before, shifting every send by a stage and leaving the step's
    last send unstamped; seen as negative spans in the CPU stage benchmark)."""
    port, wire = free_port(), new_wire()
    spec = make_spec(port, exchanges_per_stage=2, num_stages=2, timeline_clock="host")
    ffn, attention = (make_connector(spec, make_placement(role, 0, 1, 1), transport=QueueTransport(wire))
                      for role in ("ffn", "attention"))
    init_all([ffn, attention])
    try:
        attention.publish({0: [1], 1: [2]})
        ffn.next_step()
        hidden = {stage: torch.ones(stage + 1, 64, dtype=BF16) for stage in range(2)}
        windows = {}

        def send(layer: int, stage: int) -> None:
            before = time.perf_counter_ns()
            attention.send_a2f(stage, hidden[stage])
            windows[(layer, stage)] = (before, time.perf_counter_ns())

        def ffn_layer() -> None:
            for stage in range(2):
                ffn.send_f2a(stage, ffn.recv_a2f(stage).hidden_states)

        send(0, 0), send(0, 1)  # E order, as the stage baton runs it
        ffn_layer()
        attention.recv_f2a(0, hidden[0]), send(1, 0)
        attention.recv_f2a(1, hidden[1]), send(1, 1)
        ffn_layer()
        attention.recv_f2a(0, hidden[0]), attention.recv_f2a(1, hidden[1])
        attention.timeline.close()  # seals the step
        [record] = attention.take_records()
    finally:
        attention.close()
        ffn.close()

    sends = {(m.exchange, m.stage): m.t_ns for m in record.marks if m.kind == "a2f_send_start"}
    assert set(sends) == set(windows)
    for key, (before, after) in windows.items():
        assert before <= sends[key] <= after, f"send {key} stamped outside its call"
