"""vllm_afd.wire.topology: ranks, pairing, row counts and the layout rule (docs/topology.md)."""

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from vllm_afd.wire.errors import AFDLayoutError
from vllm_afd.wire.placement import Placement
from vllm_afd.wire.topology import (
    afd_rank,
    attention_block,
    check_layout,
    compute_role_rank,
    data_subgroup,
    expand_dp_counts,
    ffn_dp_counts,
    ffn_rank_for_attention,
    peer_rows,
    rows,
)


def _placement(num_attention_ranks, num_ffn_ranks, role, role_rank):
    role_size = num_attention_ranks if role == "attention" else num_ffn_ranks
    return Placement(role, role_rank, num_attention_ranks, num_ffn_ranks, role_size, 1)


def _control_peer(placement):
    """Role rank of the other role on the control channel: rank k pairs with rank k; None outside the group."""
    return None if placement.control_rank is None else placement.role_rank


def _pairing(num_attention_ranks, num_ffn_ranks, role, role_rank):
    """(data subgroup as AFD ranks, control destinations as role ranks) of one rank, from its Placement."""
    placement = _placement(num_attention_ranks, num_ffn_ranks, role, role_rank)
    peer = _control_peer(placement)
    return placement.subgroup_members, (() if peer is None else (peer,))


# --- role and AFD ranks (docs/topology.md#role-rank) ---------------------------------------------


@pytest.mark.parametrize(
    ("dp_rank", "tp_rank", "tp_size", "role_size", "expected"),
    [(1, 1, 2, 4, 3), (0, 1, 2, 2, 1), (0, 0, 1, 1, 0), (2, 0, 1, 3, 2)],
)
def test_role_rank_is_dp_rank_times_tp_plus_tp_rank(dp_rank, tp_rank, tp_size, role_size, expected):
    assert compute_role_rank("attention", dp_rank, tp_rank, tp_size, role_size) == expected


@pytest.mark.parametrize(("dp_rank", "tp_rank", "tp_size", "role_size"), [(2, 0, 2, 4), (1, 0, 1, 1), (0, 2, 2, 4),
                                                                          (-1, 1, 1, 2), (0, -1, 2, 2)])
def test_role_rank_out_of_range_is_rejected(dp_rank, tp_rank, tp_size, role_size):
    """Regression (reference bug #192): the DP start rank added twice pushes the rank out of range."""
    with pytest.raises(ValueError) as info:
        compute_role_rank("ffn", dp_rank, tp_rank, tp_size, role_size)

    assert str(info.value).startswith(
        "AFD role rank derived from distributed ranks is out of range: "
        f"role=ffn, dp_rank={dp_rank}, tp_rank={tp_rank}, role_size={role_size}"
    )


def test_unknown_role_is_rejected():
    with pytest.raises(ValueError, match="role must be one of"):
        compute_role_rank("moe", 0, 0, 1, 1)


def test_afd_ranks_are_ffn_first():
    assert afd_rank("attention", 3, 4) == 7
    assert afd_rank("ffn", 3, 4) == 3
    assert [afd_rank("attention", j, 2) for j in range(3)] == [2, 3, 4]


# --- pairing (docs/topology.md#data-pairing, #control-pairing, #worked-examples) ----------------


@pytest.mark.parametrize(
    ("num_attention_ranks", "num_ffn_ranks", "role", "role_rank", "subgroup", "control"),
    [
        (2, 2, "attention", 1, (1, 3), (1,)),
        (2, 1, "attention", 0, (0, 1, 2), (0,)),
        (4, 2, "attention", 2, (1, 4, 5), ()),
        (4, 2, "ffn", 1, (1, 4, 5), (1,)),
        (4, 2, "attention", 1, (0, 2, 3), (1,)),  # control to FFN 1, data to FFN 0
        (1, 1, "attention", 0, (0, 1), (0,)),
    ],
)
def test_pairing_examples_of_the_checklist(num_attention_ranks, num_ffn_ranks, role, role_rank, subgroup, control):
    assert _pairing(num_attention_ranks, num_ffn_ranks, role, role_rank) == (subgroup, control)


