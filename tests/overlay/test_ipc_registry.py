"""P2pIpcAFDConnector in the vLLM-facing wiring: the registry entry, the slot size from vLLM's config, the
CUDA-only refusals (docs/config.md#choosing-a-connector, docs/decisions.md#23-transport-factories-take-the-connectorspec
and #24-the-ipc-transport-keeps-the-control-channel-on-gloo)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
from tests.connectors._harness import make_spec
from tests.connectors._vllm_configs import make_vllm_config

from vllm_afd.config import parse_afd_config
from vllm_afd.connect import TRANSPORTS, build_connector, max_exchange_rows
from vllm_afd.wire.placement import A2F, F2A, Placement
from vllm_afd.wire.transports.mailbox import MailboxTransport
from vllm_afd.wire.transports.ipc import IpcTransport

IPC = {"connector": "P2pIpcAFDConnector"}



def test_the_registry_sizes_the_ipc_slots_from_the_spec_and_puts_control_in_a_mailbox():
    spec = make_spec(1, name="P2pIpcAFDConnector", router_logits_width=8, max_rows=32)

    transport = TRANSPORTS["P2pIpcAFDConnector"](torch.device("cuda", 0), spec)  # no CUDA call yet

    assert isinstance(transport, IpcTransport) and transport.max_rows == 32
    assert transport.row_bytes == {A2F: (128, 32), F2A: (128,)}  # 64 bf16; 8 logits sized as fp32
    assert isinstance(transport._control, MailboxTransport)


def test_the_ipc_factory_refuses_what_it_cannot_drive():
    with pytest.raises(ValueError, match="device cpu is not an indexed CUDA device"):
        TRANSPORTS["P2pIpcAFDConnector"](torch.device("cpu"), make_spec(1, max_rows=4))


def test_max_rows_is_the_larger_of_a_scheduled_step_and_a_captured_graph(model_dir):
    vllm_config = make_vllm_config(model_dir, role="attention", **IPC)

    rows = max_exchange_rows(vllm_config)

    assert rows == max(vllm_config.scheduler_config.max_num_batched_tokens,
                       vllm_config.compilation_config.max_cudagraph_capture_size or 0) > 0


def test_build_connector_passes_the_spec_to_the_transport_and_refuses_a_cpu_rank(model_dir):
    gloo = make_vllm_config(model_dir, role="ffn", connector="P2pGlooAFDConnector")
    connector = build_connector(gloo, parse_afd_config(gloo), Placement("ffn", 0, 1, 1), torch.device("cpu"))
    assert connector.spec.max_rows == max_exchange_rows(gloo)
    connector.close()

    ipc = make_vllm_config(model_dir, role="ffn", **IPC)
    with pytest.raises(ValueError, match="P2pIpcAFDConnector: device cpu is not an indexed CUDA device; .* Use "
                                         "P2pGlooAFDConnector on CPU"):
        build_connector(ipc, parse_afd_config(ipc), Placement("ffn", 0, 1, 1), torch.device("cpu"))
