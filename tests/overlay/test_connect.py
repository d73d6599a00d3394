"""vllm_afd.connect and the parse a role config carries: registry, placement, fingerprint, connector.

Built from real ``VllmConfig``s of a tiny Qwen3-MoE (config.json only); nothing here communicates
(docs/connection.md#handshake for what the fingerprint is compared against).
"""

from __future__ import annotations

import pickle
import socket
import threading

import pytest
import torch

pytest.importorskip("vllm")
from tests.connectors._harness import free_port
from tests.connectors._vllm_configs import make_vllm_config

from vllm_afd.config import CONNECTORS, ParsedAdditionalConfig, afd_config_of, parse_afd_config
from vllm_afd.connect import (
    TRANSPORTS,
    build_connector,
    build_fingerprint,
    build_placement,
    native_architecture,
)
from vllm_afd.wire.handshake import PROTOCOL_VERSION
from vllm_afd.wire.placement import Placement
from vllm_afd.wire.transports.gloo import GlooTransport

GLOO = {"connector": "P2pGlooAFDConnector"}



# ---- registry ---------------------------------------------------------------------------------------


def test_the_transport_registry_names_exactly_the_configurable_connectors():
    assert sorted(TRANSPORTS) == sorted(CONNECTORS)


def test_each_name_builds_its_transport_without_communicating():
    gloo = TRANSPORTS["P2pGlooAFDConnector"](torch.device("cpu"))

    assert isinstance(gloo, GlooTransport)
    assert gloo.device == torch.device("cpu")
    with pytest.raises(ValueError, match="P2pNcclAFDConnector: device cpu is not a CUDA device; NCCL moves GPU "
                                         "memory. Use P2pGlooAFDConnector on CPU"):
        TRANSPORTS["P2pNcclAFDConnector"](torch.device("cpu"))


def test_vllm_builds_a_communicator_from_unique_id_bytes_without_a_process_group():
    """The NCCL transport's seam (connect._pynccl_communicator): no StatelessProcessGroup, whose constructor
    unpickles the unique id from the store; the id's size is the transport's check."""
    import ctypes
    import inspect

    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary, ncclUniqueId

    from vllm_afd.wire.transports.nccl import NCCL_UNIQUE_ID_BYTES

    parameters = list(inspect.signature(PyNcclCommunicator.from_unique_id_bytes).parameters)

    assert parameters[:4] == ["unique_id_bytes", "rank", "world_size", "device"]
    assert ctypes.sizeof(ncclUniqueId) == len(bytes(ncclUniqueId().internal)) == NCCL_UNIQUE_ID_BYTES
    assert "ncclGetUniqueId" in vars(NCCLLibrary)