@pytest.mark.parametrize(
    ("num_attention_ranks", "num_ffn_ranks", "subgroups", "controls"),
    [
        (1, 1, [("F0", "A0")], {0: 0}),
        (2, 1, [("F0", "A0", "A1")], {0: 0, 1: None}),
        (2, 2, [("F0", "A0"), ("F1", "A1")], {0: 0, 1: 1}),
        (3, 2, [("F0", "A0", "A1"), ("F1", "A2")], {0: 0, 1: 1, 2: None}),
        (4, 2, [("F0", "A0", "A1"), ("F1", "A2", "A3")], {0: 0, 1: 1, 2: None, 3: None}),
    ],
)
def test_worked_examples_of_the_layout_section(num_attention_ranks, num_ffn_ranks, subgroups, controls):
    def name(rank):
        return f"F{rank}" if rank < num_ffn_ranks else f"A{rank - num_ffn_ranks}"

    actual = [tuple(map(name, data_subgroup(k, num_attention_ranks, num_ffn_ranks))) for k in range(num_ffn_ranks)]

    assert actual == subgroups
    placements = {j: _placement(num_attention_ranks, num_ffn_ranks, "attention", j) for j in controls}
    assert {j: _control_peer(placement) for j, placement in placements.items()} == controls
    assert {placement.control_size for placement in placements.values()} == {2 * num_ffn_ranks}


_sizes = st.integers(1, 48).flatmap(lambda a: st.tuples(st.just(a), st.integers(1, a)))


@given(_sizes)
@example((5, 2))
@example((3, 2))
def test_blocks_partition_attention_ranks_contiguously_and_evenly(sizes):
    num_attention_ranks, num_ffn_ranks = sizes

    blocks = [attention_block(k, num_attention_ranks, num_ffn_ranks) for k in range(num_ffn_ranks)]

    assert [j for block in blocks for j in block] == list(range(num_attention_ranks))
    assert all(block.step == 1 and len(block) >= 1 for block in blocks)
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


@given(_sizes)
def test_data_map_is_monotone_and_inverse_of_the_blocks(sizes):
    num_attention_ranks, num_ffn_ranks = sizes

    owners = [ffn_rank_for_attention(j, num_attention_ranks, num_ffn_ranks) for j in range(num_attention_ranks)]

    assert owners == sorted(owners)
    for j, k in enumerate(owners):
        assert k == j * num_ffn_ranks // num_attention_ranks
        assert j in attention_block(k, num_attention_ranks, num_ffn_ranks)
        subgroup = data_subgroup(k, num_attention_ranks, num_ffn_ranks)
        assert subgroup[0] == k and afd_rank("attention", j, num_ffn_ranks) in subgroup[1:]


# --- row counts (docs/topology.md#row-counts) ----------------------------------------------------


def test_idle_attention_rank_sends_one_row():
    assert peer_rows([0, 4], 0, 2, 1) == [1, 4]
    assert sum(peer_rows([0, 4], 0, 2, 1)) == 5
    assert [rows(n) for n in (0, 1, 7)] == [1, 1, 7]


def test_dp_counts_expand_to_one_entry_per_attention_rank():
    assert expand_dp_counts([3, 5], 2) == [3, 3, 5, 5]
    assert expand_dp_counts([3, 5], 1) == [3, 5]
    with pytest.raises(ValueError, match="attention TP size must be >= 1"):
        expand_dp_counts([3], 0)


