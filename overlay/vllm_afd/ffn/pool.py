"""The FFN DP pool leaves a failed step together and re-forms together (docs/ffn.md#re-forming-a-pool).

At FFN DP > 1 every FFN DP rank runs vLLM's MoE collectives (all-gather, reduce-scatter) with the
others once per (layer, stage), and nothing of AFD can interrupt a rank blocked in one.  So a rank
whose attention is lost does not leave its step at the failed exchange: it finishes the step on
zero rows (`DrainingExchanges`: same row counts, so the collectives match its peers', no connector
call), and two agreements per step over vLLM's DP CPU group (`DPPool.agree`, one all-reduce of
one int each) decide, at the step's start and at its end, whether every rank goes on or every rank
re-forms.  At FFN DP 1, or with ``reform_timeout_s`` 0 (a loss ends the FFN), the pool is
`LOCAL_POOL`: no agreement, no drain, as before.  Decision 48 (docs/decisions.md).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from vllm.logger import init_logger

from vllm_afd.wire.errors import AFDPeerLostError, AFDRendezvousTimeout, AFDStepTimeoutError
from vllm_afd.wire.messages import A2FBatch, RoutingSpec

logger = init_logger(__name__)

# The failures an FFN re-forms after (ffn/loop.py); any other loop error ends the FFN.
REFORMABLE = (AFDPeerLostError, AFDStepTimeoutError)


def reforms_as_pool(data_parallel_size: int, reform_timeout_s: float) -> bool:
    """Whether this FFN's DP ranks must leave failed steps and re-form together."""
    return data_parallel_size > 1 and reform_timeout_s > 0


class LocalPool:
    """One FFN DP rank alone (FFN DP 1, or no re-forming): its own verdict is the pool's."""

    def agree(self, lost: BaseException | None, where: str) -> BaseException | None:
        return lost


LOCAL_POOL = LocalPool()


class DPPool:
    """Every FFN DP rank's verdict on a step, agreed over vLLM's DP CPU group (gloo) on the FFN loop thread."""

    def __init__(self, cpu_group: Any, bound_s: float, label: str) -> None:
        self.cpu_group = cpu_group
        self.bound_s = bound_s  # reform_timeout_s: a peer that does not arrive by then will not
        self.label = label

    def agree(self, lost: BaseException | None, where: str) -> BaseException | None:
        """None if every rank's step went on, else the failure this rank re-forms after (its own, or a peer's)."""
        import torch.distributed as dist

        ok = torch.tensor([0 if lost is not None else 1], dtype=torch.int32)  # [1]
        work = dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.cpu_group, async_op=True)
        try:
            work.wait(timeout=timedelta(seconds=self.bound_s))
        except RuntimeError as exc:
            raise AFDRendezvousTimeout(
                f"AFD {self.label}: the other FFN DP ranks did not reach the {where} agreement within "
                f"reform_timeout_s={self.bound_s:g} ({exc}); this FFN exits and vLLM ends every FFN DP rank. "
                "Restart the FFN server; check the other ranks' logs for the first error") from (lost or exc)
        if int(ok.item()) == 1:
            return None
        if lost is None:
            lost = AFDPeerLostError(
                f"AFD peer lost: another FFN DP rank lost its attention peers ({where}); {self.label} re-forms with "
                "every FFN DP rank (docs/ffn.md#re-forming-a-pool)")
            logger.warning("%s", lost)
        return lost


def make_pool(parallel_config: Any, reform_timeout_s: float, label: str) -> DPPool | LocalPool:
    """The pool of this FFN worker, built on the FFN loop's start (after vLLM created its DP group)."""
    if not reforms_as_pool(parallel_config.data_parallel_size, reform_timeout_s):
        return LOCAL_POOL
    from vllm.distributed.parallel_state import get_dp_group

    return DPPool(get_dp_group().cpu_group, reform_timeout_s, label)


class DrainingExchanges:
    """One step's exchanges that, once one fails, finish the step on zero rows and raise at its end.

    Stands in for the connector's ``recv_a2f`` / ``send_f2a`` / ``wait_sends`` in the FFN runner's step.
    """

    def __init__(self, connector: Any) -> None:
        self.connector = connector
        self.lost: BaseException | None = None

    def _fail(self, exc: BaseException) -> None:
        self.lost = exc
        logger.warning("AFD %s: %s; finishing this step on zero rows so the other FFN DP ranks' MoE collectives "
                       "complete, then re-forming", self.connector.placement.label, exc)

    def recv_a2f(self, stage: int, routing: RoutingSpec | None = None) -> A2FBatch:
        if self.lost is None:
            try:
                return self.connector.recv_a2f(stage, routing)
            except REFORMABLE as exc:
                self._fail(exc)
        state, spec = self.connector.steps.stage(stage), self.connector.spec
        hidden = torch.zeros(state.own_rows, spec.hidden_size, dtype=spec.dtype, device=spec.device)  # [rows, hidden]
        logits = (None if routing is None else  # [rows, num_experts]
                  torch.zeros(state.own_rows, routing.width, dtype=routing.dtype, device=spec.device))
        return A2FBatch(hidden, logits, state.peer_rows)

    def send_f2a(self, stage: int, output: torch.Tensor) -> None:
        if self.lost is None:
            try:
                self.connector.send_f2a(stage, output)
            except REFORMABLE as exc:
                self._fail(exc)

    def wait_sends(self) -> None:
        """The step's end: wait the sends, or raise the failure the step was drained after."""
        if self.lost is None:
            self.connector.wait_sends()
            return
        raise self.lost
