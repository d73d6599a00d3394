"""Integrity mode (wire/integrity.py, docs/protocol.md#integrity-mode): every data message is followed by its
seal, and a receiver refuses one that disagrees with what it received or expected.

Connectors pair for real on loopback and exchange over the in-memory ``QueueTransport``, so a test can alter a
message on the wire between the send and the receive.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.connectors._harness import QueueTransport, free_port, init_all, make_connector, make_placement, make_spec
from tests.connectors._harness import new_wire

from vllm_afd.wire.errors import AFDPeerLostError, AFDPeerProtocolError
from vllm_afd.wire.integrity import NULL_INTEGRITY, SEAL_FIELDS, SEAL_WORDS, Integrity, seal_words
from vllm_afd.wire.placement import A2F, F2A

BF16 = torch.bfloat16


@pytest.fixture
def deployment():
    """``deployment(num_attention, integrity=True, **spec)`` -> (wire, ffn, [attention...]), 1 FFN rank."""
    made = []

    def make(num_attention=1, integrity=True, **spec_overrides):
        port, wire = free_port(), new_wire()
        spec = make_spec(port, integrity=integrity, exchanges_per_stage=2, **spec_overrides)
        ffn = make_connector(spec, make_placement("ffn", 0, num_attention, 1), transport=QueueTransport(wire),
                             integrity=integrity)
        attention = [make_connector(spec, make_placement("attention", j, num_attention, 1),
                                    transport=QueueTransport(wire), integrity=integrity) for j in range(num_attention)]
        made.extend([ffn, *attention])
        init_all([ffn, *attention])
        return wire, ffn, attention

    yield make
    for connector in made:
        connector.close()


def one_step(ffn, attention, rows, layers=2, tamper=None):
    """A whole step of ``layers`` exchanges; ``tamper(layer)`` may alter the wire before the FFN receives."""
    for a in attention:
        a.publish({0: [rows[j] for j in range(len(attention))]})
    ffn.next_step()
    outputs = []
    for layer in range(layers):
        sent = [torch.randn(rows[j], 64).to(BF16) for j in range(len(attention))]
        for a, hidden in zip(attention, sent):
            a.send_a2f(0, hidden)
        if tamper is not None:
            tamper(layer)
        batch = ffn.recv_a2f(0)
        ffn.send_f2a(0, batch.hidden_states * 2)
        outputs.append([a.recv_f2a(0, hidden) for a, hidden in zip(attention, sent)])
    ffn.wait_sends()
    return outputs


def test_a_sealed_step_crosses_and_every_message_carries_one_seal(deployment):
    wire, ffn, attention = deployment(2)

    one_step(ffn, attention, rows=[3, 2])

    assert ffn.is_initialized and all(a.is_initialized for a in attention)
    assert ffn.integrity.enabled and attention[0].integrity.enabled


class RecordingTransport(QueueTransport):
    """Also records the shape of every tensor sent."""

    def send(self, channel, tensor, dst):
        self.sent = [*getattr(self, "sent", []), (channel, tuple(tensor.shape))]
        super().send(channel, tensor, dst)


@pytest.mark.parametrize("integrity", [False, True])
def test_off_by_default_nothing_extra_crosses_and_on_one_seal_per_message(integrity):
    port, wire = free_port(), new_wire()
    spec = make_spec(port, integrity=integrity, exchanges_per_stage=2)
    ffn = make_connector(spec, make_placement("ffn", 0, 1, 1), transport=RecordingTransport(wire), integrity=integrity)
    attention = make_connector(spec, make_placement("attention", 0, 1, 1), transport=RecordingTransport(wire),
                               integrity=integrity)
    init_all([ffn, attention])
    try:
        one_step(ffn, [attention], rows=[2])
    finally:
        ffn.close()
        attention.close()

    data = [(A2F, (2, 64))] if not integrity else [(A2F, (2, 64)), (A2F, (SEAL_WORDS,))]
    assert [m for m in attention.transport.sent if m[0] == A2F] == data * 2
    assert (ffn.integrity is NULL_INTEGRITY) != integrity


@pytest.mark.parametrize("field", ["bytes", "rows", "order"])
def test_an_altered_a2f_message_is_a_lost_peer_on_the_ffn(deployment, field):
    wire, ffn, attention = deployment(1)
    key = (A2F, 1, 0)

    def tamper(layer):
        if layer != 1:
            return
        hidden, seal = wire[key].popleft(), wire[key].popleft()
        if field == "bytes":
            hidden = hidden.clone()
            hidden[0, 0] += 1
        elif field == "rows":  # what a peer that sent fewer rows than it published leaves in the buffer
            hidden = torch.cat([hidden[:1], torch.zeros_like(hidden[1:])])
        else:  # the seal of another exchange: messages out of step
            seal = seal.clone()
            seal[SEAL_FIELDS.index("exchange")] = 0
        wire[key].extendleft([seal, hidden])

    with pytest.raises(AFDPeerProtocolError, match="from a2f receive from attention rank 0 fails its integrity seal") \
            as info:
        one_step(ffn, attention, rows=[2], tamper=tamper)

    assert isinstance(info.value, AFDPeerLostError) and not ffn.is_initialized
    wanted = {"bytes": "crc32", "rows": "crc32", "order": "exchange 0 (expected 1)"}[field]
    assert wanted in str(info.value)


def test_an_altered_f2a_message_is_deferred_on_the_attention_as_a_lost_peer(deployment):
    wire, ffn, attention = deployment(1)
    attention[0].publish({0: [2]})
    ffn.next_step()
    hidden = torch.randn(2, 64).to(BF16)
    attention[0].send_a2f(0, hidden)
    ffn.send_f2a(0, ffn.recv_a2f(0).hidden_states)
    output = wire[(F2A, 0, 1)][0]
    output[1, 3] = 7  # the bytes on the wire, after the FFN sealed them

    with pytest.raises(AFDPeerProtocolError, match="f2a receive from ffn rank 0 fails its integrity seal: crc32"):
        attention[0].recv_f2a(0, hidden)
    assert not attention[0].is_initialized


@given(st.integers(0, SEAL_WORDS - 2), st.integers(-(2**40), 2**40))
def test_any_seal_word_that_differs_is_refused(word, delta):
    integrity = Integrity("P2pGlooAFDConnector", torch.device("cpu"))
    data = (torch.arange(12, dtype=torch.float32).reshape(3, 4),)
    seal = torch.tensor(seal_words(5, 2, 1, data), dtype=torch.int64)
    seal[word] += delta or 1

    with pytest.raises(AFDPeerProtocolError, match=f"{SEAL_FIELDS[word]} "):
        integrity.check([seal], 5, 2, 1, data, "a2f receive from attention rank 0")
    integrity.check([torch.tensor(seal_words(5, 2, 1, data))], 5, 2, 1, data, "a2f receive from attention rank 0")


def test_the_roles_must_agree_on_integrity():
    from vllm_afd.wire.errors import AFDConfigMismatchError

    port = free_port()
    spec = make_spec(port, rendezvous_timeout_s=5.0)
    wire = new_wire()
    ffn = make_connector(spec, make_placement("ffn", 0, 1, 1), transport=QueueTransport(wire), integrity=True)
    attention = make_connector(spec, make_placement("attention", 0, 1, 1), transport=QueueTransport(wire))
    errors = []

    def init(connector):
        try:
            connector.init()
        except AFDConfigMismatchError as exc:
            errors.append(str(exc))

    import threading

    threads = [threading.Thread(target=init, args=(c,)) for c in (ffn, attention)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    ffn.close()
    attention.close()
    assert errors and all("integrity (" in e for e in errors)
