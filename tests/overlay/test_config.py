"""vllm_afd.config: parsing, coercion, validation order and messages (docs/config.md)."""

import copy
import dataclasses
import json
import pickle
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

import vllm_afd
from vllm_afd.config import (ALIASES, CONNECTORS, NUM_STAGES, ROLES, RUNTIME_ONLY_FIELDS, AFDConfig,
                             check_p2p_extra_config, get_additional_config, parse_afd_config, require_afd_config)

CAM_MESSAGE = ("is an Ascend CAM connector and is not supported; use 'P2pNcclAFDConnector' (CUDA, across hosts), "
               "'P2pIpcAFDConnector' (CUDA, one node) or 'P2pGlooAFDConnector' (CPU, eager)")
ASYNC_MESSAGE = ("AFD async mode requires connector='CAMAsyncAFDConnector', which is not supported; "
                 "remove 'async_dp' or set it to false")
UNKNOWN = "unknown AFD config field {!r}; connector-specific values belong under connector_extra_config"
UNKNOWN_CONNECTOR = ("AFD connector must be one of ('P2pNcclAFDConnector', 'P2pGlooAFDConnector', "
                     "'P2pIpcAFDConnector')")
DUPLICATE_PORT = "duplicate AFD config field for 'port' (given as 'afd_port' and 'port')"

