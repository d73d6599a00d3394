"""vllm_afd.connectors.metadata: wire codec of the control payload and the exchange records (§4.2-4.3, §5.4)."""

import dataclasses
import json
import pickle

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from vllm_afd.connectors.metadata import (
    PAYLOAD_FLAGS,
    AFDA2FTransferPayload,
    AFDControlPayload,
    AFDDPMetadata,
    AFDExpertRoutingSpec,
    AFDForwardContextMetadata,
    AFDTransferContext,
    AFDTransferMetadata,
    next_transaction_id,
)
from vllm_afd.errors import AFDProtocolError

SPEC_EXAMPLE = (
    b'{"dp_metadata_list":{"0":{"max_tokens_across_dp_cpu":64,"num_tokens_across_dp_cpu":[64,64]}},'
    b'"is_graph_capturing":false,"is_graph_replaying":true,"is_profile":false,"is_warmup":false,"step_seq":812}'
)

payloads = st.builds(
    AFDControlPayload,
    st.dictionaries(st.integers(0, 12), st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=8).map(AFDDPMetadata),
                    max_size=4),
    is_graph_capturing=st.booleans(),
    is_warmup=st.booleans(),
    is_graph_replaying=st.booleans(),
    is_profile=st.booleans(),
    step_seq=st.none() | st.integers(0, 2**62),
)


# --- control payload codec ------------------------------------------------------------------------


def test_encoding_matches_the_spec_example_byte_for_byte():
    payload = AFDControlPayload({0: AFDDPMetadata([64, 64])}, is_graph_replaying=True, step_seq=812)

    assert payload.encode() == SPEC_EXAMPLE
    assert AFDControlPayload.decode(SPEC_EXAMPLE) == payload


@given(payloads)
@example(AFDControlPayload({10: AFDDPMetadata([0]), 2: AFDDPMetadata([1, 0])}))
def test_payload_survives_encode_and_decode(payload):
    body = payload.encode()

    decoded = AFDControlPayload.decode(body)

    assert decoded == payload
    assert decoded.stages == tuple(sorted(payload.dp_metadata_list))
    assert body.startswith(b"{")
    assert body == json.dumps(json.loads(body), sort_keys=True, separators=(",", ":")).encode()
    assert all(key.isdigit() for key in json.loads(body)["dp_metadata_list"])


def test_body_is_json_and_not_pickle():
    body = AFDControlPayload({0: AFDDPMetadata([3])}).encode()

    assert body.startswith(b"{")
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads(body)


def test_missing_flags_are_false_and_missing_step_seq_is_unknown():
    decoded = AFDControlPayload.decode(b'{"dp_metadata_list":{"0":{"num_tokens_across_dp_cpu":[5]}}}')

    assert not any(getattr(decoded, flag) for flag in PAYLOAD_FLAGS)
    assert decoded.step_seq is None
    assert b"step_seq" not in decoded.encode()


def test_decoder_recomputes_the_max_and_ignores_unknown_keys():
    body = b'{"dp_metadata_list":{"0":{"max_tokens_across_dp_cpu":999,"num_tokens_across_dp_cpu":[2,7]}},"later":1}'

    decoded = AFDControlPayload.decode(body)

    assert decoded.dp_metadata_list[0].max_tokens_across_dp_cpu == 7


def test_decoder_accepts_bytearray_and_memoryview():
    assert AFDControlPayload.decode(bytearray(SPEC_EXAMPLE)) == AFDControlPayload.decode(memoryview(SPEC_EXAMPLE))


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xff\xfe{}",
        b"[]",
        b"null",
        b"{}",
        b'{"dp_metadata_list":[]}',
        b'{"dp_metadata_list":{"-1":{"num_tokens_across_dp_cpu":[1]}}}',
        b'{"dp_metadata_list":{"01":{"num_tokens_across_dp_cpu":[1]}}}',
        b'{"dp_metadata_list":{"a":{"num_tokens_across_dp_cpu":[1]}}}',
        b'{"dp_metadata_list":{"0":{"num_tokens_across_dp_cpu":[]}}}',
        b'{"dp_metadata_list":{"0":{"num_tokens_across_dp_cpu":[1.5]}}}',
        b'{"dp_metadata_list":{"0":{"num_tokens_across_dp_cpu":[true]}}}',
        b'{"dp_metadata_list":{"0":{"num_tokens_across_dp_cpu":[-1]}}}',
        b'{"dp_metadata_list":{"0":{"num_tokens_across_dp_cpu":[NaN]}}}',
        b'{"dp_metadata_list":{"0":[1]}}',
        b'{"dp_metadata_list":{},"is_warmup":"yes"}',
        b'{"dp_metadata_list":{},"step_seq":-1}',
        b'{"dp_metadata_list":{},"step_seq":"3"}',
        b"[" * 100_000,
        pickle.dumps({"dp_metadata_list": {0: [1]}}),
    ],
)
def test_undecodable_bytes_raise_a_protocol_error(body):
    with pytest.raises(AFDProtocolError, match="AFD control payload is undecodable"):
        AFDControlPayload.decode(body)


@given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_or_raise_a_protocol_error_only(body):
    try:
        AFDControlPayload.decode(body)
    except AFDProtocolError:
        pass


def test_protocol_error_is_a_runtime_error():
    assert issubclass(AFDProtocolError, RuntimeError)


def test_payload_rejects_non_bool_flags_and_sorts_stages():
    with pytest.raises(TypeError, match="is_warmup must be a bool"):
        AFDControlPayload({}, is_warmup=1)

    payload = AFDControlPayload({3: AFDDPMetadata([1]), 1: AFDDPMetadata([2])})

    assert payload.stages == (1, 3)


