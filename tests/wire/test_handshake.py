"""vllm_afd.wire.handshake: fingerprints and their comparison (docs/connection.md#handshake)."""

import dataclasses
import json
import os
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_afd.wire.errors import AFDConfigMismatchError, AFDLayoutError, AFDProtocolError
from vllm_afd.wire.handshake import (
    GLOBAL_FIELDS,
    PROTOCOL_VERSION,
    Fingerprint,
    compare_fingerprints,
)
from vllm_afd.wire.placement import Placement

MODEL_FACTS = dict(
    overlay_version="0.1.0",
    vllm_version="0.30.0",
    architecture="Qwen3MoeForCausalLM",
    hidden_size=2048,
    num_hidden_layers=4,
    dtype="bfloat16",
    layer_kinds="DMMM",
    num_routed_experts=8,
    graph_mode="eager",
    config_digest="sha256:c0c0c0c0c0c0c0c0",
    weights_digest="sha256:0123456789abcdef",
    checkpoint="/models/qwen3_moe",
)


def fingerprints(num_attention=(1, 1), num_ffn=(1, 1), overrides=None):
    """Fingerprints of a whole deployment: attention DPxTP ``num_attention``, FFN DPxTP ``num_ffn``."""
    sizes = (num_attention[0] * num_attention[1], num_ffn[0] * num_ffn[1])
    result = []
    for role, (dp, tp) in (("ffn", num_ffn), ("attention", num_attention)):
        for role_rank in range(dp * tp):
            facts = {**MODEL_FACTS, "device": f"cuda:{role_rank}", **(overrides or {}).get((role, role_rank), {})}
            result.append(
                Fingerprint.for_rank(Placement(role, role_rank, *sizes, dp, tp), connector="P2pNcclAFDConnector",
                                     compute_gate_on_attention=False, hostname="h", pid=100 + role_rank, **facts)
            )
    return result


def by_label(prints):
    return {fp.label: fp for fp in prints}


def test_for_rank_fills_role_and_rank_facts_from_the_placement():
    placement = Placement("ffn", 1, 4, 2, dp_size=2, tp_size=1)

    fingerprint = Fingerprint.for_rank(placement, connector="P2pNcclAFDConnector", compute_gate_on_attention=True,
                                       device="cpu", **MODEL_FACTS)

    assert fingerprint.protocol_version == PROTOCOL_VERSION == 5
    assert (fingerprint.role, fingerprint.role_rank, fingerprint.label) == ("ffn", 1, "ffn rank 1")
    assert (fingerprint.num_attention_ranks, fingerprint.num_ffn_ranks) == (4, 2)
    assert (fingerprint.dp_size, fingerprint.tp_size) == (2, 1)
    assert fingerprint.compute_gate_on_attention and fingerprint.connector == "P2pNcclAFDConnector"
    assert fingerprint.num_stages == 1  # the default: no micro-batch ping-pong
    assert (fingerprint.hostname, fingerprint.pid) == (socket.gethostname(), os.getpid())


def test_for_rank_needs_every_model_fact():
    placement = Placement("attention", 0, 1, 1)
    facts = {name: value for name, value in MODEL_FACTS.items() if name != "layer_kinds"}

    with pytest.raises(TypeError, match="layer_kinds"):
        Fingerprint.for_rank(placement, connector="c", compute_gate_on_attention=False, device="cpu", **facts)


def test_json_round_trip_is_compact_and_sorted():
    fingerprint = fingerprints()[0]

    text = fingerprint.to_json()

    assert Fingerprint.from_json(text) == fingerprint
    assert Fingerprint.from_json(text.encode()) == fingerprint
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))


@pytest.mark.parametrize("layout", [((1, 1), (1, 1)), ((2, 1), (1, 1)), ((2, 2), (2, 2)), ((1, 4), (1, 2)),
                                    ((3, 1), (2, 1))])
def test_agreeing_ranks_pass_on_every_rank(layout):
    prints = fingerprints(*layout)

    for local in prints:
        compare_fingerprints(local, prints)