# id -> (afd mapping, text the message must contain); one table per exception type.
BAD_TYPES = {
    "bool-two": ({"compute_gate_on_attention": 2}, "compute_gate_on_attention must be a boolean, got 2"),
    "bool-word": ({"compute_gate_on_attention": "maybe"}, "compute_gate_on_attention must be a boolean, got 'maybe'"),
    "bool-float": ({"compute_gate_on_attention": 1.0}, "compute_gate_on_attention must be a boolean, got 1.0"),
    "async-word": ({"async_dp": "sometimes"}, "async must be a boolean, got 'sometimes'"),
    "async-alias-none": ({"async": None}, "async must be a boolean, got None"),
    "int-bool": ({"port": True}, "port must be an integer, got True"),
    "int-float": ({"num_attention_ranks": 2.0}, "num_attention_ranks must be an integer, got 2.0"),
    "int-float-string": ({"num_ffn_ranks": "1.5"}, "num_ffn_ranks must be an integer, got '1.5'"),
    "int-none": ({"port": None}, "port must be an integer, got None"),
    "int-decimal": ({"port": Decimal("1.5")}, "port must be an integer, got Decimal('1.5')"),
    "stages-bool": ({"num_stages": True}, "num_stages must be an integer, got True"),
    "min-tokens-bool": ({"min_tokens_per_stage": False}, "min_tokens_per_stage must be an integer, got False"),
    "stages-float": ({"num_stages": 2.5}, "num_stages must be an integer, got 2.5"),
    "seconds-bool": ({"step_timeout_s": True}, "step_timeout_s must be a number of seconds, got True"),
    "seconds-word": ({"peer_timeout_s": "soon"}, "peer_timeout_s must be a number of seconds, got 'soon'"),
    "seconds-list": ({"rendezvous_timeout_s": [1]}, "rendezvous_timeout_s must be a number of seconds, got [1]"),
    "string-int": ({"role": 1}, "role must be a string, got 1"),
    "string-none": ({"connector": None}, "connector must be a string, got None"),
    "string-bytes": ({"host": b"h"}, "host must be a string, got b'h'"),
    "extra-list": ({"connector_extra_config": []}, "connector_extra_config must be a mapping"),
}
BAD_VALUES = {
    "alias-and-canonical": ({"afd_port": 1, "port": 2}, DUPLICATE_PORT),
    "canonical-then-alias": ({"port": 2, "afd_port": 1}, DUPLICATE_PORT),
    "role-twice": ({"role": "ffn", "afd_role": "ffn"},
                   "duplicate AFD config field for 'role' (given as 'afd_role' and 'role')"),
    "async-twice": ({"async": False, "async_dp": False},
                    "duplicate AFD config field for 'async_dp' (given as 'async' and 'async_dp')"),
    "typo": ({"conector": "P2pNcclAFDConnector"}, UNKNOWN.format("conector")),
    "non-string-key": ({1: 2}, "unknown AFD config field 1;"),
    **{f"runtime-only-{name}": ({name: 0}, f"{UNKNOWN.format(name)}; {hint}")
       for name, hint in RUNTIME_ONLY_FIELDS.items()},
    "role-typo": ({"role": "ffm"}, "AFD role must be one of ('attention', 'ffn'), got 'ffm'"),
    "role-case": ({"afd_role": "FFN"}, "AFD role must be one of ('attention', 'ffn'), got 'FFN'"),
    "cam-p2p": ({"connector": "CAMP2pAFDConnector"}, f"AFD connector 'CAMP2pAFDConnector' {CAM_MESSAGE}"),
    "cam-async": ({"afd_connector": "CAMAsyncAFDConnector"}, f"AFD connector 'CAMAsyncAFDConnector' {CAM_MESSAGE}"),
    "connector-unknown": ({"connector": "NcclConnector"}, f"{UNKNOWN_CONNECTOR}, got 'NcclConnector'"),
    "connector-case": ({"connector": "p2pncclafdconnector"}, f"{UNKNOWN_CONNECTOR}, got 'p2pncclafdconnector'"),
    "async-true": ({"async_dp": True}, ASYNC_MESSAGE),
    "async-alias-on": ({"async": " ON "}, ASYNC_MESSAGE),
    "attention-zero": ({"num_attention_ranks": 0}, "num_attention_ranks must be positive, got 0"),
    "ffn-zero": ({"num_ffn_ranks": "0"}, "num_ffn_ranks must be positive, got 0"),
    "ffn-negative": ({"num_ffn_ranks": -1}, "num_ffn_ranks must be positive, got -1"),
    "fewer-attention": ({"num_attention_ranks": 1, "num_ffn_ranks": 2},
                        "P2pNcclAFDConnector requires num_attention_ranks >= num_ffn_ranks, got 1 < 2"),
    "fewer-attention-gloo": ({"connector": "P2pGlooAFDConnector", "num_attention_ranks": 2, "num_ffn_ranks": 3},
                             "P2pGlooAFDConnector requires num_attention_ranks >= num_ffn_ranks, got 2 < 3"),
    "stages-zero": ({"num_stages": 0}, "num_stages must be one of (1, 2, 3), got 0; set the micro-batches per"),
    "stages-four": ({"num_stages": "4"}, "num_stages must be one of (1, 2, 3), got 4"),
    "min-tokens-zero": ({"min_tokens_per_stage": 0}, "min_tokens_per_stage must be >= 1, got 0; set the fewest"),
    "host-empty": ({"host": ""}, "AFD host must be non-empty"),
    "host-blank": ({"afd_host": "  \t"}, "AFD host must be non-empty"),
    "port-zero": ({"port": 0}, "AFD port must be in 1..65535, got 0"),
    "port-too-big": ({"port": "65536"}, "AFD port must be in 1..65535, got 65536"),
    "timeout-zero": ({"rendezvous_timeout_s": 0}, "rendezvous_timeout_s must be positive and finite, got 0.0"),
    "timeout-negative": ({"step_timeout_s": -1}, "step_timeout_s must be positive and finite, got -1.0"),
    "timeout-inf": ({"peer_timeout_s": "inf"}, "peer_timeout_s must be positive and finite, got inf"),
    "timeout-nan": ({"peer_timeout_s": float("nan")}, "peer_timeout_s must be positive and finite, got nan"),
    "startup-timeout-zero": ({"startup_timeout_s": 0}, "startup_timeout_s must be positive and finite, got 0"),
    "extra-non-empty": ({"connector_extra_config": {"buffer": 1}},
                        "P2pNcclAFDConnector does not support connector_extra_config"),
    "integrity-ipc": ({"connector": "P2pIpcAFDConnector", "integrity": True},
                      "integrity=true is not supported with P2pIpcAFDConnector"),
}
BAD_CONFIGS = [(key, raw, TypeError, text) for key, (raw, text) in BAD_TYPES.items()] + [
    (key, raw, ValueError, text) for key, (raw, text) in BAD_VALUES.items()
]


