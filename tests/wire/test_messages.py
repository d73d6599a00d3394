"""vllm_afd.wire.messages: the control payload's wire codec and the other wire records (docs/protocol.md)."""

import dataclasses
import json
import pickle

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from vllm_afd.wire.errors import AFDProtocolError
from vllm_afd.wire.messages import PAYLOAD_FLAGS, A2FBatch, ControlPayload, RoutingSpec

DOCUMENTED_BODY = (
    b'{"counts":{"0":[64,64]},"is_graph_capturing":false,"is_graph_replaying":true,"is_profile":false,'
    b'"is_warmup":false,"step_seq":812}'
)

count_vectors = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=8).map(tuple)
payloads = st.builds(
    ControlPayload,
    st.dictionaries(st.integers(0, 12), count_vectors, min_size=1, max_size=4),
    is_graph_capturing=st.booleans(),
    is_warmup=st.booleans(),
    is_graph_replaying=st.booleans(),
    is_profile=st.booleans(),
    step_seq=st.none() | st.integers(0, 2**62),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=12,
)


# --- control payload codec ------------------------------------------------------------------------


def test_encoding_matches_the_documented_example_byte_for_byte():
    payload = ControlPayload({0: (64, 64)}, is_graph_replaying=True, step_seq=812)

    body = payload.encode()

    assert body == DOCUMENTED_BODY
    assert ControlPayload.decode(DOCUMENTED_BODY) == payload


@given(payloads)
@example(ControlPayload({10: (0,), 2: (1, 0)}))
@example(ControlPayload({0: (2**31 - 1,) * 8}, is_warmup=True, is_profile=True, step_seq=0))
def test_payload_survives_encode_and_decode(payload):
    body = payload.encode()

    decoded = ControlPayload.decode(body)

    assert decoded == payload
    assert decoded.stages == tuple(sorted(payload.counts))
    assert body == json.dumps(json.loads(body), sort_keys=True, separators=(",", ":")).encode()
    assert all(key.isdigit() for key in json.loads(body)["counts"])
    optional = {"step_seq"} if payload.step_seq is not None else set()
    assert set(json.loads(body)) == {"counts", *PAYLOAD_FLAGS, *optional}


@given(payloads)
def test_decoding_then_encoding_reproduces_the_bytes(payload):
    body = payload.encode()

    again = ControlPayload.decode(body).encode()

    assert again == body


def test_body_is_json_and_not_pickle():
    body = ControlPayload({0: (3,)}).encode()

    assert body.startswith(b"{")
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads(body)


def test_missing_flags_are_false_and_missing_step_seq_is_unknown():
    decoded = ControlPayload.decode(b'{"counts":{"0":[5]}}')

    assert not any(getattr(decoded, flag) for flag in PAYLOAD_FLAGS)
    assert decoded.step_seq is None
    assert b"step_seq" not in decoded.encode()


def test_decoder_ignores_unknown_keys():
    body = b'{"counts":{"0":[2,7]},"dp_metadata_list":{"0":{"num_tokens_across_dp_cpu":[9]}},"later":1}'

    decoded = ControlPayload.decode(body)

    assert decoded == ControlPayload({0: (2, 7)})


def test_decoder_accepts_bytearray_and_memoryview():
    from_bytearray = ControlPayload.decode(bytearray(DOCUMENTED_BODY))

    from_memoryview = ControlPayload.decode(memoryview(DOCUMENTED_BODY))

    assert from_bytearray == from_memoryview == ControlPayload.decode(DOCUMENTED_BODY)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xff\xfe{}",
        b"[]",
        b"null",
        b"{}",
        b'{"counts":[]}',
        b'{"counts":{}}',
        b'{"counts":{"-1":[1]}}',
        b'{"counts":{"01":[1]}}',
        b'{"counts":{"a":[1]}}',
        b'{"counts":{" 1":[1]}}',
        b'{"counts":{"\\u0661":[1]}}',  # ARABIC-INDIC DIGIT ONE: a digit, but not ASCII
        b'{"counts":{"0":[]}}',
        b'{"counts":{"0":[1.5]}}',
        b'{"counts":{"0":[1.0]}}',
        b'{"counts":{"0":[true]}}',
        b'{"counts":{"0":[-1]}}',
        b'{"counts":{"0":[NaN]}}',
        b'{"counts":{"0":{"num_tokens_across_dp_cpu":[1]}}}',
        b'{"counts":{"0":1}}',
        b'{"counts":{"0":[1]},"is_warmup":"yes"}',
        b'{"counts":{"0":[1]},"is_profile":1}',
        b'{"counts":{"0":[1]},"step_seq":-1}',
        b'{"counts":{"0":[1]},"step_seq":"3"}',
        b'{"counts":{"0":[1]},"step_seq":true}',
        b'{"dp_metadata_list":{"0":{"num_tokens_across_dp_cpu":[64,64]}}}',  # protocol 1's body
        b"[" * 100_000,
        pickle.dumps({"counts": {0: [1]}}),
    ],
)
def test_undecodable_bytes_raise_a_protocol_error(body):
    with pytest.raises(AFDProtocolError, match="AFD control payload is undecodable"):
        ControlPayload.decode(body)


