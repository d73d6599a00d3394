"""No token from an aborted step (docs/failures.md#23-no-token-from-an-aborted-step): the attention runner's
``sample_tokens`` hands vLLM an output whose ``get_output``, after the wait for the sampled tokens, raises the
connector's failure.

A recording fake stands for Model Runner V2 on a GPU: ``execute_model`` returns once the step is enqueued (both
step gates pass, nothing has failed yet), the "device" finishes the step later, and ``sample_tokens`` returns an
``AsyncModelRunnerOutput`` whose ``get_output`` waits for it, as MRV2's ``AsyncOutput`` waits for its copy event.
The fault is injected mid-step, between the two: the peer is lost, the abort releases the step's receives, and
the step finishes on garbage rows.  At attention TP 2 the fault can hit the other rank (paired with another FFN
rank): its garbage rows reach the output rank through the step's all-reduce, and the output rank learns of it
from the server's outage notice, which the failing rank's latch writes before it releases the step.
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm")

from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput  # noqa: E402

from vllm_afd.attention.mixin import AFDAttentionRunnerMixin  # noqa: E402
from vllm_afd.attention.step_gate import CheckedOutput, LocalStepGate, checked_output  # noqa: E402
from vllm_afd.outage import healing_message, outage_probe, record_outage  # noqa: E402
from vllm_afd.wire.errors import AFDPeerLostError  # noqa: E402

VOCAB = 1000
NO_NOTICE = outage_probe(None)  # TP 1, or no AFD directory: the output rank's own check only


def plain_token(prompt: int, step: int) -> int:
    """What plain vLLM samples for request ``prompt`` at ``step`` (the FFN's rows arrived intact)."""
    return (prompt * 31 + step * 7) % VOCAB


class FakeConnector:
    """The connector surface the runner's check points read: the sticky failure and the pairing count."""

    def __init__(self, rank: int = 0, notice_dir: str | None = None) -> None:
        self.placement = type("Placement", (), {"label": f"attention rank {rank}"})()
        self.notice_dir = notice_dir
        self.failure: BaseException | None = None
        self.reformations = 0
        self.reforming = False
        self.observed = 0

    def lose_peer(self) -> None:
        self.fail(AFDPeerLostError("AFD peer lost: ffn rank 0 silent for 5.0s"))

    def fail(self, exc: BaseException) -> BaseException:
        """The latch: the first failure sticks, and its outage notice is written before the abort runs."""
        if self.failure is None:
            self.failure = exc
            if self.notice_dir is not None:
                record_outage(self.notice_dir, healing_message(exc, 600))
        return self.failure

    def check_failed(self) -> None:
        if self.failure is not None:
            self.observed += 1
            raise self.failure

    def take_step_failure(self) -> BaseException | None:
        return self.failure


def runner_output(req_ids: list[str], sampled: list[list[int]]) -> ModelRunnerOutput:
    """vLLM's output of one step (``req_id_to_index`` is gone since 0.34)."""
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled)
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


class FakeAsyncOutput(AsyncModelRunnerOutput):
    """MRV2's AsyncOutput: ``get_output`` waits for the step's device work, then reads the tokens."""

    def __init__(self, device: FakeDevice, req_ids: list[str]) -> None:
        self.device, self.req_ids = device, req_ids

    def get_output(self) -> ModelRunnerOutput:
        tokens = self.device.finish()  # the wait for the copy event: the step's kernels ran by now
        return runner_output(self.req_ids, [[t] for t in tokens])

    def get_kv_connector_output(self) -> None:
        """Abstract since vLLM 0.34 (a failed step's KV-connector output); none here."""
        return None


class FakeDevice:
    """The GPU's queue for one step: the FFN's rows arrive unless the abort released the receive first."""

    def __init__(self) -> None:
        self.prompts: list[int] = []
        self.step = 0
        self.fault_mid_step = False
        self.connector: FakeConnector | None = None

    def finish(self) -> list[int]:
        if self.fault_mid_step:
            assert self.connector is not None
            self.connector.lose_peer()  # the watchdog fires and aborts while the step's receives wait
            return [(p * 17 + 3) % VOCAB for p in self.prompts]  # rows released by the abort: garbage
        return [plain_token(p, self.step) for p in self.prompts]


class FakeMRV2:
    """The native runner below the mixin: enqueue in execute_model, sample asynchronously."""

    def __init__(self, device: FakeDevice) -> None:
        self.device = device

    def execute_model(self, prompts: list[int], step: int) -> None:
        self.device.prompts, self.device.step = prompts, step  # enqueued; the host returns at once

    def sample_tokens(self, grammar_output: object) -> AsyncModelRunnerOutput:
        return FakeAsyncOutput(self.device, [f"req-{p}" for p in self.device.prompts])


class AttentionRunner(AFDAttentionRunnerMixin, FakeMRV2):
    """The mixin over the fake: only the members its check points use (no vLLM config, no connector build)."""

    def __init__(self, device: FakeDevice, connector: FakeConnector, server_failed=NO_NOTICE) -> None:
        FakeMRV2.__init__(self, device)
        self.afd_connector = connector
        self._afd_step_gate = LocalStepGate(connector)
        self._afd_server_failed = server_failed
        self.afd_step = type("Step", (), {"in_step": False})()
        self._afd_telemetry = type("Telemetry", (), {"after_step": lambda self: None})()


