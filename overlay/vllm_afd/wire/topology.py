"""AFD topology: role ranks, AFD ranks, data pairing, row counts, layout rule (control pairing: placement.py).

Pure integer arithmetic on plain values (docs/topology.md), shared by the placement, the step state
and the handshake so that every rank derives the same pairing from the same numbers.
Terms: A / F = ``num_attention_ranks`` / ``num_ffn_ranks``; a role rank indexes a worker inside its
role; AFD ranks are FFN-first (FFN k -> k, attention j -> F + j).
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_afd.role import Role
from vllm_afd.wire.errors import AFDLayoutError

__all__ = [
    "afd_rank",
    "attention_block",
    "check_layout",
    "compute_role_rank",
    "data_subgroup",
    "expand_dp_counts",
    "ffn_dp_counts",
    "ffn_rank_for_attention",
    "peer_rows",
    "rows",
]

_ROLES = tuple(role.value for role in Role)


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def _check_sizes(num_attention_ranks: int, num_ffn_ranks: int) -> None:
    # Internal invariant: AFDConfig validation already guarantees A >= F >= 1.
    assert num_ffn_ranks >= 1 and num_attention_ranks >= num_ffn_ranks, (
        f"AFD topology needs num_attention_ranks >= num_ffn_ranks >= 1, got A={num_attention_ranks}, "
        f"F={num_ffn_ranks}"
    )


def _check_role(role: str) -> None:
    if role not in _ROLES:
        raise ValueError(f"AFD topology: role must be one of {_ROLES}, got {role!r}")


def compute_role_rank(role: str, dp_rank: int, tp_rank: int, tp_size: int, role_size: int) -> int:
    """``dp_rank * tp_size + tp_rank`` (pcp_size = 1; docs/topology.md#role-rank); ``dp_rank`` is
    vLLM's *global* DP rank.

    Adding the DP start rank a second time is a known mistake (docs/topology.md#role-rank), hence the range
    check.
    """
    _check_role(role)
    role_rank = dp_rank * tp_size + tp_rank
    if not (0 <= tp_rank < tp_size and dp_rank >= 0 and 0 <= role_rank < role_size):
        raise ValueError(
            f"AFD role rank derived from distributed ranks is out of range: role={role}, "
            f"dp_rank={dp_rank}, tp_rank={tp_rank}, role_size={role_size} (tp_size={tp_size}, "
            f"role_rank={role_rank}); num_{role}_ranks must equal the {role} role's DP x TP"
        )
    return role_rank


def afd_rank(role: str, role_rank: int, num_ffn_ranks: int) -> int:
    """Index in the FFN-first combined space: FFN k -> k, attention j -> F + j."""
    _check_role(role)
    return role_rank if role == Role.FFN else num_ffn_ranks + role_rank


def ffn_rank_for_attention(attention_rank: int, num_attention_ranks: int, num_ffn_ranks: int) -> int:
    """FFN rank serving attention ``j``'s data: ``floor(j * F / A)`` (no divisibility rule: docs/config.md, step 10)."""
    _check_sizes(num_attention_ranks, num_ffn_ranks)
    assert 0 <= attention_rank < num_attention_ranks, f"attention rank {attention_rank} not in [0, A)"
    return attention_rank * num_ffn_ranks // num_attention_ranks


def attention_block(ffn_rank: int, num_attention_ranks: int, num_ffn_ranks: int) -> range:
    """Attention ranks served by FFN ``k``: ``[ceil(k*A/F), ceil((k+1)*A/F))``, never empty for A >= F."""
    _check_sizes(num_attention_ranks, num_ffn_ranks)
    assert 0 <= ffn_rank < num_ffn_ranks, f"FFN rank {ffn_rank} not in [0, F)"
    start = _ceil_div(ffn_rank * num_attention_ranks, num_ffn_ranks)
    stop = _ceil_div((ffn_rank + 1) * num_attention_ranks, num_ffn_ranks)
    return range(start, stop)


def data_subgroup(ffn_rank: int, num_attention_ranks: int, num_ffn_ranks: int) -> tuple[int, ...]:
    """AFD ranks of data subgroup ``k``: FFN k first (subgroup rank 0), then its block ascending."""
    block = attention_block(ffn_rank, num_attention_ranks, num_ffn_ranks)
    return (ffn_rank, *(num_ffn_ranks + j for j in block))


def expand_dp_counts(counts_dp: Sequence[int], tp_attention: int) -> list[int]:
    """DP-level row counts -> one entry per attention rank (rank j gets entry ``j // TP``)."""
    if tp_attention < 1:
        raise ValueError(f"AFD row counts: attention TP size must be >= 1, got {tp_attention}")
    return [int(count) for count in counts_dp for _ in range(tp_attention)]


def rows(count: int) -> int:
    """Rows a rank actually sends: an idle DP rank runs a 1-token dummy batch, so at least 1."""
    return max(1, int(count))


def peer_rows(counts: Sequence[int], ffn_rank: int, num_attention_ranks: int, num_ffn_ranks: int) -> list[int]:
    """Rows FFN ``k`` receives from each peer of its block, in subgroup order (e.g. [0, 4] -> [1, 4]).

    ``counts`` has one entry per attention rank (the control payload's vector, TP-expanded).
    """
    if len(counts) != num_attention_ranks:
        raise ValueError(
            f"AFD row counts: {len(counts)} entries, expected one per attention rank "
            f"(num_attention_ranks={num_attention_ranks}); publish TP-expanded counts"
        )
    return [rows(counts[j]) for j in attention_block(ffn_rank, num_attention_ranks, num_ffn_ranks)]


def ffn_dp_counts(counts: Sequence[int], num_attention_ranks: int, num_ffn_ranks: int, tp_ffn: int) -> list[int]:
    """FFN-level DP token counts for the FFN's forward context (docs/topology.md#row-counts).

    FFN DP rank d processes the rows of FFN role rank ``d * TP_ffn + t``, equal for every t by the
    layout rule; the result has one entry per FFN DP rank.
    """
    if tp_ffn < 1 or num_ffn_ranks % tp_ffn:
        raise AFDLayoutError(
            f"AFD row counts: num_ffn_ranks={num_ffn_ranks} is not a multiple of FFN TP {tp_ffn}; "
            "num_ffn_ranks must equal FFN DP x TP"
        )
    totals = [sum(peer_rows(counts, k, num_attention_ranks, num_ffn_ranks)) for k in range(num_ffn_ranks)]
    per_dp = [totals[d * tp_ffn : (d + 1) * tp_ffn] for d in range(num_ffn_ranks // tp_ffn)]
    for d, peer_totals in enumerate(per_dp):
        if len(set(peer_totals)) != 1:
            raise AFDLayoutError(
                f"AFD row counts: the TP peers of FFN DP rank {d} would process {peer_totals} rows; "
                "expected equal rows (the layout rule). Use the same DP and TP on both "
                "roles, or FFN TP = 1"
            )
    return [peer_totals[0] for peer_totals in per_dp]


def check_layout(
    attention_dp: int,
    attention_tp: int,
    ffn_dp: int,
    ffn_tp: int,
    num_attention_ranks: int,
    num_ffn_ranks: int,
) -> None:
    """Every TP peer of an FFN DP rank must see the same attention DP ranks in the same order
    (docs/topology.md#layout-rule).

    The FFN's MLP/MoE all-reduces across its TP peers, so row i on every peer must be the same token.
    Raises ``AFDLayoutError`` (a ``ValueError``) otherwise.
    """
    shape = f"attention DPxTP = {attention_dp}x{attention_tp}, FFN DPxTP = {ffn_dp}x{ffn_tp}"
    for role, dp, tp, total in (
        (Role.ATTENTION, attention_dp, attention_tp, num_attention_ranks),
        (Role.FFN, ffn_dp, ffn_tp, num_ffn_ranks),
    ):
        if dp < 1 or tp < 1 or dp * tp != total:
            raise AFDLayoutError(
                f"AFD layout invalid: num_{role}_ranks ({total}) must equal {role} DP x TP "
                f"({dp} x {tp}) ({shape}); set num_{role}_ranks to the {role} role's DP x TP"
            )
    if num_attention_ranks < num_ffn_ranks:
        raise AFDLayoutError(
            f"AFD layout invalid: num_attention_ranks ({num_attention_ranks}) < num_ffn_ranks "
            f"({num_ffn_ranks}) ({shape}); every FFN rank needs at least one attention peer"
        )
    for d in range(ffn_dp):
        sources = {
            tuple(j // attention_tp for j in attention_block(k, num_attention_ranks, num_ffn_ranks))
            for k in range(d * ffn_tp, (d + 1) * ffn_tp)
        }
        if len(sources) > 1:
            raise AFDLayoutError(
                f"AFD layout invalid: the TP peers of FFN DP rank {d} would receive different tokens "
                f"({shape}); use the same DP and TP on both roles, or FFN TP = 1"
            )