@pytest.mark.parametrize(("raw", "error", "text"), [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_bad_config_is_rejected_with_its_message(raw, error, text):
    assert len(BAD_CONFIGS) >= 30
    with pytest.raises(error) as info:
        AFDConfig.from_mapping(raw)

    assert type(info.value) is error
    assert text in str(info.value)


@pytest.mark.parametrize(
    ("raw", "text"),
    [
        # Step 3 (keys) before step 4 (coercion): duplicate first, then unknown.
        ({"port": "x", "afd_port": 1, "bogus": 1}, "duplicate AFD config field for 'port'"),
        ({"port": "x", "bogus": 1}, "unknown AFD config field 'bogus'"),
        # Step 4 coerces in canonical order, whatever the input order.
        ({"peer_timeout_s": "x", "role": 5}, "role must be a string"),
        ({"port": "x", "role": "nope"}, "port must be an integer"),
        # Step 5 role before step 7 connector; step 7 before step 8 async; 8 before 9.
        ({"role": "nope", "connector": "nope"}, "AFD role must be one of"),
        ({"connector": "CAMAsyncAFDConnector", "async_dp": True}, "is an Ascend CAM connector"),
        ({"async_dp": True, "num_ffn_ranks": 0}, "AFD async mode requires"),
        # Step 9: positivity before topology (the reference divides by F first), attention first.
        ({"num_attention_ranks": 0, "num_ffn_ranks": 0}, "num_attention_ranks must be positive"),
        ({"num_attention_ranks": 1, "num_ffn_ranks": 0}, "num_ffn_ranks must be positive, got 0"),
        # Step 10 before 11, 11 in host / port / timeouts order, then step 12.
        ({"num_ffn_ranks": 2, "host": ""}, "requires num_attention_ranks >= num_ffn_ranks"),
        ({"host": " ", "port": 0}, "AFD host must be non-empty"),
        ({"port": 0, "step_timeout_s": 0}, "AFD port must be in 1..65535"),
        ({"step_timeout_s": 0, "rendezvous_timeout_s": 0}, "rendezvous_timeout_s must be positive"),
        ({"peer_timeout_s": 0, "connector_extra_config": {"a": 1}}, "peer_timeout_s must be positive"),
    ],
)
def test_validation_stops_at_the_first_failure_in_spec_order(raw, text):
    with pytest.raises((TypeError, ValueError), match=text):
        AFDConfig.from_mapping(raw)


def test_role_mismatch_is_checked_after_the_role_and_before_the_connector():
    with pytest.raises(ValueError, match="AFD role mismatch: expected 'attention', got 'ffn'"):
        AFDConfig.from_mapping({"role": "ffn", "connector": "nope"}, expected_role="attention")
    with pytest.raises(ValueError, match="AFD role must be one of"):
        AFDConfig.from_mapping({"role": "nope"}, expected_role="attention")


def test_expected_role_must_be_a_role():
    assert AFDConfig.from_mapping({"role": "ffn"}, expected_role="ffn").role == "ffn"
    with pytest.raises(ValueError, match="expected_role must be one of"):
        AFDConfig.from_mapping({"role": "ffn"}, expected_role="moe")


def test_unknown_field_message_lists_the_valid_fields_and_a_close_match():
    with pytest.raises(ValueError, match="did you mean 'connector'. Valid fields: role, connector, host, port, num_"):
        AFDConfig.from_mapping({"conector": "P2pNcclAFDConnector"})


def test_defaults_match_the_spec_table():
    assert AFDConfig.from_mapping({}).to_mapping() == dict(
        role="attention", connector="P2pNcclAFDConnector", host="127.0.0.1", port=1239, num_attention_ranks=1,
        num_ffn_ranks=1, compute_gate_on_attention=False, num_stages=1, min_tokens_per_stage=4,
        connector_extra_config={}, rendezvous_timeout_s=300.0,
        step_timeout_s=120.0, peer_timeout_s=5.0, startup_timeout_s=1800.0, reform_timeout_s=600.0, timeline_dir="",
        secret_file="", integrity=False,
    )


@pytest.mark.parametrize("value", [0, 0.5, "30"])
def test_reform_timeout_takes_zero_to_disable_and_any_finite_seconds(value):
    assert AFDConfig.from_mapping({"reform_timeout_s": value}).reform_timeout_s == float(value)


@pytest.mark.parametrize("value", [-1, float("inf"), float("nan")])
def test_reform_timeout_refuses_negative_and_infinite_naming_the_key_and_the_fix(value):
    with pytest.raises(ValueError, match=r"reform_timeout_s must be finite and >= 0.*or 0 to end instead"):
        AFDConfig.from_mapping({"reform_timeout_s": value})


@pytest.mark.parametrize(("alias", "canonical"), list(ALIASES.items()))
def test_each_alias_normalises_to_its_canonical_key(alias, canonical):
    values = {"role": "ffn", "connector": "P2pGlooAFDConnector", "port": 6390, "host": "10.0.0.1", "async_dp": False}
    value = values[canonical]

    by_alias = AFDConfig.from_mapping({alias: value})
    by_name = AFDConfig.from_mapping({canonical: value})

    assert by_alias == by_name


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(True, True), (False, False), (1, True), (0, False), ("1", True), ("0", False), (" TRUE ", True),
     ("False", False), ("yes", True), ("No", False), ("on", True), ("OFF", False)],
)
def test_booleans_accept_bool_one_zero_and_the_word_lists(raw, expected):
    assert AFDConfig.from_mapping({"compute_gate_on_attention": raw}).compute_gate_on_attention is expected


