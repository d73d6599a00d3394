"""The step a control payload opens: rows per stage, the step number, and when the step ends.

Every exchange of a step is sized by the payload that opened it, so the rows are derived once per
payload, here, and the connector only looks them up. A step ends one way: after its last exchange
(``exchanges_per_stage`` x stages); a graph replay runs its exchanges inside the graph and is not
counted (docs/connection.md#liveness, docs/protocol.md#step-state-and-receive-buffers). Plain values
only: no transport, no watchdog, no tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vllm_afd.wire.errors import AFDProtocolError
from vllm_afd.wire.messages import ControlPayload
from vllm_afd.role import Role
from vllm_afd.wire.placement import Placement
from vllm_afd.wire.topology import expand_dp_counts, ffn_dp_counts, rows

__all__ = ["Stage", "StepState"]


@dataclass(frozen=True, slots=True)
class Stage:
    """What one stage of the adopted payload sets on this rank."""

    # [A] published tokens per attention rank (before the >= 1 clamp).
    counts: tuple[int, ...]
    # Attention: rows this rank sends. FFN: rows it receives in total.
    own_rows: int
    # FFN: rows per attention peer in subgroup order; empty on attention ranks.
    peer_rows: tuple[int, ...]
    # [FFN DP] FFN at DP > 1: rows every FFN DP rank processes, the counts vLLM's MoE dispatch sizes its
    # collectives by (docs/topology.md#row-counts); empty at FFN DP 1 and on attention ranks.
    dp_counts: tuple[int, ...] = ()


class StepState:
    """The control payload in force on one rank and what it sets; see the module docstring."""

    def __init__(self, placement: Placement, exchanges_per_stage: int, connector_name: str) -> None:
        self.placement = placement
        self.exchanges_per_stage = exchanges_per_stage
        self.connector_name = connector_name
        self.payload: ControlPayload | None = None
        self.stages: dict[int, Stage] = {}
        self.num_exchanges = 0
        # Attention: sends issued in this step. With stages a stage sends before the previous stage's exchange
        # finished, so a send's position (layer-major, stage-minor) is this count, not ``num_exchanges``.
        self.num_sends = 0
        self.next_step_seq = 0

    def new_payload(self, counts_dp: Mapping[int, Sequence[int]], **flags: bool) -> ControlPayload:
        """Attention: the next step's payload from each stage's tokens per attention DP rank."""
        p = self.placement
        counts = {}
        for stage, per_dp in counts_dp.items():
            if len(per_dp) != p.dp_size:
                raise ValueError(
                    f"{self.connector_name}: stage {stage} counts {list(per_dp)} have {len(per_dp)} entries; "
                    f"expected one per attention DP rank ({p.dp_size}). Publish num_tokens_across_dp"
                )
            counts[stage] = tuple(expand_dp_counts(per_dp, p.tp_size))
        payload = ControlPayload(counts, **flags, step_seq=self.next_step_seq)
        self.next_step_seq += 1
        return payload

    def adopt(self, payload: ControlPayload) -> None:
        """Derive every stage's rows (FFN at DP > 1: every FFN DP rank's) from ``payload``; nothing changes
        when a count vector is wrong."""
        p = self.placement
        stages: dict[int, Stage] = {}
        for stage, counts in payload.counts.items():
            if len(counts) != p.num_attention_ranks:
                raise AFDProtocolError(
                    f"{self.connector_name}: control payload stage {stage} has {len(counts)} counts "
                    f"{list(counts)}; expected one per attention rank ({p.num_attention_ranks}). Run the same "
                    "vllm_afd version and num_attention_ranks on both roles"
                )
            if p.role is Role.ATTENTION:
                stages[stage] = Stage(counts, rows(counts[p.role_rank]), ())
            else:
                peer_rows = tuple(rows(counts[j]) for j in p.attention_peers)
                own_rows = sum(peer_rows)
                stages[stage] = Stage(counts, own_rows, peer_rows, self._dp_counts(stage, counts, own_rows))
        self.payload, self.stages, self.num_exchanges, self.num_sends = payload, stages, 0, 0

    def _dp_counts(self, stage: int, counts: tuple[int, ...], own_rows: int) -> tuple[int, ...]:
        """FFN: every FFN DP rank's rows in ``stage``, this rank's checked against ``own_rows``; () at FFN DP 1."""
        p = self.placement
        if p.dp_size == 1:
            return ()
        dp_counts = tuple(ffn_dp_counts(counts, p.num_attention_ranks, p.num_ffn_ranks, p.tp_size))
        dp_rank = p.role_rank // p.tp_size
        if dp_counts[dp_rank] != own_rows:
            # NOTE: cannot happen while the topology holds; guards the invariant that keeps the FFN DP ranks'
            # MoE collectives from hanging (each rank's entry is the rows it feeds them).
            raise AFDProtocolError(
                f"{self.connector_name}: stage {stage} gives {p.label} (FFN DP rank {dp_rank}) {dp_counts[dp_rank]} "
                f"rows among the FFN DP counts {list(dp_counts)}, but its attention peers send {own_rows}; expected "
                "equal. Run the same vllm_afd version on every rank"
            )
        return dp_counts

    def stage(self, stage: int) -> Stage:
        try:
            return self.stages[stage]
        except KeyError:
            raise RuntimeError(
                f"{self.connector_name}: no published rows for stage {stage} (stages {sorted(self.stages)}); "
                "expected a control payload for this step before its first exchange"
            ) from None

    def count_exchange(self) -> bool:
        """Count one finished exchange; true when it was the step's last."""
        self.num_exchanges += 1
        return self.num_exchanges == self.exchanges_per_stage * len(self.stages)
