"""Everything a peer sends is checked before use (docs/security.md#what-is-validated): the control frame's parser
under hostile values, the FFN's bounds before any allocation, the attention's own bound before it publishes.

The parsers are fuzzed directly (``read_control``, ``control_length``, ``Fingerprint.from_json``); the connector
cases run over the in-memory ``QueueTransport`` (real rendezvous and handshake on loopback).
"""

from __future__ import annotations

import json
import zlib

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from tests.connectors._harness import QueueTransport, free_port, init_all, make_connector, make_placement, make_spec
from tests.connectors._harness import new_wire, pending
from tests.wire.test_handshake import fingerprints

from vllm_afd.wire.errors import AFDConfigMismatchError, AFDPeerLostError, AFDPeerProtocolError, AFDProtocolError
from vllm_afd.wire.handshake import Fingerprint
from vllm_afd.wire.messages import MAX_CONTROL_BYTES, ControlPayload, control_header, control_length, read_control
from vllm_afd.wire.placement import CONTROL

INT64 = st.integers(-(2**63), 2**63 - 1)
HOSTILE_INTS = st.sampled_from([-1, 0, 1, 2**31, 2**53 + 1, 2**63 - 1, -(2**63)]) | INT64


# --- the parsers under hostile values ---------------------------------------------------------------------


@given(st.lists(INT64, min_size=2, max_size=2))
@example([MAX_CONTROL_BYTES + 1, 0])
@example([0, 0])
@example([-(2**63), 0])
def test_a_control_length_outside_its_bound_is_refused_before_the_body_is_posted(header):
    try:
        num_bytes = control_length(header)
    except AFDProtocolError as exc:
        assert not 0 < header[0] <= MAX_CONTROL_BYTES and "is not in 1..1048576" in str(exc)
    else:
        assert num_bytes == header[0] and 0 < num_bytes <= MAX_CONTROL_BYTES


hostile_bodies = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda counts, stages: json.dumps({"counts": {str(s): counts for s in stages}}).encode(),
              st.lists(HOSTILE_INTS, min_size=1, max_size=4), st.lists(st.integers(0, 10**9), min_size=1, max_size=3)),
    st.builds(lambda key, value: json.dumps({"counts": {"0": [1]}, key: value}).encode(),
              st.sampled_from(["is_warmup", "step_seq", "counts", "is_profile"]),
              st.none() | st.booleans() | HOSTILE_INTS | st.text(max_size=4) | st.lists(st.integers(), max_size=2)),
)


@given(hostile_bodies, st.booleans(), st.integers(1, 3), st.integers(1, 4096))
@example(b'{"counts":{"0":[4097]}}', True, 1, 4096)  # one row above the attention's max_rows
@example(b'{"counts":{"1":[1]}}', True, 1, 4096)  # a stage the handshake did not agree on
@example(b'{"counts":{"0":[' + b"9" * 5000 + b"]}}", True, 1, 4096)  # beyond Python's int digit limit
@example(b'{"counts":{"0":[1]}}', False, 1, 4096)  # another CRC
def test_a_control_frame_is_a_checked_payload_or_a_protocol_error(body, crc_matches, num_stages, max_rows):
    header = control_header(body) if crc_matches else [len(body), zlib.crc32(body) ^ 1]
    try:
        payload = read_control(header, body, num_stages=num_stages, max_rows=max_rows)
    except AFDProtocolError:
        return
    assert crc_matches
    assert max(payload.stages) < num_stages
    assert all(0 <= n <= max_rows for counts in payload.counts.values() for n in counts)
    assert ControlPayload.decode(payload.encode()) == payload


_FIELD_VALUES = st.none() | st.booleans() | HOSTILE_INTS | st.text(max_size=6) | st.lists(st.integers(), max_size=2)


@given(st.sampled_from(sorted(json.loads(fingerprints()[0].to_json()))), _FIELD_VALUES)
@example("max_rows", 2**40)
@example("max_rows", 0)
@example("max_rows", True)
@example("integrity", 1)
def test_a_hostile_fingerprint_field_is_a_protocol_error_or_a_mismatch(name, value):
    body = json.loads(fingerprints()[0].to_json())
    body[name] = value
    try:
        parsed = Fingerprint.from_json(json.dumps(body))
    except (AFDProtocolError, AFDConfigMismatchError):
        return
    assert getattr(parsed, name) == value and 1 <= parsed.max_rows <= 1 << 20


# --- the connector ends -----------------------------------------------------------------------------------


@pytest.fixture
def pair():
    """``pair(max_rows, spec_max_rows, **spec)`` -> (wire, ffn, attention), 1A1F over QueueTransport; the attention's
    handshake announces ``max_rows``, its spec bounds its own publish by ``spec_max_rows``; the FFN keeps graph
    buffers (so adopting a payload allocates)."""
    made = []

    def make(max_rows=8, spec_max_rows=None, **spec_overrides):
        port, wire = free_port(), new_wire()
        spec = make_spec(port, use_graph_buffers=True, max_rows=spec_max_rows, **spec_overrides)
        ffn = make_connector(spec, make_placement("ffn", 0, 1, 1), transport=QueueTransport(wire))
        attention = make_connector(spec, make_placement("attention", 0, 1, 1), transport=QueueTransport(wire),
                                   max_rows=max_rows)
        made.extend([ffn, attention])
        init_all([ffn, attention])
        return wire, ffn, attention

    yield make
    for connector in made:
        connector.close()


def forge(attention, body: bytes, header=None) -> None:
    """What a lying attention rank sends on the control channel: ``header`` (default: the honest one), ``body``."""
    words = control_header(body) if header is None else header
    attention.transport.send(CONTROL, torch.tensor(words, dtype=torch.int64), 0)
    attention.transport.send(CONTROL, torch.frombuffer(bytearray(body), dtype=torch.uint8), 0)


def test_a_count_above_the_attentions_max_rows_is_a_lost_peer_before_any_buffer_exists(pair):
    wire, ffn, attention = pair(max_rows=8)
    forge(attention, ControlPayload({0: (9,)}).encode())

    with pytest.raises(AFDPeerProtocolError, match="publishes 9 rows in stage 0; the attention's handshake announced "
                                                   "max_rows=8") as info:
        ffn.next_step()

    assert isinstance(info.value, AFDPeerLostError)  # the FFN loop re-forms on it
    assert ffn._buffers == {} and ffn.steps.payload is None
    ffn._latch.join(5.0)  # the abort runs on the latch's thread
    assert not ffn.is_initialized and ffn.transport.aborted == 1


def test_a_count_at_max_rows_is_adopted(pair):
    _, ffn, attention = pair(max_rows=8)
    forge(attention, ControlPayload({0: (8,)}).encode())

    assert ffn.next_step().counts == {0: (8,)} and ffn.steps.stage(0).peer_rows == (8,)


def test_a_body_that_fails_its_crc_is_a_lost_peer(pair):
    _, ffn, attention = pair()
    body = ControlPayload({0: (2,)}).encode()
    forge(attention, body, header=[len(body), zlib.crc32(body) + 1])

    with pytest.raises(AFDPeerProtocolError, match="fails its CRC-32"):
        ffn.next_step()
    assert ffn.steps.payload is None


def test_the_attention_refuses_to_publish_above_its_own_max_rows_and_sends_nothing(pair):
    wire, ffn, attention = pair(max_rows=8, spec_max_rows=8)

    with pytest.raises(ValueError, match="stage 0 publishes 9 rows .* max_rows=8"):
        attention.publish({0: [9]})

    assert pending(wire) == {} and attention.steps.payload is None