class _IntLike:
    def __int__(self):
        return 4


@pytest.mark.parametrize(("raw", "expected"), [(4, 4), ("4", 4), (" 4 ", 4), (_IntLike(), 4), (Decimal(4), 4)])
def test_integers_accept_int_likes(raw, expected):
    config = AFDConfig.from_mapping({"num_attention_ranks": raw})

    assert config.num_attention_ranks == expected
    assert type(config.num_attention_ranks) is int


@pytest.mark.parametrize(("raw", "expected"), [(7, 7.0), (2.5, 2.5), ("3", 3.0), (" 0.25 ", 0.25)])
def test_seconds_accept_numbers_and_numeric_strings(raw, expected):
    config = AFDConfig.from_mapping({"step_timeout_s": raw})

    assert config.step_timeout_s == expected
    assert type(config.step_timeout_s) is float


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"host": " ffn0.local "}, AFDConfig(host="ffn0.local")),
        # No divisibility rule (ours = reference PR #309).
        ({"num_attention_ranks": 3, "num_ffn_ranks": 2}, AFDConfig(num_attention_ranks=3, num_ffn_ranks=2)),
        ({"num_attention_ranks": "5", "num_ffn_ranks": 2}, AFDConfig(num_attention_ranks=5, num_ffn_ranks=2)),
        # async_dp=false is ignored and not kept.
        ({"async": "false"}, AFDConfig()),
        ({"async_dp": 0}, AFDConfig()),
    ],
)
def test_accepted_configs(raw, expected):
    config = AFDConfig.from_mapping(raw)

    assert config == expected
    assert "async_dp" not in config.to_mapping()


def test_direct_construction_obeys_the_same_rules():
    assert AFDConfig(port="6390").port == 6390
    with pytest.raises(ValueError, match="num_ffn_ranks must be positive, got 0"):
        AFDConfig(num_ffn_ranks=0)
    with pytest.raises(TypeError, match="port must be an integer, got True"):
        AFDConfig(port=True)


def test_config_is_frozen_and_its_extra_config_immutable_and_copied():
    given_extra = {}
    config = AFDConfig.from_mapping({"connector_extra_config": given_extra})

    given_extra["late"] = 1

    assert dict(config.connector_extra_config) == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.port = 1
    with pytest.raises(TypeError):
        config.connector_extra_config["x"] = 1


def test_config_pickles_copies_and_hashes():
    config = AFDConfig.from_mapping({"role": "ffn", "num_attention_ranks": 4, "num_ffn_ranks": 2})

    assert all(pickle.loads(pickle.dumps(config, protocol)) == config
               for protocol in range(pickle.HIGHEST_PROTOCOL + 1))
    assert copy.deepcopy(config) == config
    assert hash(config) == hash(AFDConfig.from_mapping(config.to_mapping()))
    assert config.num_role_ranks == 2


def test_p2p_extra_config_rule_for_connectors():
    assert dict(check_p2p_extra_config("P2pGlooAFDConnector", {})) == {}
    with pytest.raises(TypeError, match="P2P connector_extra_config must be a mapping"):
        check_p2p_extra_config("P2pGlooAFDConnector", "x")
    with pytest.raises(ValueError, match="P2pGlooAFDConnector does not support connector_extra_config"):
        check_p2p_extra_config("P2pGlooAFDConnector", {"a": 1})


# --- sources and activation (docs/config.md#activation-and-sources) ------------------------------------------------


@pytest.mark.parametrize("src", [None, {}, {"other": 1}, SimpleNamespace(additional_config=None),
                                 SimpleNamespace(additional_config={})])
def test_absent_afd_is_inactive(src):
    assert parse_afd_config(src) is None


def test_present_afd_is_active_from_a_mapping_or_an_object():
    additional = {"afd": {"role": "ffn"}}

    for src in (additional, SimpleNamespace(additional_config=additional)):
        assert get_additional_config(src) is additional
        assert parse_afd_config(src, expected_role="ffn").role == "ffn"


@pytest.mark.parametrize(("src", "error", "text"), [
    ({"afd": {"role": "nope"}}, ValueError, "AFD role must be one of"),  # present and invalid never deactivates
    (SimpleNamespace(), AttributeError, "has no attribute 'additional_config'"),
    (SimpleNamespace(additional_config='{"afd": {}}'), TypeError, "additional_config must be a mapping, got str"),
    ({"afd": None}, TypeError, "AFD config must be a mapping, got NoneType"),
    ({"afd": [("role", "ffn")]}, TypeError, "AFD config must be a mapping, got list"),
])
def test_steps_one_and_two_reject_the_source_shape(src, error, text):
    with pytest.raises(error, match=text):
        parse_afd_config(src)


