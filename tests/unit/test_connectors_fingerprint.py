"""Fingerprints and connector settings from a real VllmConfig (AFD_SPEC §3.7, §4.1, §4.7)."""

from __future__ import annotations

import socket
import sys
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
sys.path.insert(0, str(Path(__file__).parents[1] / "connectors"))
from _harness import free_port  # noqa: E402
from _vllm_configs import make_vllm_config, write_tiny_model  # noqa: E402

from vllm_afd.config import parse_afd_config  # noqa: E402
from vllm_afd.connectors.factory import create_connector  # noqa: E402
from vllm_afd.connectors.fingerprint import build_fingerprint, native_architecture  # noqa: E402
from vllm_afd.connectors.gloo import P2pGlooAFDConnector  # noqa: E402
from vllm_afd.handshake import PROTOCOL_VERSION  # noqa: E402

GLOO = {"connector": "P2pGlooAFDConnector"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"))


def test_fingerprint_reads_the_model_facts_from_the_real_config(model_dir):
    import vllm

    import vllm_afd

    vllm_config = make_vllm_config(model_dir, role="ffn", num_attention_ranks=2, **GLOO)

    fingerprint = build_fingerprint(vllm_config, parse_afd_config(vllm_config), "ffn", 0)

    assert (fingerprint.architecture, fingerprint.hidden_size, fingerprint.num_hidden_layers) == (
        "Qwen3MoeForCausalLM", 128, 4)
    assert (fingerprint.dtype, fingerprint.layer_kinds, fingerprint.num_routed_experts) == ("bfloat16", "DMMM", 8)
    assert (fingerprint.graph_mode, fingerprint.dp_size, fingerprint.tp_size) == ("eager", 1, 1)
    assert (fingerprint.connector, fingerprint.num_attention_ranks, fingerprint.num_ffn_ranks) == (
        "P2pGlooAFDConnector", 2, 1)
    assert fingerprint.protocol_version == PROTOCOL_VERSION
    assert (fingerprint.vllm_version, fingerprint.overlay_version) == (vllm.__version__, vllm_afd.__version__)


def test_the_afd_alias_in_a_role_config_maps_back_to_the_checkpoint_architecture(model_dir):
    from vllm_afd.workers.common import make_role_vllm_config

    role_config = make_role_vllm_config(make_vllm_config(model_dir, role="attention", **GLOO))

    fingerprint = build_fingerprint(role_config, parse_afd_config(role_config), "attention", 0)

    assert role_config.model_config.hf_config.architectures == ["AFDQwen3MoeForCausalLM"]
    assert fingerprint.architecture == "Qwen3MoeForCausalLM"
    assert native_architecture("DeepseekV2ForCausalLM") == "DeepseekV2ForCausalLM"


def test_fingerprint_refuses_a_role_other_than_the_configs(model_dir):
    vllm_config = make_vllm_config(model_dir, role="ffn", **GLOO)

    with pytest.raises(ValueError, match="role 'attention' differs from the AFD config's role 'ffn'"):
        build_fingerprint(vllm_config, parse_afd_config(vllm_config), "attention", 0)


@pytest.mark.parametrize(("gate", "crossing"), [(False, 4), (True, 3)])
def test_factory_builds_the_gloo_connector_without_communicating(model_dir, gate, crossing):
    port = free_port()
    vllm_config = make_vllm_config(model_dir, role="attention", port=port, compute_gate_on_attention=gate, **GLOO)
    threads_before = threading.active_count()

    connector = create_connector(3, 0, vllm_config, parse_afd_config(vllm_config), role_rank=0)

    settings = connector.protocol.settings
    assert isinstance(connector, P2pGlooAFDConnector) and connector.control_plane is connector.protocol
    assert (connector.rank, connector.local_rank, connector.role_rank, connector.role) == (3, 0, 0, "attention")
    assert (settings.hidden_size, settings.dtype, settings.device) == (128, torch.bfloat16, torch.device("cpu"))
    assert (settings.exchanges_per_stage, settings.num_routed_experts, settings.use_graph_buffers) == (crossing, 8, False)
    assert (connector.attn_size, connector.ffn_size, connector.dp_size) == (1, 1, 1)
    assert not connector.is_initialized
    assert threading.active_count() == threads_before  # no watchdog, no store thread
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # nothing listens: no store was created
    connector.close()
    connector.close()