def test_payload_converts_native_dp_metadata():
    pytest.importorskip("vllm")
    import torch
    from vllm.forward_context import DPMetadata

    native = DPMetadata(num_tokens_across_dp_cpu=torch.tensor([64, 3], dtype=torch.int32))

    payload = AFDControlPayload({0: native})

    assert payload.dp_metadata_list[0] == AFDDPMetadata([64, 3])
    assert type(payload.dp_metadata_list[0].num_tokens_across_dp_cpu[0]) is int
    assert payload.encode().count(b"[64,3]") == 1


# --- DP metadata ----------------------------------------------------------------------------------


def test_dp_metadata_derives_and_checks_the_max():
    assert AFDDPMetadata([1, 9, 3]).max_tokens_across_dp_cpu == 9
    assert AFDDPMetadata((1, 9), 9) == AFDDPMetadata([1, 9])
    with pytest.raises(ValueError, match=r"max_tokens_across_dp_cpu \(5\) is not the max"):
        AFDDPMetadata([1, 9], 5)


@pytest.mark.parametrize(("counts", "error", "text"), [
    ([], ValueError, "num_tokens_across_dp_cpu is empty"),
    ([1, -2], ValueError, "row counts must be >= 0, got -2"),
    ([1.0], TypeError, "row counts must be integers, got 1.0"),
    ([True], TypeError, "row counts must be integers, got True"),
])
def test_dp_metadata_rejects_bad_counts(counts, error, text):
    with pytest.raises(error, match=text):
        AFDDPMetadata(counts)


# --- transfer records -----------------------------------------------------------------------------


def test_transfer_metadata_validates_seq_lens():
    with pytest.raises(ValueError, match="seq_lens cannot be empty"):
        AFDTransferMetadata.create_ffn_metadata(0, 0, [])
    with pytest.raises(ValueError, match="all sequence lengths must be positive"):
        AFDTransferMetadata.create_ffn_metadata(0, 0, [1, 0])
    with pytest.raises(ValueError, match="all sequence lengths must be positive"):
        AFDTransferMetadata.create_attention_metadata(0, 0, -3)


def test_transfer_metadata_factories_and_total():
    attention = AFDTransferMetadata.create_attention_metadata(5, 0, 7)
    ffn = AFDTransferMetadata.create_ffn_metadata(0, 1, (1, 4))

    ffn.layer_idx = 3

    assert (attention.layer_idx, attention.stage_idx, attention.seq_lens, attention.total_tokens) == (5, 0, [7], 7)
    assert (ffn.layer_idx, ffn.stage_idx, ffn.seq_lens, ffn.total_tokens) == (3, 1, [1, 4], 5)


def test_validate_tensor_shape_wants_rank_one_and_total_rows():
    metadata = AFDTransferMetadata.create_ffn_metadata(2, 0, [1, 4])

    metadata.validate_tensor_shape((5, 2048))
    metadata.validate_tensor_shape([5])
    with pytest.raises(ValueError, match="tensor has rank 0"):
        metadata.validate_tensor_shape(())
    with pytest.raises(ValueError, match=r"tensor has 4 rows \(shape \[4, 2048\]\); expected total_tokens=5"):
        metadata.validate_tensor_shape((4, 2048))


def test_context_and_payload_defaults_are_literal_none():
    metadata = AFDTransferMetadata.create_attention_metadata(0, 0, 1)

    context = AFDTransferContext(metadata)
    payload = AFDA2FTransferPayload("hidden", context)

    assert {f.name: f.default for f in dataclasses.fields(AFDTransferContext)}["states"] is None
    assert context.states is None and payload.router_logits is None


def test_routing_spec_is_static_and_positive():
    spec = AFDExpertRoutingSpec(8, "bfloat16")

    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.router_logits_width = 4
    with pytest.raises(ValueError, match="router_logits_width must be positive, got 0"):
        AFDExpertRoutingSpec(0, "bfloat16")


# --- forward-context sidecar ----------------------------------------------------------------------


def test_single_stage_sidecar_clamps_rows_and_keeps_the_real_length():
    sidecar = AFDForwardContextMetadata.single_stage(0, connector_handle=3, published=False)
    padded = AFDForwardContextMetadata.single_stage(64, num_unpadded_tokens=1, connector_handle=3, published=True)

    assert (sidecar.tokens_start_loc, sidecar.requests_start_loc, sidecar.num_stages) == ([0], [0], 1)
    assert (sidecar.tokens_lens, sidecar.tokens_unpadded_lens, sidecar.published) == ([1], [0], False)
    assert (padded.tokens_lens, padded.tokens_unpadded_lens, padded.connector_handle) == ([64], [1], 3)
    assert sidecar.transaction_id.startswith("afd-") and not sidecar.is_profile


def test_transaction_ids_are_unique_and_increasing():
    ids = [int(next_transaction_id().removeprefix("afd-")) for _ in range(5)]

    assert ids == sorted(set(ids))


def test_clone_copies_the_lists():
    sidecar = AFDForwardContextMetadata.single_stage(5, connector_handle=1, published=False)

    copied = sidecar.clone()
    copied.tokens_lens.append(9)
    copied.published = True

    assert sidecar.tokens_lens == [5] and not sidecar.published
    assert copied.transaction_id == sidecar.transaction_id


@pytest.mark.parametrize(("changes", "text"), [
    ({"num_stages": 2}, "per-stage lists have lengths"),
    ({"stage_idx": 1}, r"stage_idx 1 not in \[0, 1\)"),
    ({"tokens_lens": [0]}, "must be >= 1"),
])
def test_inconsistent_sidecar_is_rejected(changes, text):
    sidecar = AFDForwardContextMetadata.single_stage(5, connector_handle=1, published=True)

    with pytest.raises(ValueError, match=text):
        dataclasses.replace(sidecar, **changes)
