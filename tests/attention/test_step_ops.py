"""The transport custom ops of attention/step.py: registration, fakes, sidecar, lazy publish, compile.

docs/protocol.md#transport-ops-and-torchcompile and docs/attention.md#forward-context-sidecar say
what the ops do per call; here a recording connector stands behind them, and at the end two real
gloo connectors do.
"""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("vllm")
from vllm.forward_context import DPMetadata, create_forward_context, override_forward_context  # noqa: E402

from tests.connectors._harness import free_port, make_placement  # noqa: E402
from tests.connectors._vllm_configs import make_vllm_config, write_tiny_model  # noqa: E402

from vllm_afd.config import parse_afd_config  # noqa: E402
from vllm_afd.connect import build_connector  # noqa: E402
from vllm_afd.attention import step as afd_step  # noqa: E402
from vllm_afd.attention.step import SIDECAR_KEY, AttentionStep, ForwardSidecar  # noqa: E402
from vllm_afd.models.proxy import remote_ffn  # noqa: E402
from vllm_afd.wire.errors import AFDPeerLostError  # noqa: E402


class RecordingConnector:
    """Records what the ops hand to a connector; answers receives with ``answer(out)``."""

    def __init__(self, dp_size: int = 1, answer=None) -> None:
        self.placement = make_placement("attention", 0, dp_size, 1)
        self.answer = answer
        self.published: list[tuple[dict, dict]] = []
        self.sends: list[tuple[int, int, bool]] = []  # (stage, rows, with router logits)
        self.receives: list[tuple[int, int]] = []  # (stage, rows)

    def publish(self, counts_dp, **flags):
        self.published.append((dict(counts_dp), flags))

    def send_a2f(self, stage, hidden, router_logits=None):
        self.sends.append((stage, hidden.shape[0], router_logits is not None))

    def recv_f2a(self, stage, out):
        self.receives.append((stage, out.shape[0]))
        return self.answer(out) if self.answer else out.fill_(7)


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    afd_step.register_afd_ops()
    return make_vllm_config(write_tiny_model(tmp_path_factory.mktemp("tiny")), connector="P2pGlooAFDConnector")


@pytest.fixture
def registered():
    """Registers an AttentionStep over a connector (``in_step``: inside execute_model; ``in_profile``: vLLM's
    profile run); returns its handle."""
    handles = []

    def register(connector, *, in_step=False, in_profile=False):
        step = AttentionStep(connector, connector.placement.dp_size)
        step.in_step, step.in_profile = in_step, in_profile
        handles.append(afd_step.register_step(step))
        return handles[-1]

    yield register
    for handle in handles:
        afd_step.unregister_step(handle)


def forward_context(vllm_config, handle, *, stage=0, published=False, dp_metadata=None):
    context = create_forward_context(None, vllm_config, dp_metadata=dp_metadata)
    context.additional_kwargs[SIDECAR_KEY] = ForwardSidecar(handle, stage, published)
    return context


def test_ops_are_registered_once_with_mutated_tensor_arguments(vllm_config):
    afd_step.register_afd_ops()
    afd_step.register_afd_ops()

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


def test_connector_handles_are_distinct_and_forgotten_once_unregistered(vllm_config):
    connector = RecordingConnector()
    handle, other = afd_step.register_step(AttentionStep(connector)), afd_step.register_step(AttentionStep(connector))
    context = forward_context(vllm_config, handle, published=True)

    with override_forward_context(context):
        remote_ffn(torch.zeros(2, 128), None, 0)
    afd_step.unregister_step(handle)
    afd_step.unregister_step(handle)
    afd_step.unregister_step(other)

    assert other > handle and connector.sends == [(0, 2, False)]
    with override_forward_context(context):
        with pytest.raises(RuntimeError, match=f"AFD connector handle {handle} is not registered"):
            remote_ffn(torch.zeros(2, 128), None, 0)