def test_require_names_the_caller_when_afd_is_absent():
    with pytest.raises(ValueError, match=r'AFDFFNWorker requires additional_config\["afd"\]'):
        require_afd_config({}, "AFDFFNWorker")

    assert require_afd_config({"afd": {}}, "AFDAttentionWorker", expected_role="attention").role == "attention"


def test_real_engine_args_carry_the_config_from_the_command_line(tmp_path):
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # NOTE: a local folder, not a hub name: EngineArgs resolves a hub name through huggingface_hub, whose
    # offline switch another test's import may have frozen on (the result then depends on test order).
    model = str(tmp_path)
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", model, "--additional-config", '{"afd": {"afd_role": "ffn", "port": "6390"}}'])

    engine_args = EngineArgs.from_cli_args(args)

    assert parse_afd_config(engine_args) == AFDConfig(role="ffn", port=6390)
    assert parse_afd_config(EngineArgs(model=model)) is None


# --- properties ---------------------------------------------------------------------------------

_hosts = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789.-", min_size=1, max_size=20)
_seconds = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False, allow_infinity=False)


@st.composite
def afd_mappings(draw):
    num_attention_ranks = draw(st.integers(1, 64))
    connector = draw(st.sampled_from(CONNECTORS))
    return {
        "role": draw(st.sampled_from(ROLES)),
        "connector": connector,
        "host": draw(_hosts),
        "port": draw(st.integers(1, 65535)),
        "num_attention_ranks": num_attention_ranks,
        "num_ffn_ranks": draw(st.integers(1, num_attention_ranks)),
        "compute_gate_on_attention": draw(st.booleans()),
        "num_stages": draw(st.sampled_from(NUM_STAGES)),
        "min_tokens_per_stage": draw(st.integers(1, 4096)),
        "connector_extra_config": {},
        "rendezvous_timeout_s": draw(_seconds),
        "step_timeout_s": draw(_seconds),
        "peer_timeout_s": draw(_seconds),
        "startup_timeout_s": draw(_seconds),
        "reform_timeout_s": draw(st.just(0.0) | _seconds),
        "timeline_dir": draw(st.sampled_from(["", "/tmp/afd-timeline", "rel/dir"])),
        "secret_file": "",  # a path must name a readable file: tests/overlay/test_config_secret_file.py
        "integrity": draw(st.booleans()) if connector != "P2pIpcAFDConnector" else False,
    }


@given(afd_mappings())
def test_round_trip_through_to_mapping_and_json(raw):
    config = AFDConfig.from_mapping(raw)

    assert config.to_mapping() == raw
    assert AFDConfig.from_mapping(config.to_mapping()) == config
    assert AFDConfig.from_mapping(json.loads(json.dumps(config.to_mapping()))) == config


@given(afd_mappings(), st.randoms())
def test_string_valued_and_reordered_input_parses_to_the_same_config(raw, random):
    as_strings = {key: value if isinstance(value, dict) else str(value) for key, value in raw.items()}
    keys = list(as_strings)
    random.shuffle(keys)

    parsed = AFDConfig.from_mapping({key: as_strings[key] for key in keys})

    assert parsed == AFDConfig.from_mapping(raw)


def test_one_stage_is_the_default():
    assert AFDConfig.from_mapping({}).num_stages == 1 == AFDConfig().num_stages


@pytest.mark.parametrize("num_stages", [2, 3])
def test_every_stage_count_parses(num_stages):
    """Micro-batch stages (docs/pingpong.md): 2 and 3 parse on every platform and run on both attention runners."""
    config = AFDConfig.from_mapping({"num_stages": str(num_stages)})

    assert config.num_stages == num_stages == AFDConfig(num_stages=num_stages).num_stages
    assert AFDConfig.from_mapping(config.to_mapping()) == config


def test_config_module_imports_without_torch_or_vllm():
    overlay_root = Path(vllm_afd.__file__).resolve().parents[1]
    code = (
        "import sys, vllm_afd.config, vllm_afd.plugin, vllm_afd.models, vllm_afd.wire.topology, "
        "vllm_afd.wire.placement, vllm_afd.wire.handshake, vllm_afd.wire.errors, vllm_afd.wire.messages, "
        "vllm_afd.wire.steps; assert 'torch' not in sys.modules and 'vllm' not in sys.modules, "
        "sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm'))"
    )

    env = {"PYTHONPATH": str(overlay_root)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)

    assert result.returncode == 0, result.stderr
