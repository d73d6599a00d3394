"""The attention <-> FFN exchange sequence as a Hypothesis state machine (docs/protocol.md#one-exchange).

2A1F over an in-memory transport (tests/connectors/_harness.py: a FIFO per channel and rank pair,
every send a clone), driven from one thread: payloads carry increasing step ids, only attention
rank 0 (< F) transmits the payload, every send meets exactly one receive in order, rows are
checked before anything reaches the wire, a step closes after its last exchange, and shutdown is
idempotent. The real transports are covered by tests/connectors.
"""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.connectors._harness import (
    QueueTransport,
    free_port,
    make_connector,
    make_placement,
    make_spec,
    new_wire,
    pending,
)

from vllm_afd.wire.attention_end import AttentionConnector
from vllm_afd.wire.connector import AFDConnector
from vllm_afd.wire.ffn_end import FFNConnector
from vllm_afd.wire.placement import A2F, F2A

NUM_LAYERS = 2
HIDDEN = 64


def hidden_for(rank: int, step: int, layer: int, num_rows: int) -> torch.Tensor:
    base = torch.arange(num_rows * HIDDEN, dtype=torch.float32)
    return (base + 100 * rank + 10 * step + layer).reshape(num_rows, HIDDEN)


class ExchangeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        port, self.wire = free_port(), new_wire()
        self.ffn = self._connector("ffn", 0, port)
        self.attention = [self._connector("attention", j, port) for j in range(2)]
        threads = [threading.Thread(target=c.init) for c in self.everyone]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20.0)
        assert all(c.is_initialized for c in self.everyone)
        self.step, self.counts, self.layer = -1, None, 0
        self.sent: set[int] = set()
        self.received: set[int] = set()
        self.served = False
        self.closed = False

    def _connector(self, role: str, rank: int, port: int) -> AttentionConnector | FFNConnector:
        spec = make_spec(port, dtype=torch.float32, exchanges_per_stage=NUM_LAYERS)
        return make_connector(spec, make_placement(role, rank, 2, 1), transport=QueueTransport(self.wire))

    @property
    def everyone(self) -> list[AFDConnector]:
        return [self.ffn, *self.attention]

    def rows(self, rank: int) -> int:
        return max(1, self.counts[rank])

    # ---- rules ------------------------------------------------------------------------------------

    @precondition(lambda self: not self.closed and self.counts is None)
    @rule(counts=st.lists(st.integers(0, 4), min_size=2, max_size=2), profile=st.booleans())
    def publish(self, counts, profile):
        published = [connector.publish({0: counts}, is_profile=profile) for connector in self.attention]
        payload = self.ffn.next_step()

        assert payload.step_seq == self.step + 1  # ids increase by one per step
        assert payload.counts == {0: tuple(counts)}
        assert payload.is_profile is profile
        assert published == [payload, payload]  # rank 1 adopts the payload rank 0 transmitted
        self.step, self.counts, self.layer = self.step + 1, counts, 0
        self.sent, self.received, self.served = set(), set(), False

    @precondition(lambda self: not self.closed and self.counts is not None)
    @rule(rank=st.integers(0, 1))
    def attention_sends(self, rank):
        if rank in self.sent:
            return  # one send per rank per exchange
        self.attention[rank].send_a2f(0, hidden_for(rank, self.step, self.layer, self.rows(rank)))
        self.sent.add(rank)

    @precondition(lambda self: not self.closed and self.counts is not None)
    @rule(rank=st.integers(0, 1), extra=st.integers(1, 3))
    def wrong_rows_never_reach_the_wire(self, rank, extra):
        before = pending(self.wire)
        num_rows = self.rows(rank) + extra

        with pytest.raises(ValueError, match=f"sends {num_rows} rows in stage 0 but published {self.rows(rank)}"):
            self.attention[rank].send_a2f(0, hidden_for(rank, self.step, self.layer, num_rows))

        assert pending(self.wire) == before

    @precondition(lambda self: not self.closed and self.sent == {0, 1} and not self.served)
    @rule()
    def ffn_serves(self):
        batch = self.ffn.recv_a2f(0)

        expected = [hidden_for(j, self.step, self.layer, self.rows(j)) for j in (0, 1)]
        assert torch.equal(batch.hidden_states, torch.cat(expected))  # peers in ascending order
        assert tuple(batch.peer_rows) == (self.rows(0), self.rows(1))
        assert batch.router_logits is None
        self.ffn.send_f2a(0, batch.hidden_states * 2 + self.layer)
        self.served = True

    @precondition(lambda self: not self.closed and self.served)
    @rule(rank=st.integers(0, 1))
    def attention_receives(self, rank):
        if rank in self.received:
            return
        out = torch.empty(self.rows(rank), HIDDEN)

        result = self.attention[rank].recv_f2a(0, out)

        assert result is out
        assert torch.equal(result, hidden_for(rank, self.step, self.layer, self.rows(rank)) * 2 + self.layer)
        self.received.add(rank)
        if self.received == {0, 1}:
            self.layer += 1
            self.sent, self.received, self.served = set(), set(), False
            if self.layer == NUM_LAYERS:
                self.counts = None

    @precondition(lambda self: not self.closed)
    @rule()
    def shutdown(self):
        for connector in self.everyone:
            connector.close()
            connector.close()
        self.closed = True

        assert not any(c.is_initialized for c in self.everyone)
        assert all(c.transport.closed == 1 for c in self.everyone)
        with pytest.raises(RuntimeError, match="the AFD connector is closed"):
            self.attention[0].publish({0: [1, 1]})

    @precondition(lambda self: self.closed)
    @rule()
    def calls_after_shutdown_raise(self):
        for connector in self.everyone:
            connector.close()
        for attention in self.attention:
            with pytest.raises(RuntimeError, match="the AFD connector is closed"):
                attention.recv_f2a(0, torch.zeros(1, HIDDEN))
        with pytest.raises(RuntimeError, match="the AFD connector is closed"):
            self.ffn.recv_a2f(0)
        with pytest.raises(RuntimeError, match="the AFD connector is closed"):
            self.ffn.next_step()

    # ---- invariants -------------------------------------------------------------------------------

    @invariant()
    def the_wire_holds_exactly_the_unmatched_sends(self):
        if self.closed:
            return
        expected = {}
        for j in (0, 1):
            if j in self.sent and not self.served:
                expected[(A2F, 1 + j, 0)] = 1
            if self.served and j not in self.received:
                expected[(F2A, 0, 1 + j)] = 1
        assert pending(self.wire) == expected

    @invariant()
    def steps_are_open_exactly_while_exchanges_are_owed(self):
        if self.closed:
            return
        done_0 = self.layer == NUM_LAYERS - 1 and 0 in self.received
        done_ffn = self.layer == NUM_LAYERS - 1 and self.served
        assert (self.attention[0]._watchdog._step is not None) == (self.counts is not None and not done_0)
        assert (self.ffn._watchdog._step is not None) == (self.counts is not None and not done_ffn)

    def teardown(self):
        for connector in self.everyone:
            connector.close()


ExchangeMachine.TestCase.settings = settings(
    max_examples=12, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_exchange_sequence = ExchangeMachine.TestCase
