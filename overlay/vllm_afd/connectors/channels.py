"""What the P2P protocol and its transports share: settings, channel plan, transport interface.

A transport moves whole contiguous tensors between group ranks of three channels: ``a2e`` (attention
-> FFN) and ``e2a`` (FFN -> attention) per data subgroup, and ``ctrl`` (attention k -> FFN k). Which
ranks form which group is decided here, from the topology of AFD_SPEC.md §3.2-3.3, so every backend
builds the same groups in the same order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from vllm_afd.topology import afd_rank, data_subgroup, ffn_rank_for_attention

__all__ = ["A2E", "CONTROL", "E2A", "ChannelPlan", "P2pSettings", "P2pTransport"]

A2E, E2A, CONTROL = "a2e", "e2a", "ctrl"


@dataclass(frozen=True, slots=True)
class P2pSettings:
    """Plain values the protocol needs; built from VllmConfig + AFDConfig (fingerprint.py) or by tests."""

    role: str
    role_rank: int
    num_attention_ranks: int
    num_ffn_ranks: int
    # Width and dtype of every exchanged row, and the device tensors live on.
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    # Store address (FFN rank 0) and the three bounds of §3.8.
    host: str
    port: int
    rendezvous_timeout_s: float
    step_timeout_s: float
    peer_timeout_s: float
    compute_gate_on_attention: bool = False
    # DP size of this rank's role (the V1 publish path picks its counts source by it).
    dp_size: int = 1
    # Exchanges per stage of one step (crossing layers); None when unknown (no count-based step end).
    exchanges_per_stage: int | None = None
    # Router-logit width the attention may send (routed experts); None when unknown.
    num_routed_experts: int | None = None
    # FFN: persistent receive buffers keyed by (stage, peer, shape), for CUDA-graph replay.
    use_graph_buffers: bool = False
    # Class name used in messages.
    connector_name: str = "P2P connector"


@dataclass(frozen=True, slots=True)
class ChannelPlan:
    """This rank's place in its data subgroup and in the control group (§3.2-3.3)."""

    # This rank's AFD rank (FFN k -> k, attention j -> F + j).
    afd_rank: int
    # Data subgroup index k (its FFN's role rank) and its members' AFD ranks, FFN first.
    subgroup: int
    subgroup_members: tuple[int, ...]
    # Rank in the control group (= AFD rank), or None for attention ranks >= F; the group's size 2F.
    control_rank: int | None
    control_size: int

    @property
    def subgroup_rank(self) -> int:
        return self.subgroup_members.index(self.afd_rank)

    @property
    def subgroup_size(self) -> int:
        return len(self.subgroup_members)

    def channels(self) -> list[tuple[str, str, int, int]]:
        """(channel, store prefix, group rank, group size) for every group this rank joins,
        in the order every member creates them (NCCL creation blocks until all join)."""
        channels = [
            (A2E, f"afd/{A2E}/{self.subgroup}", self.subgroup_rank, self.subgroup_size),
            (E2A, f"afd/{E2A}/{self.subgroup}", self.subgroup_rank, self.subgroup_size),
        ]
        if self.control_rank is not None:
            channels.append((CONTROL, f"afd/{CONTROL}", self.control_rank, self.control_size))
        return channels

    @classmethod
    def for_rank(cls, role: str, role_rank: int, num_attention_ranks: int, num_ffn_ranks: int) -> ChannelPlan:
        own = afd_rank(role, role_rank, num_ffn_ranks)
        k = role_rank if role == "ffn" else ffn_rank_for_attention(role_rank, num_attention_ranks, num_ffn_ranks)
        members = data_subgroup(k, num_attention_ranks, num_ffn_ranks)
        in_control = role == "ffn" or role_rank < num_ffn_ranks
        return cls(own, k, members, own if in_control else None, 2 * num_ffn_ranks)


class P2pTransport(ABC):
    """Moves whole contiguous tensors on three channels (a2e, e2a, ctrl); ranks are group ranks."""

    # Where control tensors (length, body) live: CPU for gloo, the rank's GPU for NCCL.
    control_device: torch.device

    @abstractmethod
    def open(self, store: Any, plan: ChannelPlan, timeout_s: float) -> None:
        """Create a2e, then e2a, then the control group if ``plan.control_rank`` is set (same order everywhere)."""

    @abstractmethod
    def send(self, channel: str, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` (any dtype) to group rank ``dst``."""

    @abstractmethod
    def recv(self, channel: str, tensor: torch.Tensor, src: int) -> int:
        """Fill ``tensor`` from group rank ``src``; returns the rank the bytes came from."""

    @abstractmethod
    def abort(self) -> None:
        """Best effort, from any thread: make pending transfers fail where the backend allows."""

    @abstractmethod
    def close(self) -> None:
        """Release the channels; idempotent, bounded."""
