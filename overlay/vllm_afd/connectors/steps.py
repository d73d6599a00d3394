"""The step state a control payload sets (AFD_SPEC.md §4.3-4.4): rows per stage, exchanges, step ids.

Every exchange of a step is sized by the payload that opened it, so the rows are derived once per
payload, here, and the data plane only looks them up. ``StepState`` also numbers the attention's
payloads (``step_seq``) and counts the step's exchanges, so the protocol can end the step after its
last one. Plain values only: no transport, no watchdog, no tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_afd.connectors.channels import P2pSettings
from vllm_afd.connectors.metadata import AFDControlPayload, AFDDPMetadata
from vllm_afd.errors import AFDProtocolError
from vllm_afd.topology import attention_block, expand_dp_counts, rows

__all__ = ["StepState"]


@dataclass(frozen=True, slots=True)
class _Stage:
    # [A] published rows per attention rank (TP-expanded, before the >= 1 clamp).
    counts: tuple[int, ...]
    # Attention: rows this rank sends. FFN: rows it receives in total.
    own_rows: int
    # FFN: rows per peer in subgroup order; empty on attention ranks.
    peer_rows: tuple[int, ...]


class StepState:
    """The control payload in force on one rank and what it sets; see the module docstring."""

    def __init__(self, settings: P2pSettings) -> None:
        self.settings = settings
        self.payload: AFDControlPayload | None = None
        self.stages: dict[int, _Stage] = {}
        self.num_exchanges = 0
        self.next_step_seq = 0

    def new_payload(self, stages: Mapping[int, Any], **flags: bool) -> AFDControlPayload:
        """The next step's payload from a count list, AFDDPMetadata or vLLM DPMetadata per stage."""
        converted = {
            stage: AFDDPMetadata(tuple(value)) if isinstance(value, Sequence) else value
            for stage, value in stages.items()
        }
        payload = AFDControlPayload(converted, **flags, step_seq=self.next_step_seq)
        self.next_step_seq += 1
        return payload

    def adopt(self, payload: AFDControlPayload, attention_tp: int) -> None:
        """Derive every stage's rows from ``payload``; nothing changes when a count list is wrong."""
        s = self.settings
        num_dp = s.num_attention_ranks // attention_tp
        stages: dict[int, _Stage] = {}
        for stage_idx, metadata in payload.dp_metadata_list.items():
            counts_dp = metadata.num_tokens_across_dp_cpu
            if len(counts_dp) != num_dp:
                raise AFDProtocolError(
                    f"{s.connector_name}: control payload stage {stage_idx} has {len(counts_dp)} DP "
                    f"counts {list(counts_dp)}; expected one per attention DP rank ({num_dp} = "
                    f"{s.num_attention_ranks} ranks / TP {attention_tp}). Publish "
                    "num_tokens_across_dp for every attention DP rank"
                )
            counts = tuple(expand_dp_counts(counts_dp, attention_tp))
            if s.role == "attention":
                stages[stage_idx] = _Stage(counts, rows(counts[s.role_rank]), ())
            else:
                block = attention_block(s.role_rank, s.num_attention_ranks, s.num_ffn_ranks)
                peer_rows = tuple(rows(counts[j]) for j in block)
                stages[stage_idx] = _Stage(counts, sum(peer_rows), peer_rows)
        self.payload, self.stages, self.num_exchanges = payload, stages, 0

    def stage(self, stage_idx: int) -> _Stage:
        try:
            return self.stages[stage_idx]
        except KeyError:
            raise RuntimeError(
                f"{self.settings.connector_name}: no published state for stage {stage_idx} (stages "
                f"{sorted(self.stages)}); expected a control payload for this step before its first "
                "exchange. Publish with send_dp_metadata / update_state_from_dp_metadata"
            ) from None

    def count_exchange(self) -> bool:
        """Count one finished exchange; true when it was the step's last (``exchanges_per_stage`` set)."""
        per_stage = self.settings.exchanges_per_stage
        self.num_exchanges += 1
        return per_stage is not None and self.num_exchanges == per_stage * len(self.stages)