def test_a_stage_key_too_long_for_int_is_a_protocol_error():
    """Regression: int() of a key over Python's 4300-digit limit raised a plain ValueError."""
    body = b'{"counts":{"' + b"1" * 5000 + b'":[1]}}'

    with pytest.raises(AFDProtocolError, match="AFD control payload is undecodable"):
        ControlPayload.decode(body)


def test_protocol_error_names_the_first_bytes_and_the_fix():
    with pytest.raises(AFDProtocolError) as info:
        ControlPayload.decode(b'{"counts":{"0":[-1]}}')

    assert str(info.value) == (
        "AFD control payload is undecodable (stage 0: counts are not a non-empty list of non-negative "
        """integers; first bytes b'{"counts":{"0":[-1]}}'); expected the compact JSON body of """
        "docs/protocol.md#control-payload. Run the same vllm_afd version on both roles"
    )


@given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_or_raise_a_protocol_error_only(body):
    try:
        ControlPayload.decode(body)
    except AFDProtocolError:
        pass


@given(json_values, st.dictionaries(st.sampled_from([*PAYLOAD_FLAGS, "step_seq"]), json_values, max_size=3))
@example({"0": [1, 2]}, {"step_seq": 3})
def test_arbitrary_json_bodies_decode_or_raise_a_protocol_error_only(counts, extra):
    body = json.dumps({"counts": counts, **extra}).encode()

    try:
        decoded = ControlPayload.decode(body)
    except AFDProtocolError:
        return

    assert ControlPayload.decode(decoded.encode()) == decoded


def test_protocol_error_is_a_runtime_error():
    assert issubclass(AFDProtocolError, RuntimeError)


# --- control payload construction -----------------------------------------------------------------


def test_payload_sorts_stages_and_copies_the_counts():
    source = {3: [1], 1: [2, 0]}

    payload = ControlPayload(source)
    source[1].append(9)

    assert payload.stages == (1, 3)
    assert payload.counts == {1: (2, 0), 3: (1,)}


def test_payload_converts_integral_counts_to_plain_ints():
    counts = torch.tensor([64, 3], dtype=torch.int32)

    payload = ControlPayload({np.int64(0): counts}, step_seq=np.int32(4))

    assert payload.counts == {0: (64, 3)}
    assert all(type(n) is int for n in payload.counts[0]) and type(payload.step_seq) is int
    assert payload.encode().count(b"[64,3]") == 1


@pytest.mark.parametrize(("counts", "changes", "error", "text"), [
    ({}, {}, ValueError, "no stages; expected at least stage 0"),
    ({0: ()}, {}, ValueError, "stage 0 has no counts; expected one per attention rank"),
    ({0: (1, -2)}, {}, ValueError, "row counts must be >= 0, got -2"),
    ({0: (1.0,)}, {}, TypeError, "row counts must be integers, got 1.0"),
    ({0: (True,)}, {}, TypeError, "row counts must be integers, got True"),
    ({-1: (1,)}, {}, ValueError, "row counts must be >= 0, got -1"),
    ({0: (1,)}, {"is_warmup": 1}, TypeError, "is_warmup must be a bool, got 1"),
    ({0: (1,)}, {"step_seq": -1}, ValueError, "step_seq: row counts must be >= 0, got -1"),
    ({0: (1,)}, {"step_seq": "3"}, TypeError, "must be integers, got '3'"),
])
def test_payload_rejects_bad_values(counts, changes, error, text):
    with pytest.raises(error, match=text):
        ControlPayload(counts, **changes)


def test_payload_is_frozen():
    payload = ControlPayload({0: (1,)})

    with pytest.raises(dataclasses.FrozenInstanceError):
        payload.step_seq = 3


# --- routing spec and received batch --------------------------------------------------------------


def test_routing_spec_is_static_and_positive():
    spec = RoutingSpec(8, torch.bfloat16)

    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.width = 4
    with pytest.raises(ValueError, match="width must be positive, got 0; pass the model's number of routed experts"):
        RoutingSpec(0, torch.bfloat16)
    with pytest.raises(TypeError, match="must be integers, got 8.0"):
        RoutingSpec(8.0, torch.bfloat16)


def test_received_batch_is_a_frozen_record_of_the_fan_in():
    hidden = torch.zeros(5, 4)

    batch = A2FBatch(hidden, None, (1, 4))

    assert batch.hidden_states is hidden and batch.router_logits is None and tuple(batch.peer_rows) == (1, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.router_logits = hidden
