"""Bounded receives (docs/protocol.md#bounds): over gloo every data receive is posted at the agreed ``max_rows`` rows
into buffers made once per pairing, and what the ends hand out stays intact as long as its consumer reads it.

The FFN hands out views of two buffers per (stage, width, dtype), used in turn: a batch survives its stage's next
receive, which is how long the FFN reads it, or sends it back when its output aliases its input. The first tests
run in one process over ``BoundedQueueTransport`` (the in-memory wire with gloo's posting rule: a message up to the
whole buffer is read, a longer one is gloo's abort); the last runs 2A1F over real gloo, whose FFN answers each batch
in place, so every answer is sent from the receive buffer while the other stages' and layers' receives land.
"""

from __future__ import annotations

import pytest
import torch

from tests.connectors._harness import (QueueTransport, WorkerPool, expect_ok, free_port, init_all, make_connector,
                                       make_placement, make_spec, new_wire)

from vllm_afd.wire.messages import RoutingSpec

BF16 = torch.bfloat16
MAX_ROWS = 8
NUM_LAYERS = 4


class BoundedQueueTransport(QueueTransport):
    """``QueueTransport`` that posts like gloo: a message up to the whole buffer lands in its head, a longer one fails
    (gloo would end the process), and the rest of the buffer is scribbled on, as a longer message would."""

    bounded_receives = True

    def recv_rows(self, channel, buffer, rows, src):
        pending = self.wire[(channel, self._afd(channel, src), self.placement.afd_rank)]
        sent = pending.popleft().reshape(-1, buffer.shape[1])
        assert sent.shape[0] <= buffer.shape[0], "longer than the posted receive: gloo's abort"
        buffer[sent.shape[0]:].fill_(-7)
        buffer[:sent.shape[0]].copy_(sent)
        return buffer[:rows]


def stage_rows(layer: int, stage: int, rank: int, num_rows: int, width: int = 64, dtype=BF16) -> torch.Tensor:
    """Rows that name their (layer, stage, attention rank): a batch overwritten by another one shows."""
    base = 16 * layer + 4 * stage + rank
    return (base + torch.arange(num_rows * width).reshape(num_rows, width) % 3).to(dtype)


@pytest.fixture
def deployment():
    """2A1F agreeing on 3 stages over the bounded in-memory wire, the attention announcing max_rows=8:
    (ffn, [attention 0, attention 1])."""
    port, wire = free_port(), new_wire()
    spec = make_spec(port, exchanges_per_stage=NUM_LAYERS, num_stages=3, router_logits_width=8)
    ffn = make_connector(spec, make_placement("ffn", 0, 2, 1), transport=BoundedQueueTransport(wire))
    attention = [make_connector(spec, make_placement("attention", k, 2, 1), transport=BoundedQueueTransport(wire),
                                max_rows=MAX_ROWS) for k in range(2)]
    init_all([ffn, *attention])
    yield ffn, attention
    for connector in (*attention, ffn):
        connector.close()


COUNTS = {0: [3, 8], 1: [1, 2], 2: [8, 5]}  # rows per attention rank in each stage (8: max_rows)
ROUTING = RoutingSpec(8, torch.float32)


def expected(layer: int, stage: int) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = torch.cat([stage_rows(layer, stage, k, n) for k, n in enumerate(COUNTS[stage])])
    logits = torch.cat([stage_rows(layer, stage, k, n, 8, torch.float32) for k, n in enumerate(COUNTS[stage])])
    return hidden, logits