@pytest.mark.parametrize(
    ("counts", "num_attention_ranks", "num_ffn_ranks", "per_ffn"),
    [
        ([3, 0], 2, 1, [[3, 1]]),
        ([1, 2, 3, 0], 4, 2, [[1, 2], [3, 1]]),
        ([1, 2, 3, 4, 5, 6], 6, 3, [[1, 2], [3, 4], [5, 6]]),
        ([1, 2, 3], 3, 2, [[1, 2], [3]]),
        ([1, 2, 3, 4, 5], 5, 2, [[1, 2, 3], [4, 5]]),
        ([8, 8, 0, 0], 4, 2, [[8, 8], [1, 1]]),  # attention DP2 x TP2, TP-expanded by the publisher
    ],
)
def test_per_peer_ffn_shapes(counts, num_attention_ranks, num_ffn_ranks, per_ffn):
    actual = [peer_rows(counts, k, num_attention_ranks, num_ffn_ranks) for k in range(num_ffn_ranks)]

    assert actual == per_ffn


@pytest.mark.parametrize("counts", [[1, 2, 3], [8, 0]])
def test_count_vector_of_the_wrong_length_is_rejected(counts):
    """The payload carries one count per attention rank; a DP-level vector (protocol 1) is refused."""
    with pytest.raises(ValueError) as info:
        peer_rows(counts, 0, 4, 2)

    assert str(info.value) == (
        f"AFD row counts: {len(counts)} entries, expected one per attention rank (num_attention_ranks=4); "
        "publish TP-expanded counts"
    )


@given(_sizes.flatmap(lambda s: st.tuples(st.just(s), st.lists(st.integers(0, 99), min_size=s[0], max_size=s[0]))))
@example(((2, 1), [0, 4]))
def test_every_published_row_is_received_by_exactly_one_ffn_rank(sizes_and_counts):
    (num_attention_ranks, num_ffn_ranks), counts = sizes_and_counts

    received = [peer_rows(counts, k, num_attention_ranks, num_ffn_ranks) for k in range(num_ffn_ranks)]

    assert [n for per_peer in received for n in per_peer] == [rows(n) for n in counts]


@pytest.mark.parametrize(
    ("counts", "num_attention_ranks", "num_ffn_ranks", "tp_ffn", "expected"),
    [
        ([3, 0, 5, 2], 4, 2, 1, [4, 7]),  # 4A2F, FFN DP2: one entry per FFN DP rank (bug #218)
        ([6, 6], 2, 2, 2, [6]),  # attention 1x2, FFN 1x2: both FFN TP peers see DP0's 6 rows
        ([2, 2, 9, 9], 4, 4, 2, [2, 9]),  # 2x2 on 2x2
        ([0, 0, 0], 3, 1, 1, [3]),  # idle ranks still send a row each
    ],
)
def test_ffn_level_dp_counts(counts, num_attention_ranks, num_ffn_ranks, tp_ffn, expected):
    assert ffn_dp_counts(counts, num_attention_ranks, num_ffn_ranks, tp_ffn) == expected


def test_ffn_level_counts_refuse_an_invalid_layout():
    with pytest.raises(AFDLayoutError, match="TP peers of FFN DP rank 0 would process"):
        ffn_dp_counts([1, 5], 2, 2, 2)
    with pytest.raises(AFDLayoutError, match="not a multiple of FFN TP 2"):
        ffn_dp_counts([1, 5, 1], 3, 3, 2)
    with pytest.raises(ValueError, match="expected one per attention rank"):
        ffn_dp_counts([1, 5], 4, 2, 1)


# --- layout rule (docs/topology.md#layout-rule) --------------------------------------------------


@pytest.mark.parametrize(
    ("attention", "ffn", "valid"),
    [
        ((2, 1), (1, 1), True),
        ((4, 2), (3, 1), True),
        ((1, 2), (1, 2), True),
        ((1, 4), (1, 2), True),
        ((2, 2), (2, 2), True),
        ((2, 1), (1, 2), False),
        ((2, 2), (1, 2), False),
        ((3, 1), (1, 2), False),
    ],
)
def test_layout_rule_table(attention, ffn, valid):
    num_attention_ranks, num_ffn_ranks = attention[0] * attention[1], ffn[0] * ffn[1]

    def check():
        check_layout(*attention, *ffn, num_attention_ranks, num_ffn_ranks)

    if valid:
        check()
    else:
        with pytest.raises(AFDLayoutError) as info:
            check()
        assert isinstance(info.value, ValueError)
        assert (
            "AFD layout invalid: the TP peers of FFN DP rank 0 would receive different tokens "
            f"(attention DPxTP = {attention[0]}x{attention[1]}, FFN DPxTP = {ffn[0]}x{ffn[1]}); "
            "use the same DP and TP on both roles, or FFN TP = 1"
        ) in str(info.value)


