"""The transport custom ops (AFD_SPEC §4.6, §5.3-5.4): registration, fakes, sidecar, lazy publish, compile."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
from vllm.forward_context import DPMetadata, create_forward_context, override_forward_context  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "connectors"))
from _harness import free_port  # noqa: E402
from _vllm_configs import make_vllm_config, write_tiny_model  # noqa: E402

from vllm_afd.config import AFDConfig, parse_afd_config  # noqa: E402
from vllm_afd.connectors import ops  # noqa: E402
from vllm_afd.connectors.base import AFDConnectorBase, AFDControlPlane  # noqa: E402
from vllm_afd.connectors.factory import create_connector  # noqa: E402
from vllm_afd.connectors.metadata import AFDForwardContextMetadata  # noqa: E402


class RecordingControlPlane(AFDControlPlane):
    def __init__(self) -> None:
        self.published: list[tuple[dict, dict]] = []

    def update_state_from_dp_metadata(self, payload): pass
    def send_dp_metadata_list(self, payload): pass
    def recv_dp_metadata_list(self): raise AssertionError("attention never receives payloads")
    def mark_startup_done(self): pass
    def mark_step_done(self): pass

    def send_dp_metadata(self, stages, **flags):
        self.published.append((dict(stages), flags))


class RecordingConnector(AFDConnectorBase):
    """Records what the ops hand to a connector; answers receives with ``answer(ref)``."""

    def __init__(self, dp_size: int = 1, answer=None) -> None:
        super().__init__(0, 0, None, AFDConfig(connector="P2pGlooAFDConnector"), 0)
        self.control_plane = RecordingControlPlane()
        self._dp_size, self.answer = dp_size, answer
        self.sends: list[tuple] = []

    @property
    def dp_size(self) -> int:
        return self._dp_size

    def init_afd_connector(self): pass
    def close(self): pass
    def check_failed(self): pass
    is_initialized = True
    def recv_attn_output(self, ubatch_idx=0, routing_spec=None): raise AssertionError
    def send_ffn_output(self, output, context): raise AssertionError

    def send_attn_output(self, hidden, context, router_logits=None):
        metadata = context.metadata
        self.sends.append((metadata.layer_idx, metadata.stage_idx, metadata.seq_lens, router_logits is not None))

    def recv_ffn_output(self, ref, ubatch_idx=0):
        return self.answer(ref) if self.answer else ref.fill_(7)


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    ops.register_afd_ops()
    return make_vllm_config(write_tiny_model(tmp_path_factory.mktemp("tiny")), connector="P2pGlooAFDConnector")


@pytest.fixture
def registered():
    handles = []

    def register(connector):
        handles.append(ops.register_connector(connector))
        return handles[-1]

    yield register
    for handle in handles:
        ops.unregister_connector(handle)


def forward_context(vllm_config, handle, num_tokens, *, published=False, is_profile=False, dp_metadata=None):
    context = create_forward_context(None, vllm_config, dp_metadata=dp_metadata)
    context.additional_kwargs[ops.SIDECAR_KEY] = AFDForwardContextMetadata.single_stage(
        num_tokens, connector_handle=handle, published=published, is_profile=is_profile)
    return context


def proxy(hidden: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """What the model's MLP-slot proxy does."""
    torch.ops.vllm_afd.afd_send(hidden, None, layer_idx)
    out = torch.empty_like(hidden)
    torch.ops.vllm_afd.afd_recv(out, layer_idx)
    return out


def test_ops_are_registered_once_with_mutated_tensor_arguments(vllm_config):
    ops.register_afd_ops()
    ops.register_afd_ops()

    send_schema = str(torch.ops.vllm_afd.afd_send.default._schema)
    recv_schema = str(torch.ops.vllm_afd.afd_recv.default._schema)
    assert "Tensor(a0!) hidden" in send_schema and "Tensor(a1!)? router_logits" in send_schema
    assert "Tensor(a0!) out" in recv_schema


def test_fake_impls_do_nothing_and_need_no_context(vllm_config):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        hidden = torch.empty(4, 128)
        assert torch.ops.vllm_afd.afd_send(hidden, None, 0) is None
        assert torch.ops.vllm_afd.afd_recv(hidden, 0) is None


def test_connector_handles_are_registered_and_forgotten():
    connector = RecordingConnector()
    handle = ops.register_connector(connector)

    assert ops.get_connector(handle) is connector
    ops.unregister_connector(handle)
    ops.unregister_connector(handle)
    with pytest.raises(RuntimeError, match=f"AFD communicator id {handle} is not registered"):
        ops.get_connector(handle)


def test_ops_without_the_sidecar_raise(vllm_config):
    hidden = torch.zeros(2, 128)

    with pytest.raises(RuntimeError, match="RemoteFFNProxy requires AFD forward metadata"):
        proxy(hidden, 0)
    with override_forward_context(create_forward_context(None, vllm_config)):
        with pytest.raises(RuntimeError, match="RemoteFFNProxy requires AFD forward metadata"):
            proxy(hidden, 0)
    with override_forward_context(forward_context(vllm_config, 987654, 2)):
        with pytest.raises(RuntimeError, match="AFD communicator id 987654 is not registered"):
            proxy(hidden, 0)