def serve(runner, device: FakeDevice, fault_at: int | None, steps: int = 4) -> dict[int, tuple[list[int], str]]:
    """Run ``steps`` decode steps of three requests like vLLM's engine, streaming each step's tokens to the
    clients; per request, the tokens it was sent and the error it ended with ("" when it completed)."""
    prompts = [11, 22, 33]
    streamed: dict[int, list[int]] = {p: [] for p in prompts}
    for step in range(steps):
        device.fault_mid_step = step == fault_at
        try:
            runner.execute_model(prompts, step)  # both step gates pass: nothing has failed yet
            output = runner.sample_tokens(None).get_output()  # the executor's output thread
        except AFDPeerLostError as exc:
            return {p: (streamed[p], f"error: {exc}") for p in prompts}
        for prompt, tokens in zip(prompts, output.sampled_token_ids):
            streamed[prompt].extend(tokens)
    return {p: (streamed[p], "") for p in prompts}


@pytest.mark.parametrize("fault_at", [None, 0, 2, 3])
def test_every_request_gets_plain_tokens_or_an_error_never_a_token_of_the_aborted_step(fault_at):
    device, connector = FakeDevice(), FakeConnector()
    device.connector = connector
    runner = AttentionRunner(device, connector)

    outcome = serve(runner, device, fault_at)

    for prompt, (tokens, error) in outcome.items():
        plain = [plain_token(prompt, step) for step in range(4)]
        assert tokens == plain[:len(tokens)]  # every token a client saw is plain vLLM's
        assert error == "" if fault_at is None else ("AFD peer lost" in error and len(tokens) == fault_at)
    assert connector.observed == (0 if fault_at is None else 1)


def test_without_the_check_the_aborted_steps_token_reaches_the_client():
    """The hazard itself: the native runner alone hands on the garbage token of the step the abort released."""
    device, connector = FakeDevice(), FakeConnector()
    device.connector = connector

    outcome = serve(FakeMRV2(device), device, fault_at=2)

    assert connector.failure is not None
    assert all(tokens[2] != plain_token(prompt, 2) for prompt, (tokens, _) in outcome.items())


def test_a_step_that_ran_across_a_re_formation_hands_no_token_on():
    device, connector = FakeDevice(), FakeConnector()
    output = checked_output(FakeMRV2(device).sample_tokens(None), connector, outage_probe(None))
    connector.reformations += 1  # healed while the step's device work ran: its rows came from the old pairing

    with pytest.raises(AFDPeerLostError, match="paired again while a step ran; its sampled tokens are discarded"):
        output.get_output()


def test_a_synchronous_output_passes_unchanged():
    """The CPU runner's output is final when sample_tokens returns; its transfers were checked by the step gate."""
    connector = FakeConnector()
    output = runner_output(["a"], [[5]])

    assert checked_output(output, connector, outage_probe(None)) is output
    assert isinstance(checked_output(FakeAsyncOutput(FakeDevice(), []), connector, outage_probe(None)), CheckedOutput)


def test_a_checked_output_hands_on_the_kv_connector_output_vllm_salvages_from_a_failed_step():
    """vLLM 0.34's executor asks a failed output for its KV-connector output (abstract there): the wrapped one's."""
    inner = FakeAsyncOutput(FakeDevice(), [])
    inner.get_kv_connector_output = lambda: "the step's KV-connector output"

    checked = checked_output(inner, FakeConnector(), outage_probe(None))

    assert checked.get_kv_connector_output() == "the step's KV-connector output"


@pytest.mark.parametrize("fault_at", [None, 0, 2, 3])
def test_at_tp_2_no_token_of_a_step_another_rank_lost_its_peer_in(tmp_path, fault_at):
    """Attention TP 2 on FFN TP 2: rank 1 (paired with FFN rank 1) loses its peer mid-step; rank 0, whose own
    pairing holds and whose output vLLM reads, hands none of that step's tokens on and leaves with rank 1."""
    device = FakeDevice()
    output_rank, other_rank = FakeConnector(0, str(tmp_path)), FakeConnector(1, str(tmp_path))
    device.connector = other_rank  # its abort released the step; its garbage reached rank 0 by the all-reduce
    runner = AttentionRunner(device, output_rank, outage_probe(str(tmp_path)))

    outcome = serve(runner, device, fault_at)

    for prompt, (tokens, error) in outcome.items():
        plain = [plain_token(prompt, step) for step in range(4)]
        assert tokens == plain[:len(tokens)]
        assert error == "" if fault_at is None else ("another tensor-parallel rank" in error
                                                      and len(tokens) == fault_at)
    assert (output_rank.failure is None) == (fault_at is None)  # it re-forms with rank 1 (vLLM's retry heals both)
    assert output_rank.observed == (0 if fault_at is None else 1)


def test_at_tp_2_without_the_servers_notice_the_other_ranks_garbage_token_reaches_the_client(tmp_path):
    """The hazard the notice closes: the output rank's own check alone passes the step rank 1 lost."""
    device = FakeDevice()
    output_rank, other_rank = FakeConnector(0, str(tmp_path)), FakeConnector(1, str(tmp_path))
    device.connector = other_rank

    outcome = serve(AttentionRunner(device, output_rank), device, fault_at=2)  # rank-local check only

    assert other_rank.failure is not None and output_rank.failure is None
    assert all(error == "" and tokens[2] != plain_token(prompt, 2) for prompt, (tokens, error) in outcome.items())