def test_layout_with_counts_that_do_not_match_dp_times_tp_is_rejected():
    with pytest.raises(AFDLayoutError, match=r"num_attention_ranks \(4\) must equal attention DP x TP \(2 x 1\)"):
        check_layout(2, 1, 1, 1, 4, 1)
    with pytest.raises(AFDLayoutError, match=r"num_ffn_ranks \(1\) must equal ffn DP x TP \(1 x 2\)"):
        check_layout(2, 1, 1, 2, 2, 1)
    with pytest.raises(AFDLayoutError, match=r"num_attention_ranks \(1\) < num_ffn_ranks \(2\)"):
        check_layout(1, 1, 2, 1, 1, 2)


def _tokens_seen_by_ffn_tp_peers_agree(attention_dp, attention_tp, ffn_dp, ffn_tp):
    """Model: attention rank j holds DP rank j // TP's tokens; FFN k concatenates its block's."""
    num_attention_ranks, num_ffn_ranks = attention_dp * attention_tp, ffn_dp * ffn_tp
    tokens = {j: [(j // attention_tp, i) for i in range(2)] for j in range(num_attention_ranks)}
    seen = [
        [token for j in range(num_attention_ranks)
         if ffn_rank_for_attention(j, num_attention_ranks, num_ffn_ranks) == k for token in tokens[j]]
        for k in range(num_ffn_ranks)
    ]
    return all(
        seen[d * ffn_tp + t] == seen[d * ffn_tp] for d in range(ffn_dp) for t in range(ffn_tp)
    )


_layouts = st.tuples(st.integers(1, 6), st.integers(1, 4), st.integers(1, 6), st.integers(1, 4)).filter(
    lambda s: s[0] * s[1] >= s[2] * s[3]
)


@given(_layouts, st.lists(st.integers(0, 50), min_size=6, max_size=6))
@example((2, 1, 1, 2), [0] * 6)
@example((2, 2, 2, 2), [0] * 6)
@example((1, 3, 1, 2), [0] * 6)  # found by hypothesis: unequal blocks on FFN TP peers
def test_layout_rule_matches_a_token_level_model(layout, counts_dp):
    attention_dp, attention_tp, ffn_dp, ffn_tp = layout
    num_attention_ranks, num_ffn_ranks = attention_dp * attention_tp, ffn_dp * ffn_tp
    counts = expand_dp_counts(counts_dp[:attention_dp], attention_tp)

    try:
        check_layout(attention_dp, attention_tp, ffn_dp, ffn_tp, num_attention_ranks, num_ffn_ranks)
        valid = True
    except AFDLayoutError:
        valid = False

    assert valid == _tokens_seen_by_ffn_tp_peers_agree(*layout)
    # One attention DP rank: every attention rank holds the same tokens, but FFN TP peers
    # still see different row counts when the blocks differ in size (1x3 onto 1x2).
    same_sized_blocks = num_attention_ranks % num_ffn_ranks == 0
    if ffn_tp == 1 or (attention_dp == 1 and same_sized_blocks) or (
            (attention_dp, attention_tp) == (ffn_dp, ffn_tp)):
        assert valid
    if (attention_dp, ffn_dp, ffn_tp) == (1, 1, 2) and not same_sized_blocks:
        assert not valid
    if valid:
        totals = ffn_dp_counts(counts, num_attention_ranks, num_ffn_ranks, ffn_tp)
        assert len(totals) == ffn_dp
        assert sum(totals) * ffn_tp == sum(
            sum(peer_rows(counts, k, num_attention_ranks, num_ffn_ranks)) for k in range(num_ffn_ranks)
        )