# ---- placement: vLLM's DP rank and TP rank ----------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_tp_group(model_dir):
    """vLLM's world of one (gloo) with its TP group, which build_placement asks for its TP rank."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    with set_current_vllm_config(make_vllm_config(model_dir, role="ffn", **GLOO)):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
                                     local_rank=0, backend="gloo")
        ensure_model_parallel_initialized(1, 1)
        yield
        destroy_model_parallel()
        destroy_distributed_environment()


@pytest.mark.parametrize(("role", "data_parallel", "num_attention", "expected"), [
    ("ffn", (1, 0), 2, Placement("ffn", 0, 2, 1)),
    ("attention", (2, 1), 2, Placement("attention", 1, 2, 1, dp_size=2)),
])
def test_placement_takes_the_role_from_the_config_and_the_ranks_from_vllm(
        model_dir, vllm_tp_group, role, data_parallel, num_attention, expected):
    vllm_config = make_vllm_config(model_dir, data_parallel=data_parallel, role=role,
                                   num_attention_ranks=num_attention, **GLOO)

    placement = build_placement(vllm_config, parse_afd_config(vllm_config))

    assert placement == expected


def test_placement_refuses_a_role_size_other_than_vllms_dp_times_tp(model_dir, vllm_tp_group):
    vllm_config = make_vllm_config(model_dir, role="attention", num_attention_ranks=2, **GLOO)

    with pytest.raises(ValueError, match="attention DP x TP = 1 x 1 differs from num_attention_ranks=2"):
        build_placement(vllm_config, parse_afd_config(vllm_config))


# ---- fingerprint ------------------------------------------------------------------------------------


def test_fingerprint_reads_the_model_facts_from_the_real_config(model_dir):
    import vllm

    import vllm_afd

    vllm_config = make_vllm_config(model_dir, role="ffn", num_attention_ranks=2, **GLOO)

    fingerprint = build_fingerprint(vllm_config, parse_afd_config(vllm_config), Placement("ffn", 0, 2, 1))

    assert (fingerprint.architecture, fingerprint.hidden_size, fingerprint.num_hidden_layers) == (
        "Qwen3MoeForCausalLM", 128, 4)
    assert (fingerprint.dtype, fingerprint.layer_kinds, fingerprint.num_routed_experts) == ("bfloat16", "DMMM", 8)
    assert (fingerprint.graph_mode, fingerprint.dp_size, fingerprint.tp_size) == ("eager", 1, 1)
    assert (fingerprint.connector, fingerprint.num_attention_ranks, fingerprint.num_ffn_ranks) == (
        "P2pGlooAFDConnector", 2, 1)
    assert (fingerprint.role, fingerprint.role_rank, fingerprint.device) == ("ffn", 0, "cpu")
    assert fingerprint.protocol_version == PROTOCOL_VERSION
    assert (fingerprint.vllm_version, fingerprint.overlay_version) == (vllm.__version__, vllm_afd.__version__)


def test_the_afd_alias_in_a_role_config_maps_back_to_the_checkpoint_architecture(model_dir):
    from vllm_afd.workers.common import make_role_vllm_config

    vllm_config = make_vllm_config(model_dir, role="attention", **GLOO)
    afd_config = parse_afd_config(vllm_config)
    role_config = make_role_vllm_config(vllm_config, afd_config)

    fingerprint = build_fingerprint(role_config, afd_config, Placement("attention", 0, 1, 1))

    assert role_config.model_config.hf_config.architectures == ["AFDQwen3MoeForCausalLM"]
    assert vllm_config.model_config.hf_config.architectures == ["Qwen3MoeForCausalLM"]  # vLLM's copy untouched
    assert fingerprint.architecture == "Qwen3MoeForCausalLM"
    assert native_architecture("DeepseekV2ForCausalLM") == "DeepseekV2ForCausalLM"


# ---- connector --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("gate", "crossing", "logits_width"), [(False, 4, None), (True, 3, 8)])
def test_build_connector_makes_the_gloo_connector_without_communicating(model_dir, gate, crossing, logits_width):
    port = free_port()
    vllm_config = make_vllm_config(model_dir, role="attention", port=port, compute_gate_on_attention=gate, **GLOO)
    placement = Placement("attention", 0, 1, 1)
    threads_before = threading.active_count()

    connector = build_connector(vllm_config, parse_afd_config(vllm_config), placement, torch.device("cpu"))

    spec = connector.spec
    assert isinstance(connector.transport, GlooTransport) and connector.placement is placement
    assert (spec.name, spec.host, spec.port) == ("P2pGlooAFDConnector", "127.0.0.1", port)
    assert (spec.hidden_size, spec.dtype, spec.device) == (128, torch.bfloat16, torch.device("cpu"))
    assert (spec.exchanges_per_stage, spec.router_logits_width) == (crossing, logits_width)
    assert not spec.use_graph_buffers  # eager
    assert connector.fingerprint.compute_gate_on_attention is gate
    assert connector.fingerprint.hidden_size == spec.hidden_size  # the handshake compares what is exchanged
    assert not connector.is_initialized
    assert threading.active_count() == threads_before  # no watchdog, no store thread
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # nothing listens: no store was created
    connector.close()
    connector.close()


@pytest.mark.parametrize(("role", "reform_timeout_s", "fault_tolerant", "can_reform"), [
    ("ffn", 600, False, True), ("ffn", 0, False, False),
    # an attention re-forms (heals) only where its config hook turned vLLM's fault tolerance on
    ("attention", 600, True, True), ("attention", 600, False, False), ("attention", 0, True, False),
])
def test_a_connector_can_re_form_where_its_role_waits_for_a_lost_peer(model_dir, role, reform_timeout_s,
                                                                      fault_tolerant, can_reform):
    vllm_config = make_vllm_config(model_dir, role=role, reform_timeout_s=reform_timeout_s, **GLOO)
    vllm_config.parallel_config.enable_fault_tolerance = fault_tolerant

    connector = build_connector(vllm_config, parse_afd_config(vllm_config), Placement(role, 0, 1, 1),
                                torch.device("cpu"))

    assert connector.can_reform is can_reform
    connector.close()
    assert connector.can_reform is False  # a closed connector never re-forms


def test_build_connector_reads_the_secret_from_the_environment_or_the_file_and_refuses_both(model_dir, tmp_path,
                                                                                            monkeypatch):
    secret = tmp_path / "afd-secret"
    secret.write_text("file-secret\n")
    monkeypatch.setenv("VLLM_AFD_SECRET", "env-secret")
    from_env = make_vllm_config(model_dir, role="ffn", **GLOO)
    both = make_vllm_config(model_dir, role="ffn", secret_file=str(secret), **GLOO)

    connector = build_connector(from_env, parse_afd_config(from_env), Placement("ffn", 0, 1, 1), torch.device("cpu"))
    with pytest.raises(ValueError, match="both VLLM_AFD_SECRET and secret_file .* are set; expected one"):
        build_connector(both, parse_afd_config(both), Placement("ffn", 0, 1, 1), torch.device("cpu"))
    monkeypatch.delenv("VLLM_AFD_SECRET")
    from_file = build_connector(both, parse_afd_config(both), Placement("ffn", 0, 1, 1), torch.device("cpu"))

    assert connector._secret.key == b"env-secret" and from_file._secret.key == b"file-secret"  # noqa: SLF001
    assert "env-secret" not in repr(connector.spec) and "file-secret" not in repr(from_file._secret)  # noqa: SLF001
    connector.close()
    from_file.close()


# ---- the parse a role config carries ----------------------------------------------------------------


def test_a_role_config_carries_the_workers_parse_to_afd_config_of(model_dir):
    from vllm_afd.workers.common import make_role_vllm_config

    vllm_config = make_vllm_config(model_dir, role="ffn", **GLOO)
    afd_config = parse_afd_config(vllm_config)

    role_config = make_role_vllm_config(vllm_config, afd_config)

    assert isinstance(role_config.additional_config, ParsedAdditionalConfig)
    assert afd_config_of(role_config, "test") is afd_config  # handed out, not parsed again
    with pytest.raises(AssertionError, match="parsed once per worker"):
        afd_config_of(vllm_config, "test")  # a plain config is never parsed a second time
    assert dict(role_config.additional_config) == dict(vllm_config.additional_config)


def test_the_carried_parse_keeps_vllms_config_hash(model_dir):
    vllm_config = make_vllm_config(model_dir, role="ffn", **GLOO)
    plain_hash = vllm_config.compute_hash()

    vllm_config.additional_config = ParsedAdditionalConfig(vllm_config.additional_config,
                                                           parse_afd_config(vllm_config))

    assert vllm_config.compute_hash() == plain_hash


def test_the_carried_parse_survives_pickling():
    afd = {"role": "attention", **GLOO}
    carried = ParsedAdditionalConfig({"afd": afd, "other": [1, 2]}, parse_afd_config({"afd": afd}))

    restored = pickle.loads(pickle.dumps(carried))

    assert type(restored) is ParsedAdditionalConfig
    assert restored == {"afd": afd, "other": [1, 2]}
    assert restored.afd_config == carried.afd_config


def test_afd_config_of_requires_afd():
    with pytest.raises(ValueError, match='remote ffn requires additional_config\\["afd"\\]'):
        afd_config_of({"some_other_plugin": {}}, "remote ffn")


def test_the_fingerprint_carries_max_rows_and_integrity_and_the_spec_follows(model_dir):
    from vllm_afd.connect import max_exchange_rows

    vllm_config = make_vllm_config(model_dir, role="attention", port=free_port(), integrity=True, **GLOO)

    connector = build_connector(vllm_config, parse_afd_config(vllm_config), Placement("attention", 0, 1, 1),
                                torch.device("cpu"))

    assert connector.fingerprint.max_rows == connector.spec.max_rows == max_exchange_rows(vllm_config) > 0
    assert connector.fingerprint.integrity is connector.spec.integrity is True
    assert connector.integrity.enabled
    connector.close()