def test_ops_without_the_sidecar_raise(vllm_config):
    hidden = torch.zeros(2, 128)

    with pytest.raises(RuntimeError, match="RemoteFFNProxy: no vLLM forward context is set"):
        remote_ffn(hidden, None, 0)
    with override_forward_context(create_forward_context(None, vllm_config)):
        with pytest.raises(RuntimeError, match="additional_kwargs\\['afd_metadata'\\] is NoneType; expected the AFD "
                                               "attention runner's forward-context hook to install a ForwardSidecar"):
            remote_ffn(hidden, None, 0)
    with override_forward_context(forward_context(vllm_config, 987654)):
        with pytest.raises(RuntimeError, match="AFD connector handle 987654 is not registered"):
            remote_ffn(hidden, None, 0)


def test_the_first_op_of_each_forward_publishes_its_rows_once(vllm_config, registered):
    connector = RecordingConnector()
    handles = [registered(connector, in_profile=True), registered(connector)]  # vLLM's profile run, then a step

    for step, num_rows in enumerate((3, 5)):
        context = forward_context(vllm_config, handles[step])
        with override_forward_context(context):
            for layer in range(3):
                result = remote_ffn(torch.zeros(num_rows, 128), None, layer)
                assert torch.equal(result, torch.full((num_rows, 128), 7.0))
        assert context.additional_kwargs[SIDECAR_KEY].published

    assert connector.published == [({0: [3]}, {"is_profile": True}), ({0: [5]}, {"is_profile": False})]
    assert connector.sends[:3] == [(0, 3, False)] * 3
    assert connector.receives == [(0, 3)] * 3 + [(0, 5)] * 3


def test_the_sidecars_stage_is_the_stage_published_and_exchanged(vllm_config, registered):
    connector = RecordingConnector()

    with override_forward_context(forward_context(vllm_config, registered(connector), stage=1)):
        remote_ffn(torch.zeros(2, 128), torch.zeros(2, 8), 0)

    assert connector.published == [({1: [2]}, {"is_profile": False})]
    assert (connector.sends, connector.receives) == ([(1, 2, True)], [(1, 2)])


def test_contexts_published_by_the_runner_are_not_published_again(vllm_config, registered):
    connector = RecordingConnector()

    with override_forward_context(forward_context(vllm_config, registered(connector), published=True)):
        remote_ffn(torch.zeros(2, 128), None, 0)

    assert connector.published == []
    assert connector.sends == [(0, 2, False)]


def test_attention_dp_takes_the_rows_from_vllms_dp_metadata(vllm_config, registered):
    connector = RecordingConnector(dp_size=2)
    handle = registered(connector)
    dp_metadata = DPMetadata(num_tokens_across_dp_cpu=torch.tensor([3, 5], dtype=torch.int32))

    with override_forward_context(forward_context(vllm_config, handle, dp_metadata=dp_metadata)):
        remote_ffn(torch.zeros(3, 128), None, 0)
    with override_forward_context(forward_context(vllm_config, handle)):
        with pytest.raises(RuntimeError, match="AFD: attention DP size 2 but the forward context has no dp_metadata"):
            remote_ffn(torch.zeros(3, 128), None, 0)

    assert connector.published == [({0: [3, 5]}, {"is_profile": False})]


def test_a_result_in_another_tensor_is_copied_into_out(vllm_config, registered):
    connector = RecordingConnector(answer=lambda out: torch.ones(out.shape[0], 128, dtype=torch.float64))
    hidden = torch.zeros(2, 128)

    with override_forward_context(forward_context(vllm_config, registered(connector))):
        result = remote_ffn(hidden, None, 0)

    assert result is hidden and result.dtype == torch.float32 and torch.equal(result, torch.ones(2, 128))


class FailedConnector(RecordingConnector):
    """A connector whose failure latch is set: every exchange raises the sticky failure."""

    def __init__(self) -> None:
        super().__init__()
        self.deferred: list[BaseException] = []

    def publish(self, *args, **kwargs):
        raise AFDPeerLostError("AFD peer lost: ffn rank 0 silent for 5.0s (peer_timeout_s=5)")

    send_a2f = recv_f2a = publish

    def defer_failure(self, exc):
        self.deferred.append(exc)