def test_mismatch_message_names_each_field_with_both_values():
    prints = by_label(fingerprints(overrides={("ffn", 0): {"hidden_size": 4096, "dtype": "float16"}}))

    with pytest.raises(AFDConfigMismatchError) as info:
        compare_fingerprints(prints["attention rank 0"], [prints["ffn rank 0"]])

    assert isinstance(info.value, ValueError)
    assert (
        "AFD configuration mismatch between attention rank 0 and ffn rank 0: hidden_size (attention=2048, "
        "ffn=4096); dtype (attention=bfloat16, ffn=float16). Launch both roles with the same model, dtype "
        "and AFD settings."
    ) in str(info.value)
    assert "ffn rank 0 on h (pid 100, device cuda:0)" in str(info.value)


_OTHER_VALUES = {
    "protocol_version": 1, "overlay_version": "0.2.0", "vllm_version": "0.31.0",
    "architecture": "DeepseekV2ForCausalLM", "hidden_size": 1024, "num_hidden_layers": 3, "dtype": "float16",
    "layer_kinds": "DDMM", "num_routed_experts": 16, "connector": "P2pGlooAFDConnector",
    "num_attention_ranks": 2, "num_ffn_ranks": 2, "compute_gate_on_attention": True, "num_stages": 2,
    "integrity": True, "graph_mode": "FULL_DECODE_ONLY", "config_digest": "sha256:c1c1c1c1c1c1c1c1",
    "weights_digest": "sha256:fedcba9876543210",
}


def test_every_global_field_is_compared():
    assert set(_OTHER_VALUES) == set(GLOBAL_FIELDS)


@pytest.mark.parametrize("name", GLOBAL_FIELDS)
def test_a_differing_global_field_fails_on_both_sides(name):
    attention, ffn = fingerprints()[1], fingerprints()[0]
    changed = {name: _OTHER_VALUES[name]}
    if name == "num_hidden_layers":
        changed["layer_kinds"] = "DMM"
    ffn = dataclasses.replace(ffn, **changed)

    for local, peer, local_role, peer_role in ((attention, ffn, "attention", "ffn"),
                                               (ffn, attention, "ffn", "attention")):
        with pytest.raises(AFDConfigMismatchError) as info:
            compare_fingerprints(local, [peer])
        local_value, peer_value = getattr(local, name), getattr(peer, name)
        assert f"{name} ({local_role}={local_value}, {peer_role}={peer_value})" in str(info.value)


@pytest.mark.parametrize("layout", [((2, 1), (1, 1)), ((1, 4), (1, 2)), ((4, 2), (3, 1))])
def test_dp_and_tp_are_compared_only_within_a_role(layout):
    """Sizes that differ across roles are no mismatch; only the layout rule relates them."""
    prints = fingerprints(*layout)

    for local in prints:
        compare_fingerprints(local, prints)


def test_a_rank_disagreeing_within_its_role_fails_on_every_rank():
    prints = fingerprints((2, 1), (2, 1))
    labels = by_label(prints)
    prints[prints.index(labels["ffn rank 1"])] = dataclasses.replace(labels["ffn rank 1"], dp_size=1, tp_size=2)

    for local in prints:
        with pytest.raises(AFDConfigMismatchError, match=r"dp_size \((ffn rank \d|ffn)=\d, ") as info:
            compare_fingerprints(local, prints)
        assert "ffn rank 1" in str(info.value)


def test_mismatch_with_several_ranks_lists_the_others():
    prints = fingerprints((3, 1), (1, 1), overrides={("attention", r): {"dtype": "float32"} for r in (1, 2)})

    with pytest.raises(AFDConfigMismatchError) as info:
        compare_fingerprints(by_label(prints)["ffn rank 0"], prints)

    assert "between ffn rank 0 and attention rank 1: dtype (ffn=bfloat16, attention=float32)." in str(info.value)
    assert "Also differing: attention rank 2." in str(info.value)


@pytest.mark.parametrize("layout", [((2, 1), (1, 2)), ((2, 2), (1, 2))])
def test_invalid_layout_fails_on_every_rank(layout):
    prints = fingerprints(*layout)

    for local in prints:
        with pytest.raises(AFDLayoutError, match="AFD layout invalid: the TP peers of FFN DP rank 0 would receive"):
            compare_fingerprints(local, prints)


def test_layout_is_not_checked_without_the_other_role():
    prints = [fp for fp in fingerprints((2, 1), (1, 2)) if fp.role == "ffn"]

    compare_fingerprints(prints[0], prints)