def test_an_ffn_batch_stays_intact_through_its_stages_next_receive_and_buffers_are_made_once(deployment):
    ffn, attention = deployment
    for connector in attention:
        connector.publish(COUNTS)
    ffn.next_step()
    held = {}

    for layer in range(NUM_LAYERS):
        for stage in COUNTS:
            for k, connector in enumerate(attention):
                num_rows = COUNTS[stage][k]
                connector.send_a2f(stage, stage_rows(layer, stage, k, num_rows),
                                   stage_rows(layer, stage, k, num_rows, 8, torch.float32))
            batch = held[layer, stage] = ffn.recv_a2f(stage, ROUTING)
            # Every batch still held by a consumer: this layer's of every stage, and the previous layer's.
            for (held_layer, held_stage), old in held.items():
                if held_layer >= layer - 1:
                    assert (torch.equal(old.hidden_states, expected(held_layer, held_stage)[0])
                            and torch.equal(old.router_logits, expected(held_layer, held_stage)[1])), (held_layer,
                                                                                                        held_stage)
            ffn.send_f2a(stage, batch.hidden_states)
            for k, connector in enumerate(attention):
                connector.recv_f2a(stage, torch.empty(COUNTS[stage][k], 64, dtype=BF16))
    ffn.wait_sends()

    # Two turns per stage and width: layer L + 2 reuses layer L's buffer, nothing else is allocated.
    assert len(ffn._bounded) == len(COUNTS) * 2 * 2
    assert all(buffer.shape[0] == 2 * MAX_ROWS for buffer in ffn._bounded.values())
    for stage in COUNTS:
        assert held[2, stage].hidden_states.data_ptr() == held[0, stage].hidden_states.data_ptr()
        assert held[1, stage].hidden_states.data_ptr() != held[0, stage].hidden_states.data_ptr()


def test_the_attention_gets_only_the_published_rows_into_the_tensor_it_passed(deployment):
    ffn, attention = deployment
    for connector in attention:
        connector.publish(COUNTS)
    ffn.next_step()
    for k, connector in enumerate(attention):
        connector.send_a2f(0, stage_rows(0, 0, k, COUNTS[0][k]), stage_rows(0, 0, k, COUNTS[0][k], 8, torch.float32))
    ffn.send_f2a(0, ffn.recv_a2f(0, ROUTING).hidden_states * 2)
    out = torch.zeros(3, 64, dtype=BF16)

    result = attention[0].recv_f2a(0, out)

    assert result is out and torch.equal(out, stage_rows(0, 0, 0, 3) * 2)  # not the -7 past the published rows
    assert attention[0]._bounded[0].shape == (MAX_ROWS, 64)


# --- over real gloo: the FFN answers in place, 2A1F, 2 stages ---------------------------------------------------

GLOO_COUNTS = {0: [2, 3], 1: [4, 1]}


def gloo_rank(port: int, role: str, rank: int, num_steps: int) -> str:
    """One rank of a 2A1F deployment over gloo; the FFN doubles each batch in place and sends it back."""
    spec = make_spec(port, exchanges_per_stage=NUM_LAYERS, num_stages=2)
    extra = {"max_rows": MAX_ROWS} if role == "attention" else {}
    connector = make_connector(spec, make_placement(role, rank, 2, 1), **extra)
    connector.init()
    try:
        for _ in range(num_steps):
            if role == "ffn":
                connector.next_step()
                for _layer in range(NUM_LAYERS):
                    for stage in GLOO_COUNTS:
                        # NOTE: in place: the answer is sent from the receive buffer itself.
                        connector.send_f2a(stage, connector.recv_a2f(stage).hidden_states.mul_(2))
                connector.wait_sends()
                continue
            connector.publish(GLOO_COUNTS)
            hidden = {stage: stage_rows(0, stage, rank, counts[rank]) for stage, counts in GLOO_COUNTS.items()}
            for layer in range(NUM_LAYERS):
                for stage in GLOO_COUNTS:
                    connector.send_a2f(stage, hidden[stage])
                for stage in GLOO_COUNTS:
                    want = hidden[stage] * 2
                    hidden[stage] = connector.recv_f2a(stage, hidden[stage]).clone()
                    assert torch.equal(hidden[stage], want), (layer, stage, hidden[stage], want)
                    hidden[stage] = stage_rows(layer + 1, stage, rank, GLOO_COUNTS[stage][rank])
        return "ok"
    finally:
        connector.close()


@pytest.fixture(scope="module")
def pool():
    workers = WorkerPool(3)
    yield workers
    workers.close()


def test_an_ffn_answering_in_place_from_its_receive_buffers_returns_every_attention_rank_its_own_rows(pool):
    port = free_port()

    results = expect_ok(pool.run(gloo_rank, [(port, "ffn", 0, 3), (port, "attention", 0, 3),
                                             (port, "attention", 1, 3)], timeout_s=180.0))

    assert results == ["ok"] * 3