def test_inside_a_step_a_failed_exchange_fills_zeros_and_leaves_the_raise_to_the_step_gate(vllm_config, registered):
    """Regression: one TP rank raising mid-step left its peer in vLLM's all-reduce for good; inside a step the
    ops finish the forward (zeros) so every rank reaches the step gate (attention/step_gate.py)."""
    baton, connector = RecordingBaton(), FailedConnector()
    handle = registered(connector, in_step=True)
    hidden = torch.full((3, 128), 5.0)

    context = forward_context(vllm_config, handle)
    context.additional_kwargs[SIDECAR_KEY].baton = baton
    with override_forward_context(context):
        result = remote_ffn(hidden, None, 0)

    assert result is hidden and torch.equal(result, torch.zeros(3, 128))
    assert baton.yields == 1  # the stage order is kept: the next stage still runs
    assert [str(exc) for exc in connector.deferred] == [
        "AFD peer lost: ffn rank 0 silent for 5.0s (peer_timeout_s=5)"] * 2  # the send's, then the receive's


def test_outside_a_step_a_failed_exchange_raises(vllm_config, registered):
    handle = registered(FailedConnector())

    with override_forward_context(forward_context(vllm_config, handle)):
        with pytest.raises(AFDPeerLostError, match="silent for 5.0s"):
            remote_ffn(torch.zeros(3, 128), None, 0)


class RecordingBaton:
    def __init__(self) -> None:
        self.yields = 0

    def yield_stage(self) -> None:
        self.yields += 1


def test_compiled_callers_run_the_ops_at_every_call(vllm_config, registered):
    connector = RecordingConnector(answer=lambda out: out.add_(1))
    handle = registered(connector)
    compiled = torch.compile(lambda hidden: remote_ffn(hidden * 2, None, 5) + 1, backend="aot_eager", fullgraph=True)

    for num_rows in (2, 2, 4):
        with override_forward_context(forward_context(vllm_config, handle)):
            out = compiled(torch.ones(num_rows, 128))
        assert out.shape == (num_rows, 128) and torch.equal(out, torch.full((num_rows, 128), 4.0))

    assert [send[1] for send in connector.sends] == [2, 2, 4]  # neither dropped nor frozen
    assert len(connector.published) == 3


def test_ops_drive_real_gloo_connectors_end_to_end(tmp_path, registered):
    model_dir, port = write_tiny_model(tmp_path / "tiny"), free_port()
    configs = {role: make_vllm_config(model_dir, role=role, port=port, connector="P2pGlooAFDConnector",
                                      rendezvous_timeout_s=30) for role in ("ffn", "attention")}
    connectors = {role: build_connector(cfg, parse_afd_config(cfg), make_placement(role, 0, 1, 1), torch.device("cpu"))
                  for role, cfg in configs.items()}
    inits = [threading.Thread(target=c.init) for c in connectors.values()]
    for thread in inits:
        thread.start()
    for thread in inits:
        thread.join(40.0)
    ffn, attention = connectors["ffn"], connectors["attention"]
    handle = registered(attention)
    payloads = []

    def serve(num_steps):
        for _ in range(num_steps):
            payloads.append(ffn.next_step())
            for layer in range(4):
                ffn.send_f2a(0, ffn.recv_a2f(0).hidden_states * 2 + layer)

    server = threading.Thread(target=serve, args=(2,), daemon=True)
    server.start()
    try:
        for num_rows in (3, 1):
            hidden = torch.arange(num_rows * 128, dtype=torch.bfloat16).reshape(num_rows, 128) % 7
            with override_forward_context(forward_context(configs["attention"], handle)):
                for layer in range(4):
                    assert torch.equal(remote_ffn(hidden.clone(), None, layer), hidden * 2 + layer)
        server.join(20.0)
    finally:
        attention.close()
        ffn.close()

    assert [p.counts for p in payloads] == [{0: (3,)}, {0: (1,)}]
    assert [p.step_seq for p in payloads] == [0, 1]
