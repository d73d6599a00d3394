"""The attention <-> FFN exchange sequence as a Hypothesis state machine (STYLE.md §2.5 item 25).

2A1F over an in-memory transport (queues per channel and rank pair; every send is a clone), driven
from one thread: payloads carry increasing step ids, every send meets exactly one receive in order,
rows are checked before anything reaches the wire, step tracking closes after the last exchange, and
shutdown is idempotent. The real transports are covered by tests/connectors.
"""

from __future__ import annotations

import sys
import threading
from collections import defaultdict, deque
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

sys.path.insert(0, str(Path(__file__).parents[1] / "connectors"))
from _harness import free_port, make_fingerprint, make_settings  # noqa: E402

from vllm_afd.connectors.channels import CONTROL, ChannelPlan, P2pTransport  # noqa: E402
from vllm_afd.connectors.metadata import AFDTransferContext, AFDTransferMetadata  # noqa: E402
from vllm_afd.connectors.protocol import P2pProtocol  # noqa: E402

NUM_LAYERS = 2
HIDDEN = 64


class QueueTransport(P2pTransport):
    """In-memory channels: ``wire[(channel, src AFD rank, dst AFD rank)]`` is a FIFO of sent tensors."""

    control_device = torch.device("cpu")

    def __init__(self, wire: dict) -> None:
        self.wire = wire
        self.plan: ChannelPlan | None = None
        self.closed = 0

    def open(self, store, plan, timeout_s):
        self.plan = plan

    def _afd(self, channel: str, group_rank: int) -> int:
        return group_rank if channel == CONTROL else self.plan.subgroup_members[group_rank]

    def send(self, channel, tensor, dst):
        self.wire[(channel, self.plan.afd_rank, self._afd(channel, dst))].append(tensor.detach().clone())

    def recv(self, channel, tensor, src):
        queue = self.wire[(channel, self._afd(channel, src), self.plan.afd_rank)]
        assert queue, f"{channel} receive from group rank {src} without a matching send"
        sent = queue.popleft()
        assert sent.dtype == tensor.dtype and sent.numel() == tensor.numel(), "sizes disagree on the wire"
        tensor.copy_(sent.view(tensor.shape))
        return src

    def abort(self):
        pass

    def close(self):
        self.closed += 1


def hidden_for(rank: int, step: int, layer: int, num_rows: int) -> torch.Tensor:
    return (torch.arange(num_rows * HIDDEN, dtype=torch.float32) + 100 * rank + 10 * step + layer).reshape(num_rows, HIDDEN)


class ExchangeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        port, self.wire = free_port(), defaultdict(deque)
        self.ffn = self._protocol("ffn", 0, port)
        self.attention = [self._protocol("attention", j, port) for j in range(2)]
        threads = [threading.Thread(target=p.init) for p in self.everyone]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20.0)
        assert all(p.is_initialized for p in self.everyone)
        self.step, self.counts, self.layer = -1, None, 0
        self.sent: set[int] = set()
        self.received: set[int] = set()
        self.served = False
        self.closed = False

    def _protocol(self, role: str, rank: int, port: int) -> P2pProtocol:
        fingerprint = make_fingerprint(role, rank, 2, 1, dtype="float32")
        config = make_settings(role, rank, 2, 1, port, dtype=torch.float32, exchanges_per_stage=NUM_LAYERS)
        return P2pProtocol(config, QueueTransport(self.wire), lambda: fingerprint, terminate=None)

    @property
    def everyone(self) -> list[P2pProtocol]:
        return [self.ffn, *self.attention]

    def rows(self, rank: int) -> int:
        return max(1, self.counts[rank])

    # ---- rules ------------------------------------------------------------------------------------

    @precondition(lambda self: not self.closed and self.counts is None)
    @rule(counts=st.lists(st.integers(0, 4), min_size=2, max_size=2), profile=st.booleans())
    def publish(self, counts, profile):
        for protocol in self.attention:
            protocol.send_dp_metadata({0: counts}, is_profile=profile)
        payload = self.ffn.recv_dp_metadata_list()
        self.ffn.update_state_from_dp_metadata(payload)

        assert payload.step_seq == self.step + 1  # ids increase by one per step
        assert list(payload.dp_metadata_list[0].num_tokens_across_dp_cpu) == counts
        assert payload.is_profile is profile
        self.step, self.counts, self.layer = self.step + 1, counts, 0
        self.sent, self.received, self.served = set(), set(), False

    @precondition(lambda self: not self.closed and self.counts is not None)
    @rule(rank=st.integers(0, 1))
    def attention_sends(self, rank):
        if rank in self.sent:
            return  # one send per rank per exchange
        num_rows = self.rows(rank)
        context = AFDTransferContext(AFDTransferMetadata.create_attention_metadata(self.layer, 0, num_rows))
        self.attention[rank].send_attn_output(hidden_for(rank, self.step, self.layer, num_rows), context)
        self.sent.add(rank)

    @precondition(lambda self: not self.closed and self.counts is not None)
    @rule(rank=st.integers(0, 1), extra=st.integers(1, 3))
    def wrong_rows_never_reach_the_wire(self, rank, extra):
        before = {key: len(queue) for key, queue in self.wire.items()}
        num_rows = self.rows(rank) + extra
        context = AFDTransferContext(AFDTransferMetadata.create_attention_metadata(self.layer, 0, num_rows))

        with pytest.raises(ValueError, match="differ from the published count"):
            self.attention[rank].send_attn_output(hidden_for(rank, self.step, self.layer, num_rows), context)

        assert {key: len(queue) for key, queue in self.wire.items()} == before

    @precondition(lambda self: not self.closed and self.sent == {0, 1} and not self.served)
    @rule()
    def ffn_serves(self):
        received = self.ffn.recv_attn_output(0)

        expected = [hidden_for(j, self.step, self.layer, self.rows(j)) for j in (0, 1)]
        assert torch.equal(received.hidden_states, torch.cat(expected))  # peers in ascending order
        assert received.context.metadata.seq_lens == [self.rows(0), self.rows(1)]
        self.ffn.send_ffn_output(received.hidden_states * 2 + self.layer, received.context)
        self.served = True

    @precondition(lambda self: not self.closed and self.served)
    @rule(rank=st.integers(0, 1))
    def attention_receives(self, rank):
        if rank in self.received:
            return
        ref = torch.empty(self.rows(rank), HIDDEN)

        out = self.attention[rank].recv_ffn_output(ref)

        assert out is ref
        assert torch.equal(out, hidden_for(rank, self.step, self.layer, self.rows(rank)) * 2 + self.layer)
        self.received.add(rank)
        if self.received == {0, 1}:
            self.layer += 1
            self.sent, self.received, self.served = set(), set(), False
            if self.layer == NUM_LAYERS:
                self.counts = None

    @precondition(lambda self: not self.closed)
    @rule()
    def shutdown(self):
        for protocol in self.everyone:
            protocol.close()
            protocol.close()
        self.closed = True

        assert not any(p.is_initialized for p in self.everyone)
        assert all(p.transport.closed == 1 for p in self.everyone)
        with pytest.raises(RuntimeError, match="P2P connector is closed"):
            self.attention[0].send_dp_metadata({0: [1, 1]})

    @precondition(lambda self: self.closed)
    @rule()
    def calls_after_shutdown_raise(self):
        for protocol in self.everyone:
            protocol.close()
            with pytest.raises(RuntimeError, match="P2P connector is closed"):
                protocol.update_state_from_dp_metadata(None)
        with pytest.raises(RuntimeError, match="P2P connector is closed"):
            self.ffn.recv_dp_metadata_list()

    # ---- invariants -------------------------------------------------------------------------------

    @invariant()
    def the_wire_holds_exactly_the_unmatched_sends(self):
        if self.closed:
            return
        pending = {key: len(queue) for key, queue in self.wire.items() if queue}
        expected = {}
        for j in (0, 1):
            if j in self.sent and not self.served:
                expected[("a2e", 1 + j, 0)] = 1
            if self.served and j not in self.received:
                expected[("e2a", 0, 1 + j)] = 1
        assert pending == expected

    @invariant()
    def steps_are_open_exactly_while_exchanges_are_owed(self):
        if self.closed:
            return
        done_0 = self.layer == NUM_LAYERS - 1 and 0 in self.received
        done_ffn = self.layer == NUM_LAYERS - 1 and self.served
        assert (self.attention[0]._watchdog._step is not None) == (self.counts is not None and not done_0)
        assert (self.ffn._watchdog._step is not None) == (self.counts is not None and not done_ffn)

    def teardown(self):
        for protocol in self.everyone:
            protocol.close()


ExchangeMachine.TestCase.settings = settings(
    max_examples=12, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_exchange_sequence = ExchangeMachine.TestCase