@pytest.mark.parametrize("version", [1, 2, 3, 4, 6])
def test_peer_of_another_protocol_version_is_a_mismatch_even_if_unreadable(version):
    body = json.loads(fingerprints()[0].to_json())
    body.update(protocol_version=version, hidden_size=None)
    body.pop("layer_kinds")

    with pytest.raises(AFDConfigMismatchError) as info:
        Fingerprint.from_json(json.dumps(body))

    assert str(info.value) == (
        f"AFD configuration mismatch between this rank and ffn rank 0: protocol_version (local=5, peer={version}). "
        "Run the same vllm_afd version on every rank"
    )


def test_a_readable_peer_of_protocol_1_fails_the_comparison_on_both_sides():
    """Protocol 1 carried one count per attention DP rank; mixing it with 2 would mis-size every exchange."""
    attention, ffn = fingerprints()[1], fingerprints()[0]
    old = Fingerprint.from_json(dataclasses.replace(ffn, protocol_version=1).to_json())

    for local, peer in ((attention, old), (old, attention)):
        with pytest.raises(AFDConfigMismatchError,
                           match=r"protocol_version \((attention=5, ffn=1|ffn=1, attention=5)\)"):
            compare_fingerprints(local, [peer])


# (attention DP x TP, FFN DP x TP) of valid deployments (A >= F).
_LAYOUTS = [((1, 1), (1, 1)), ((2, 1), (1, 1)), ((1, 2), (1, 2)), ((2, 1), (2, 1)), ((3, 1), (1, 1))]


@given(st.sampled_from(_LAYOUTS), st.integers(1, 3), st.integers(1, 3), st.data())
def test_num_stages_must_be_equal_on_every_rank(layout, attention_stages, ffn_stages, data):
    """Micro-batch stages: a deployment whose roles split steps into different stage counts fails on every rank,
    naming both values, before any data channel exists."""
    prints = [dataclasses.replace(fp, num_stages=attention_stages if fp.role == "attention" else ffn_stages)
              for fp in fingerprints(*layout)]
    local = data.draw(st.sampled_from(prints))

    if attention_stages == ffn_stages:
        compare_fingerprints(local, prints)
        return
    with pytest.raises(AFDConfigMismatchError) as info:
        compare_fingerprints(local, prints)

    own, other = (attention_stages, ffn_stages) if local.role == "attention" else (ffn_stages, attention_stages)
    peer_role = "ffn" if local.role == "attention" else "attention"
    assert f"num_stages ({local.role}={own}, {peer_role}={other})" in str(info.value)


def test_for_rank_carries_num_stages():
    placement = Placement("attention", 0, 1, 1)

    fingerprint = Fingerprint.for_rank(placement, connector="c", compute_gate_on_attention=False, num_stages=3,
                                       device="cpu", **MODEL_FACTS)

    assert fingerprint.num_stages == 3
    assert Fingerprint.from_json(fingerprint.to_json()).num_stages == 3


@pytest.mark.parametrize("text", ["", "not json", "[]", f'{{"protocol_version": {PROTOCOL_VERSION}}}',
                                  f'{{"protocol_version": {PROTOCOL_VERSION}, "hidden_size": "2048"}}'])
def test_garbage_fingerprint_is_a_protocol_error(text):
    with pytest.raises(AFDProtocolError):
        Fingerprint.from_json(text)


@pytest.mark.parametrize(("changes", "error", "text"), [
    ({"hidden_size": "2048"}, TypeError, "hidden_size must be int, got '2048'"),
    ({"compute_gate_on_attention": 1}, TypeError, "compute_gate_on_attention must be bool, got 1"),
    ({"pid": True}, TypeError, "pid must be int, got True"),
    ({"role": "moe"}, ValueError, "role must be one of"),
    ({"layer_kinds": "DMM"}, ValueError, "must have one 'D' or 'M' per layer"),
    ({"layer_kinds": "DMXM"}, ValueError, "must have one 'D' or 'M' per layer"),
])
def test_fingerprint_fields_are_type_checked(changes, error, text):
    with pytest.raises(error, match=text):
        dataclasses.replace(fingerprints()[0], **changes)


# ---- checkpoint digests (docs/connection.md#checkpoint-digests) ---------------------------------------------


