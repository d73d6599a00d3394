"""Where one rank sits in an AFD deployment: one frozen value, built once per process.

The role worker builds it from vLLM's distributed ranks (``vllm_afd/connect.py``) and hands it
to everything that needs a role or rank fact: the rendezvous, the handshake's fingerprint, the
watchdog, the step state, the transports' channel groups. Nothing copies these facts into a
settings object of its own. The other role's DP x TP split is not known before the handshake
and not needed after it: the attention publishes one row count per attention rank
(docs/topology.md#row-counts), and the handshake checks the two layouts against each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_afd.role import Role
from vllm_afd.wire.topology import (
    afd_rank,
    attention_block,
    compute_role_rank,
    data_subgroup,
    ffn_rank_for_attention,
)

__all__ = ["A2F", "CONTROL", "F2A", "Placement", "Role"]

# The three channels: hidden states attention -> FFN, FFN output FFN -> attention, and one control
# payload per step from attention rank k to FFN rank k.
A2F, F2A, CONTROL = "a2f", "f2a", "ctrl"


@dataclass(frozen=True, slots=True)
class Placement:
    """One rank's role, rank and groups; see the module docstring."""

    # Role.ATTENTION or Role.FFN (a config string is parsed to its member).
    role: Role
    # Index inside the role: global DP rank x TP size + TP rank.
    role_rank: int
    # A: attention ranks (attention DP x TP); F: FFN ranks (FFN DP x TP); A >= F.
    num_attention_ranks: int
    num_ffn_ranks: int
    # DP and TP size of this rank's own role (dp_size x tp_size = its role's rank count).
    dp_size: int = 1
    tp_size: int = 1

    def __post_init__(self) -> None:
        try:
            role = Role(self.role)
        except ValueError:
            raise ValueError(f"AFD placement: role must be 'attention' or 'ffn', got {self.role!r}") from None
        object.__setattr__(self, "role", role)  # NOTE: frozen dataclass: the parsed member replaces the string
        if not self.num_attention_ranks >= self.num_ffn_ranks >= 1:
            raise ValueError(
                f"AFD placement: expected num_attention_ranks >= num_ffn_ranks >= 1, got A="
                f"{self.num_attention_ranks}, F={self.num_ffn_ranks}. Fix additional_config['afd']"
            )
        if self.dp_size * self.tp_size != self.num_role_ranks:
            raise ValueError(
                f"AFD placement: {self.role} DP x TP = {self.dp_size} x {self.tp_size} differs from "
                f"num_{self.role}_ranks={self.num_role_ranks}; set num_{self.role}_ranks to the role's DP x TP"
            )
        if not 0 <= self.role_rank < self.num_role_ranks:
            raise ValueError(
                f"AFD placement: {self.role} rank {self.role_rank} is outside 0..{self.num_role_ranks - 1}"
            )

    @classmethod
    def for_rank(
        cls, role: Role | str, num_attention_ranks: int, num_ffn_ranks: int, *, dp_rank: int, tp_rank: int,
        dp_size: int, tp_size: int,
    ) -> Placement:
        """The placement of the worker with global DP rank ``dp_rank`` and TP rank ``tp_rank``."""
        role_size = num_attention_ranks if role == Role.ATTENTION else num_ffn_ranks
        role_rank = compute_role_rank(role, dp_rank, tp_rank, tp_size, role_size)
        return cls(role, role_rank, num_attention_ranks, num_ffn_ranks, dp_size, tp_size)

    # ---- derived facts --------------------------------------------------------------------------

    @property
    def num_role_ranks(self) -> int:
        """Rank count of this rank's role (A or F)."""
        return self.num_attention_ranks if self.role is Role.ATTENTION else self.num_ffn_ranks

    @property
    def label(self) -> str:
        """``"<role> rank <role_rank>"``, as messages name a rank."""
        return f"{self.role} rank {self.role_rank}"

    @property
    def afd_rank(self) -> int:
        """Rank among all F + A ranks, FFN first (FFN k -> k, attention j -> F + j)."""
        return afd_rank(self.role, self.role_rank, self.num_ffn_ranks)

    @property
    def subgroup(self) -> int:
        """Index k of this rank's data subgroup: the FFN rank it belongs to."""
        if self.role is Role.FFN:
            return self.role_rank
        return ffn_rank_for_attention(self.role_rank, self.num_attention_ranks, self.num_ffn_ranks)

    @property
    def subgroup_members(self) -> tuple[int, ...]:
        """AFD ranks of the data subgroup: FFN k first, then its attention block in order."""
        return data_subgroup(self.subgroup, self.num_attention_ranks, self.num_ffn_ranks)

    @property
    def subgroup_rank(self) -> int:
        return self.subgroup_members.index(self.afd_rank)

    @property
    def attention_peers(self) -> range:
        """FFN: the attention role ranks it serves, in subgroup order."""
        return attention_block(self.subgroup, self.num_attention_ranks, self.num_ffn_ranks)

    @property
    def control_rank(self) -> int | None:
        """Rank in the control group (its AFD rank), or None: attention ranks >= F publish nothing."""
        in_control = self.role is Role.FFN or self.role_rank < self.num_ffn_ranks
        return self.afd_rank if in_control else None

    @property
    def control_size(self) -> int:
        """The control group holds every FFN rank and attention ranks 0..F-1: 2F ranks."""
        return 2 * self.num_ffn_ranks

    @property
    def peers(self) -> tuple[tuple[Role, int], ...]:
        """(role, role_rank) of every data and control peer, sorted: the ranks whose heartbeats count.

        Attention rank j: its data FFN and, for j < F, its control FFN j. FFN rank k: its attention
        block and its control attention rank k. Symmetric: X lists Y exactly when Y lists X.
        """
        if self.role is Role.ATTENTION:
            named = {(Role.FFN, self.subgroup)}
            if self.control_rank is not None:
                named.add((Role.FFN, self.role_rank))
        else:
            named = {(Role.ATTENTION, j) for j in self.attention_peers} | {(Role.ATTENTION, self.role_rank)}
        return tuple(sorted(named))

    def channels(self) -> list[tuple[str, str, int, int]]:
        """(channel, store prefix, group rank, group size) of every group this rank joins, in the
        order every member creates them (NCCL creation blocks until all join)."""
        channels = [
            (A2F, f"afd/{A2F}/{self.subgroup}", self.subgroup_rank, len(self.subgroup_members)),
            (F2A, f"afd/{F2A}/{self.subgroup}", self.subgroup_rank, len(self.subgroup_members)),
        ]
        if self.control_rank is not None:
            channels.append((CONTROL, f"afd/{CONTROL}", self.control_rank, self.control_size))
        return channels
