"""No token from an aborted step (docs/failures.md#23-no-token-from-an-aborted-step): the attention runner's
``sample_tokens`` hands vLLM an output whose ``get_output``, after the wait for the sampled tokens, raises the
connector's failure.

A recording fake stands for Model Runner V2 on a GPU: ``execute_model`` returns once the step is enqueued (both
step gates pass, nothing has failed yet), the "device" finishes the step later, and ``sample_tokens`` returns an
``AsyncModelRunnerOutput`` whose ``get_output`` waits for it, as MRV2's ``AsyncOutput`` waits for its copy event.
The fault is injected mid-step, between the two: the peer is lost, the abort releases the step's receives, and
the step finishes on garbage rows.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput  # noqa: E402

from vllm_afd.attention.mixin import AFDAttentionRunnerMixin  # noqa: E402
from vllm_afd.attention.step_gate import CheckedOutput, LocalStepGate, checked_output  # noqa: E402
from vllm_afd.wire.errors import AFDPeerLostError  # noqa: E402

VOCAB = 1000


def plain_token(prompt: int, step: int) -> int:
    """What plain vLLM samples for request ``prompt`` at ``step`` (the FFN's rows arrived intact)."""
    return (prompt * 31 + step * 7) % VOCAB


class FakeConnector:
    """The connector surface the runner's check points read: the sticky failure and the pairing count."""

    def __init__(self) -> None:
        self.placement = type("Placement", (), {"label": "attention rank 0"})()
        self.failure: BaseException | None = None
        self.reformations = 0
        self.reforming = False
        self.observed = 0

    def lose_peer(self) -> None:
        if self.failure is None:
            self.failure = AFDPeerLostError("AFD peer lost: ffn rank 0 silent for 5.0s")

    def check_failed(self) -> None:
        if self.failure is not None:
            self.observed += 1
            raise self.failure

    def take_step_failure(self) -> BaseException | None:
        return self.failure


class FakeAsyncOutput(AsyncModelRunnerOutput):
    """MRV2's AsyncOutput: ``get_output`` waits for the step's device work, then reads the tokens."""

    def __init__(self, device: FakeDevice, req_ids: list[str]) -> None:
        self.device, self.req_ids = device, req_ids

    def get_output(self) -> ModelRunnerOutput:
        tokens = self.device.finish()  # the wait for the copy event: the step's kernels ran by now
        return ModelRunnerOutput(req_ids=self.req_ids, req_id_to_index={r: i for i, r in enumerate(self.req_ids)},
                                 sampled_token_ids=[[t] for t in tokens])


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

    def __init__(self, device: FakeDevice, connector: FakeConnector) -> None:
        FakeMRV2.__init__(self, device)
        self.afd_connector = connector
        self._afd_step_gate = LocalStepGate(connector)
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
    output = checked_output(FakeMRV2(device).sample_tokens(None), connector)
    connector.reformations += 1  # healed while the step's device work ran: its rows came from the old pairing

    with pytest.raises(AFDPeerLostError, match="paired again while a step ran; its sampled tokens are discarded"):
        output.get_output()


def test_a_synchronous_output_passes_unchanged():
    """The CPU runner's output is final when sample_tokens returns; its transfers were checked by the step gate."""
    connector = FakeConnector()
    output = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}, sampled_token_ids=[[5]])

    assert checked_output(output, connector) is output
    assert isinstance(checked_output(FakeAsyncOutput(FakeDevice(), []), connector), CheckedOutput)