def test_other_weights_of_the_same_shapes_fail_on_both_sides_naming_both_checkpoints():
    """Regression: an FFN restarted on other weights of the same architecture and shapes served wrong tokens."""
    prints = by_label(fingerprints(overrides={("ffn", 0): {"weights_digest": "sha256:9999999999999999",
                                                           "checkpoint": "/other/qwen3_moe-seed1"}}))

    for local, peer in (("attention rank 0", "ffn rank 0"), ("ffn rank 0", "attention rank 0")):
        with pytest.raises(AFDConfigMismatchError) as info:
            compare_fingerprints(prints[local], [prints[peer]])
        message = str(info.value)
        assert "weights_digest (" in message and "ffn=sha256:9999999999999999" in message
        assert "attention=sha256:0123456789abcdef" in message
        assert "The roles loaded different checkpoints: " in message
        assert ("attention rank 0 loaded /models/qwen3_moe (weights sha256:0123456789abcdef, config "
                "sha256:c0c0c0c0c0c0c0c0)") in message
        assert "ffn rank 0 loaded /other/qwen3_moe-seed1 (weights sha256:9999999999999999" in message
        assert "Start both roles on the same checkpoint" in message


def test_copies_of_one_checkpoint_at_different_paths_agree():
    prints = fingerprints(overrides={("ffn", 0): {"checkpoint": "/mnt/host2/copy"}})

    for local in prints:
        compare_fingerprints(local, prints)


def test_dummy_weights_on_one_role_only_are_a_mismatch():
    prints = by_label(fingerprints(overrides={("ffn", 0): {"weights_digest": "dummy"}}))

    expected = r"weights_digest \(attention=sha256:0123456789abcdef, ffn=dummy\)"
    with pytest.raises(AFDConfigMismatchError, match=expected):
        compare_fingerprints(prints["attention rank 0"], [prints["ffn rank 0"]])


_DIGESTS = st.sampled_from(["sha256:0123456789abcdef", "sha256:fedcba9876543210", "dummy", "unknown (not given)",
                            "unknown ('org/model' is not a local path and not in the hub cache yet)"])


@given(field=st.sampled_from(["config_digest", "weights_digest"]), ffn_digest=_DIGESTS, attention_digest=_DIGESTS)
def test_a_digest_is_compared_unless_either_side_could_not_compute_it(field, ffn_digest, attention_digest):
    overrides = {("ffn", 0): {field: ffn_digest}, ("attention", 0): {field: attention_digest}}
    prints = by_label(fingerprints(overrides=overrides))
    unknown = ffn_digest.startswith("unknown") or attention_digest.startswith("unknown")

    if unknown or ffn_digest == attention_digest:
        compare_fingerprints(prints["attention rank 0"], [prints["ffn rank 0"]])
    else:
        with pytest.raises(AFDConfigMismatchError, match=f"{field} "):
            compare_fingerprints(prints["attention rank 0"], [prints["ffn rank 0"]])


def test_callers_without_a_model_publish_unknown_digests():
    placement = Placement("attention", 0, 1, 1)
    facts = {name: value for name, value in MODEL_FACTS.items()
             if name not in ("config_digest", "weights_digest", "checkpoint")}

    fingerprint = Fingerprint.for_rank(placement, connector="c", compute_gate_on_attention=False, device="cpu", **facts)

    assert fingerprint.weights_digest.startswith("unknown") and fingerprint.config_digest.startswith("unknown")
    assert Fingerprint.from_json(fingerprint.to_json()) == fingerprint


def test_max_rows_is_compared_within_a_role_only():
    """The attention's max_rows bounds what it publishes; an FFN launched with another max_num_batched_tokens
    still pairs, two attention ranks that disagree do not."""
    prints = by_label(fingerprints((2, 1), (1, 1), overrides={("ffn", 0): {"max_rows": 64},
                                                               ("attention", 1): {"max_rows": 4096}}))
    compare_fingerprints(prints["ffn rank 0"], [prints["attention rank 0"]])

    with pytest.raises(AFDConfigMismatchError, match=r"max_rows \(attention rank 0=1048576, attention rank 1=4096\)"):
        compare_fingerprints(prints["attention rank 0"], [prints["attention rank 1"]])


@pytest.mark.parametrize("max_rows", [0, -1, (1 << 20) + 1])
def test_a_max_rows_outside_its_bounds_is_refused(max_rows):
    body = json.loads(fingerprints()[0].to_json())
    body["max_rows"] = max_rows

    with pytest.raises(AFDProtocolError, match="max_rows must be in 1..1048576"):
        Fingerprint.from_json(json.dumps(body))