def test_the_first_op_of_each_forward_publishes_its_rows_once(vllm_config, registered):
    connector = RecordingConnector()
    handle = registered(connector)

    for step, num_rows in enumerate((3, 5)):
        context = forward_context(vllm_config, handle, num_rows, is_profile=step == 0)
        with override_forward_context(context):
            for layer in range(3):
                assert torch.equal(proxy(torch.zeros(num_rows, 128), layer), torch.full((num_rows, 128), 7.0))
        assert context.additional_kwargs[ops.SIDECAR_KEY].published

    assert connector.control_plane.published == [({0: [3]}, {"is_profile": True}), ({0: [5]}, {"is_profile": False})]
    assert connector.sends[:3] == [(0, 0, [3], False), (1, 0, [3], False), (2, 0, [3], False)]


def test_contexts_published_by_the_runner_are_not_published_again(vllm_config, registered):
    connector = RecordingConnector()

    with override_forward_context(forward_context(vllm_config, registered(connector), 2, published=True)):
        proxy(torch.zeros(2, 128), 0)

    assert connector.control_plane.published == []
    assert connector.sends == [(0, 0, [2], False)]


def test_attention_dp_takes_the_rows_from_vllms_dp_metadata(vllm_config, registered):
    connector = RecordingConnector(dp_size=2)
    handle = registered(connector)
    dp_metadata = DPMetadata(num_tokens_across_dp_cpu=torch.tensor([3, 5], dtype=torch.int32))

    with override_forward_context(forward_context(vllm_config, handle, 3, dp_metadata=dp_metadata)):
        proxy(torch.zeros(3, 128), 0)
    with override_forward_context(forward_context(vllm_config, handle, 3)):
        with pytest.raises(RuntimeError, match="AFD expected vLLM DPMetadata for attention DP > 1"):
            proxy(torch.zeros(3, 128), 0)

    assert connector.control_plane.published == [({0: [3, 5]}, {"is_profile": False})]


def test_a_result_in_another_tensor_is_copied_into_out(vllm_config, registered):
    connector = RecordingConnector(answer=lambda ref: torch.ones(ref.shape[0], 128, dtype=torch.float64))

    with override_forward_context(forward_context(vllm_config, registered(connector), 2)):
        out = proxy(torch.zeros(2, 128), 0)

    assert out.dtype == torch.float32 and torch.equal(out, torch.ones(2, 128))


def test_compiled_callers_run_the_ops_at_every_call(vllm_config, registered):
    connector = RecordingConnector(answer=lambda ref: ref.add_(1))
    handle = registered(connector)
    compiled = torch.compile(lambda hidden: proxy(hidden * 2, 5) + 1, backend="aot_eager", fullgraph=True)

    for num_rows in (2, 2, 4):
        with override_forward_context(forward_context(vllm_config, handle, num_rows)):
            out = compiled(torch.ones(num_rows, 128))
        assert out.shape == (num_rows, 128)

    assert [send[2] for send in connector.sends] == [[2], [2], [4]]  # neither dropped nor frozen
    assert len(connector.control_plane.published) == 3


def test_ops_drive_real_gloo_connectors_end_to_end(tmp_path, registered):
    model_dir, port = write_tiny_model(tmp_path / "tiny"), free_port()
    configs = {role: make_vllm_config(model_dir, role=role, port=port, connector="P2pGlooAFDConnector",
                                      rendezvous_timeout_s=30) for role in ("ffn", "attention")}
    connectors = {role: create_connector(0, 0, cfg, parse_afd_config(cfg), role_rank=0) for role, cfg in configs.items()}
    inits = [threading.Thread(target=c.init_afd_connector) for c in connectors.values()]
    for thread in inits:
        thread.start()
    for thread in inits:
        thread.join(40.0)
    ffn, attention = connectors["ffn"], connectors["attention"]
    handle = registered(attention)
    payloads = []

    def serve(num_steps):
        for _ in range(num_steps):
            payloads.append(ffn.control_plane.recv_dp_metadata_list())
            ffn.update_state_from_dp_metadata(payloads[-1])
            for layer in range(4):
                received = ffn.recv_attn_output()
                ffn.send_ffn_output(received.hidden_states * 2 + layer, received.context)

    server = threading.Thread(target=serve, args=(2,), daemon=True)
    server.start()
    try:
        for num_rows in (3, 1):
            hidden = torch.arange(num_rows * 128, dtype=torch.bfloat16).reshape(num_rows, 128) % 7
            with override_forward_context(forward_context(configs["attention"], handle, num_rows)):
                for layer in range(4):
                    assert torch.equal(proxy(hidden, layer), hidden * 2 + layer)
        server.join(20.0)
    finally:
        attention.close()
        ffn.close()

    assert [list(p.dp_metadata_list[0].num_tokens_across_dp_cpu) for p in payloads] == [[3], [1]]
    assert [p.step_seq for p in payloads] == [0, 1]
