"""Where an attention rank raises its connector's failure: at a step's start and end, on every
tensor-parallel rank together (docs/failures.md#22-the-attention-tp-2-stall).

A failure recorded by one rank (its watchdog, one of its transfers) must not make that rank alone refuse
a step or leave it halfway: its tensor-parallel peers would wait in one of vLLM's collectives (the first
layer's all-reduce) for a rank that never comes, and nothing of AFD can release a rank from vLLM's
collective. So inside a step a failed transfer does not raise (attention/step.py fills its rows with zeros;
the step's result is discarded), and the ranks raise only at the two points every rank reaches: the gate
all-reduces "has my connector failed?" over the tensor-parallel group's CPU group and raises on every rank
if any has.

A third check point follows the step's device work: on CUDA the host leaves ``execute_model`` before the GPU
has run the step, so a peer lost meanwhile (the IPC flags or NCCL released by the abort) lets the step finish
on garbage after both gates passed. ``checked_output`` wraps Model Runner V2's asynchronous output so that
its ``get_output``, right after vLLM waited for the sampled tokens' copy, raises the failure instead of
handing those tokens to the scheduler (docs/failures.md#23-no-token-from-an-aborted-step).  At TP > 1 the
output rank reads one rank's output on vLLM's output thread, where no collective can run, so it learns another
rank's failure from the server's outage notice, which every failure writes before it releases a step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

from vllm_afd.wire.attention_end import AttentionConnector
from vllm_afd.wire.errors import AFDPeerLostError

__all__ = ["CheckedOutput", "LocalStepGate", "TensorParallelStepGate", "checked_output", "make_step_gate"]


def _raise(connector: AttentionConnector, failure: BaseException) -> None:
    connector.check_failed()  # NOTE: the sticky failure goes through the latch, which marks it observed
    raise failure


class LocalStepGate:
    """One attention rank per server (TP 1): raise this connector's failure."""

    def __init__(self, connector: AttentionConnector) -> None:
        self.connector = connector

    def check(self) -> None:
        failure = self.connector.take_step_failure()
        if failure is not None:
            _raise(self.connector, failure)


class TensorParallelStepGate:
    """TP > 1: every rank raises if any rank's connector has failed, none otherwise (one all-reduce)."""

    def __init__(self, connector: AttentionConnector, cpu_group: Any) -> None:
        self.connector = connector
        self.cpu_group = cpu_group
        self._flag = torch.zeros(1, dtype=torch.int32)  # [1]: 1 once this rank's connector failed

    def check(self) -> None:
        failure = self.connector.take_step_failure()
        self._flag.fill_(0 if failure is None else 1)
        torch.distributed.all_reduce(self._flag, op=torch.distributed.ReduceOp.MAX, group=self.cpu_group)
        if int(self._flag.item()) == 0:
            return
        if failure is None:
            failure = self.connector.fail(AFDPeerLostError(
                f"AFD peer lost: another tensor-parallel rank of this attention server lost its FFN peer (its "
                f"log line 'AFD connector failed' names the cause); {self.connector.placement.label} leaves the "
                "step with it, so that every rank of the server raises together"))
        _raise(self.connector, failure)


def make_step_gate(connector: AttentionConnector, tp_size: int,
                   cpu_group: Any) -> LocalStepGate | TensorParallelStepGate:
    return LocalStepGate(connector) if tp_size == 1 else TensorParallelStepGate(connector, cpu_group)


class CheckedOutput(AsyncModelRunnerOutput):
    """A step's asynchronous output whose tokens reach the scheduler only if the pairing survived its device work,
    on every tensor-parallel rank of the server (``server_failed``: outage.py's ``outage_probe``)."""

    def __init__(self, output: AsyncModelRunnerOutput, connector: AttentionConnector,
                 server_failed: Callable[[], bool]) -> None:
        self.output = output
        self.connector = connector
        self.server_failed = server_failed
        self.pairing = connector.reformations  # the pairing the step ran on

    def get_output(self) -> ModelRunnerOutput:
        result = self.output.get_output()  # NOTE: vLLM waits here for the sampled tokens' copy, so for the step
        connector = self.connector
        own_pairing_held = (connector.failure is None and not connector.reforming
                            and connector.reformations == self.pairing)
        if own_pairing_held and not self.server_failed():
            return result
        if own_pairing_held:
            # NOTE: another TP rank lost its FFN peer: its latch wrote the notice before it released the step's
            # receives, so before its rows reached this rank's all-reduce; this rank leaves with it (as at the gate).
            connector.fail(AFDPeerLostError(
                f"AFD peer lost: another tensor-parallel rank of this attention server lost its FFN peer while a "
                f"step ran (its log line 'AFD connector failed' names the cause); {connector.placement.label} "
                "discards the step's sampled tokens (docs/failures.md#23-no-token-from-an-aborted-step)"))
        connector.check_failed()  # the sticky failure, marked observed
        raise AFDPeerLostError(
            f"AFD peer lost: {connector.placement.label}'s connector paired again while a step ran; its sampled "
            "tokens are discarded (docs/failures.md#23-no-token-from-an-aborted-step)")

    def get_kv_connector_output(self) -> Any:
        """vLLM 0.34+ salvages a failed step's KV-connector output through this (abstract there): the wrapped
        output's, as without AFD."""
        return self.output.get_kv_connector_output()


def checked_output(output: Any, connector: AttentionConnector, server_failed: Callable[[], bool]) -> Any:
    """``output`` of ``sample_tokens``, its asynchronous kind checked after the device work (``CheckedOutput``).

    A synchronous ``ModelRunnerOutput`` (the CPU runner) passes unchanged: its forward ran on the host, every
    transfer of it completed or failed before ``execute_model`` returned, and the step gate saw it."""
    return CheckedOutput(output, connector, server_failed) if isinstance(output, AsyncModelRunnerOutput) else output
