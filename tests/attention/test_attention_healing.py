"""A healing attention (vllm_afd/attention/healing.py, docs/connection.md#healing-attention): the real
connectors over gloo on loopback, built from a config-only tiny Qwen3-MoE; the FFN "dies" by closing its
connector, "returns" as a new one on the same port."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

pytest.importorskip("vllm")
from tests.connectors._harness import free_port
from tests.connectors._vllm_configs import make_vllm_config
from afd_harness.metrics import wait_for

from vllm_afd.attention.healing import AttentionHealer
from vllm_afd.config import parse_afd_config
from vllm_afd.outage import OUTAGE_FILE, read_outage
from vllm_afd.wire.errors import AFDPeerLostError, AFDRendezvousTimeout

FAST = {"connector": "P2pGlooAFDConnector", "rendezvous_timeout_s": 20, "peer_timeout_s": 2}


def build(model_dir, role: str, port: int, *, heals: bool = True, terminate=None, **afd):
    import torch

    from vllm_afd.connect import build_connector
    from vllm_afd.wire.placement import Placement

    vllm_config = make_vllm_config(model_dir, role=role, port=port, **FAST, **afd)
    vllm_config.parallel_config.enable_fault_tolerance = heals and role == "attention"
    kwargs = {} if terminate is None else {"terminate": terminate}
    return build_connector(vllm_config, parse_afd_config(vllm_config), Placement(role, 0, 1, 1), torch.device("cpu"),
                           **kwargs)


def pair(*connectors) -> None:
    threads = [threading.Thread(target=c.init) for c in connectors]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(c.is_initialized for c in connectors)


class HealingAttention:
    """An attention connector whose unobserved failures start its healer, as the runner mixin wires it;
    ``terminated`` collects what the healer would end the process with."""

    def __init__(self, model_dir, port: int, notice_dir: Path, reform_timeout_s: float):
        self.terminated: list[BaseException] = []
        self.connector = build(model_dir, "attention", port, terminate=lambda cause: self.healer.start(cause),
                               reform_timeout_s=reform_timeout_s)
        self.healer = AttentionHealer(self.connector, reform_timeout_s, str(notice_dir),
                                      terminate=self.terminated.append)


def paired_with_an_ffn(model_dir, notice_dir: Path, reform_timeout_s: float):
    """A healing attention paired with an FFN (which does not re-form: it plays a process that dies)."""
    port = free_port()
    attention = HealingAttention(model_dir, port, notice_dir, reform_timeout_s)
    ffn = build(model_dir, "ffn", port, reform_timeout_s=0)
    pair(attention.connector, ffn)
    return attention, ffn, port


def lose(ffn, attention: HealingAttention) -> None:
    """The FFN dies; a step then observes the failure (vLLM's retry follows)."""
    ffn.close()
    assert wait_for(lambda: attention.connector.failure is not None, 15)
    with pytest.raises(AFDPeerLostError):
        attention.connector.check_failed()


@pytest.fixture
def notice_dir(tmp_path, monkeypatch):
    from vllm_afd.metrics import METRICS_DIR_ENV, PROMETHEUS_DIR_ENV

    monkeypatch.delenv(PROMETHEUS_DIR_ENV, raising=False)
    monkeypatch.setenv(METRICS_DIR_ENV, str(tmp_path))
    return tmp_path


def test_only_an_attention_whose_engine_runs_fault_tolerant_can_re_form(model_dir):
    port = free_port()
    healing, plain = build(model_dir, "attention", port), build(model_dir, "attention", port, heals=False)
    off = build(model_dir, "attention", port, reform_timeout_s=0)
    try:
        assert healing.can_reform and not plain.can_reform and not off.can_reform
    finally:
        for connector in (healing, plain, off):
            connector.close()


def test_an_idle_attention_re_forms_with_a_restarted_ffn_and_admits_requests_again(model_dir, notice_dir):
    attention, first_ffn, port = paired_with_an_ffn(model_dir, notice_dir, 30)
    second_ffn = build(model_dir, "ffn", port, reform_timeout_s=0)
    try:
        first_ffn.close()  # the FFN dies while no step runs: nobody observes the failure
        assert wait_for(lambda: read_outage(str(notice_dir)) is not None, 15)
        notice = read_outage(str(notice_dir))
        assert notice.startswith("AFD attention server unavailable: its FFN peer was lost (")
        assert "re-forming: this server serves again once the FFN is back and paired (waiting up to " \
               "reform_timeout_s=30 s)" in notice

        second_ffn.init(30)  # the FFN's supervisor restarted it

        assert wait_for(lambda: attention.healer.heals == 1, 30)
        assert attention.connector.is_initialized and attention.connector.reformations == 1
        assert read_outage(str(notice_dir)) is None and attention.terminated == []
        attention.healer.heal()  # a retry after the fact finds it paired and returns at once
    finally:
        attention.connector.close()
        second_ffn.close()


def test_a_step_that_saw_the_loss_waits_in_heal_until_the_ffn_is_back(model_dir, notice_dir):
    attention, first_ffn, port = paired_with_an_ffn(model_dir, notice_dir, 30)
    second_ffn = build(model_dir, "ffn", port, reform_timeout_s=0)
    returned = threading.Timer(3.0, second_ffn.init, args=(30,))
    try:
        lose(first_ffn, attention)
        returned.start()

        attention.healer.heal()

        assert attention.connector.is_initialized and attention.terminated == []
        assert read_outage(str(notice_dir)) is None
    finally:
        returned.cancel()
        attention.connector.close()
        second_ffn.close()


def test_an_ffn_that_does_not_return_ends_the_retry_with_a_restart_notice(model_dir, notice_dir):
    attention, ffn, _ = paired_with_an_ffn(model_dir, notice_dir, 2)
    try:
        lose(ffn, attention)

        with pytest.raises(AFDRendezvousTimeout) as info:
            attention.healer.heal()

        message = str(info.value)
        assert message.startswith("AFD attention rank 0: the FFN did not return with an agreeing handshake within "
                                  "reform_timeout_s=2 after AFD peer lost")
        assert message.endswith("this attention server stops serving. Restart the FFN with the attention's model "
                                "and AFD settings, then restart this attention server")
        assert attention.terminated == []  # the retry reports it: the engine stops
        assert read_outage(str(notice_dir)).startswith(
            "AFD attention server unavailable: its engine stopped after an AFD failure (AFD rendezvous timed out: "
            "AFDRendezvousTimeout; the details are in the server log)")
    finally:
        attention.connector.close()


def test_an_idle_attention_whose_ffn_does_not_return_ends_its_process(model_dir, notice_dir):
    attention, ffn, _ = paired_with_an_ffn(model_dir, notice_dir, 1)
    try:
        ffn.close()
        # NOTE: /health would keep answering 200 for an engine that never failed a step; ending the process
        # makes the supervisor's liveness probe see it (docs/operations.md).
        assert wait_for(lambda: len(attention.terminated) == 1, 30), attention.terminated
        assert isinstance(attention.terminated[0], AFDRendezvousTimeout)
        assert (notice_dir / OUTAGE_FILE).exists()
    finally:
        attention.connector.close()


# ---- the config hook turns vLLM's fault tolerance on; the engine's responder retries AFD failures ----------

def attention_config(model_dir, *, data_parallel=(1, 0), **afd):
    return make_vllm_config(model_dir, data_parallel=data_parallel, role="attention", **FAST, **afd)


def test_the_hook_turns_fault_tolerance_on_for_an_attention_that_can_heal(model_dir):
    from vllm_afd import plugin

    config = attention_config(model_dir)
    plugin.enable_attention_healing(config, parse_afd_config(config))

    assert config.parallel_config.enable_fault_tolerance
    # any other fault ends the engine at once, as without fault tolerance
    assert config.parallel_config.fault_tolerance_config.engine_recovery_timeout_sec == 0


@pytest.mark.parametrize("afd, data_parallel, blocker", [
    ({"reform_timeout_s": 0}, (1, 0), "reform_timeout_s is 0"),
    ({}, (2, 0), "attention DP 2 runs in one vllm serve, whose internal DP load balancer vLLM's fault tolerance "
                 "refuses; start one vllm serve per DP rank to heal"),
], ids=["reform-off", "internal-dp"])
def test_an_attention_that_cannot_heal_keeps_fault_tolerance_off_and_says_why(model_dir, caplog, afd, data_parallel,
                                                                               blocker):
    from vllm_afd import plugin
    from vllm_afd.validation import healing_blocker

    config = attention_config(model_dir, data_parallel=data_parallel, **afd)
    with caplog.at_level("INFO", logger="vllm_afd"):
        plugin.enable_attention_healing(config, parse_afd_config(config))

    assert healing_blocker(config, parse_afd_config(config)) == blocker
    assert not config.parallel_config.enable_fault_tolerance


def test_an_attention_with_cuda_graphs_heals_too(model_dir):
    from vllm.config import CUDAGraphMode

    from vllm_afd.validation import healing_blocker

    config = attention_config(model_dir)
    config.model_config.enforce_eager = False
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY

    assert healing_blocker(config, parse_afd_config(config)) is None


class GraphRunnerParts:
    """What the CUDA runner's graph refresh touches: its connector, vLLM's graph manager, telemetry."""

    def __init__(self, has_graphs: bool) -> None:
        self.events: list[str] = []
        self.reformations = 0
        self.failure: BaseException | None = None
        self.has_graphs = has_graphs

    # connector
    def check_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    def take_step_failure(self) -> BaseException | None:
        return self.failure

    # graph manager
    def needs_capture(self) -> bool:
        return self.has_graphs

    def release_graphs(self) -> None:
        self.events.append("release")

    # telemetry
    def after_step(self) -> None:
        pass


@pytest.fixture
def cuda_runner(monkeypatch):
    """The CUDA attention runner over GraphRunnerParts; vLLM's own capture and step are recorders."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from vllm_afd.attention.runner import AFDAttentionModelRunner
    from vllm_afd.attention.step import AttentionStep
    from vllm_afd.attention.step_gate import LocalStepGate

    def make(has_graphs: bool):
        parts = GraphRunnerParts(has_graphs)
        monkeypatch.setattr(GPUModelRunner, "capture_model", lambda self, **kw: parts.events.append("capture") or 0)
        monkeypatch.setattr(GPUModelRunner, "execute_model", lambda self, *a, **kw: parts.events.append("step"))
        runner = object.__new__(AFDAttentionModelRunner)  # no device: only the graph refresh runs
        runner._afd_graphs_pairing = None
        runner.afd_connector = runner.cudagraph_manager = runner._afd_telemetry = parts
        runner._afd_step_gate, runner.afd_step = LocalStepGate(parts), AttentionStep(parts)
        runner.capture_model()  # start-up
        return runner, parts

    return make


def test_a_graph_attention_records_its_graphs_again_before_its_first_step_after_re_forming(cuda_runner):
    runner, parts = cuda_runner(has_graphs=True)
    runner.execute_model()
    parts.reformations = 1  # healed (attention/healing.py)
    runner.execute_model()
    runner.execute_model()

    assert parts.events == ["capture", "step", "release", "capture", "step", "step"]


def test_an_eager_attention_records_no_graphs_after_re_forming(cuda_runner):
    runner, parts = cuda_runner(has_graphs=False)
    parts.reformations = 1
    runner.execute_model()

    assert parts.events == ["capture", "step"]


def test_a_failed_connector_fails_the_step_before_any_graph_is_dropped(cuda_runner):
    runner, parts = cuda_runner(has_graphs=True)
    parts.reformations, parts.failure = 1, AFDPeerLostError("AFD peer lost: x")

    with pytest.raises(AFDPeerLostError):
        runner.execute_model()
    assert parts.events == ["capture"]


def test_the_engines_responder_retries_only_while_an_afd_outage_notice_exists(notice_dir):
    from vllm_afd import plugin
    from vllm_afd.outage import healing_message, record_outage

    assert plugin.retry_after_afd_outage(RuntimeError("Worker failed with error 'x'")) is None  # not ours

    record_outage(str(notice_dir), healing_message(AFDPeerLostError("AFD peer lost: x"), 30))
    answer = plugin.retry_after_afd_outage(RuntimeError("Worker failed with error 'AFD peer lost: x'"))

    assert (answer.instruction, answer.params) == ("retry", {})
