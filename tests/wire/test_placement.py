"""vllm_afd.wire.placement: one rank's role, rank, groups and peers (docs/topology.md#placement)."""

import dataclasses
import json

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from vllm_afd.role import Role
from vllm_afd.wire.placement import A2F, CONTROL, F2A, Placement
from vllm_afd.wire.topology import attention_block, compute_role_rank, ffn_rank_for_attention


def place(role, role_rank, num_attention, num_ffn, tp_size=1):
    """A placement whose role runs DP x ``tp_size`` (DP = the role's ranks / TP)."""
    role_size = num_attention if role == "attention" else num_ffn
    return Placement(role, role_rank, num_attention, num_ffn, role_size // tp_size, tp_size)


def deployment(num_attention, num_ffn):
    """Every placement of an A x F deployment, FFN first."""
    return [place("ffn", k, num_attention, num_ffn) for k in range(num_ffn)] + [
        place("attention", j, num_attention, num_ffn) for j in range(num_attention)
    ]


_sizes = st.integers(1, 24).flatmap(lambda a: st.tuples(st.just(a), st.integers(1, a)))
_placements = _sizes.flatmap(lambda s: st.sampled_from(deployment(*s)))


# --- pairing table (docs/topology.md#worked-examples) ----------------------------------------------


@pytest.mark.parametrize(
    ("num_attention", "num_ffn", "role", "rank", "expected"),
    [
        # (afd_rank, subgroup, members, control_rank, control_size)
        (1, 1, "attention", 0, (1, 0, (0, 1), 1, 2)),
        (2, 1, "attention", 1, (2, 0, (0, 1, 2), None, 2)),
        (2, 2, "attention", 1, (3, 1, (1, 3), 3, 4)),
        (3, 2, "attention", 1, (3, 0, (0, 2, 3), 3, 4)),  # data to FFN 0, control to FFN 1
        (3, 2, "attention", 2, (4, 1, (1, 4), None, 4)),
        (4, 2, "attention", 2, (4, 1, (1, 4, 5), None, 4)),
        (4, 2, "ffn", 1, (1, 1, (1, 4, 5), 1, 4)),
        (4, 4, "attention", 3, (7, 3, (3, 7), 7, 8)),
    ],
)
def test_placement_follows_the_pairing_rules(num_attention, num_ffn, role, rank, expected):
    placement = place(role, rank, num_attention, num_ffn)

    actual = (placement.afd_rank, placement.subgroup, placement.subgroup_members, placement.control_rank,
              placement.control_size)

    assert actual == expected
    assert placement.subgroup_members[placement.subgroup_rank] == placement.afd_rank


def test_channels_are_data_then_control_with_store_prefixes():
    attention_1, attention_2 = place("attention", 1, 3, 2), place("attention", 2, 3, 2)

    channels_1, channels_2 = attention_1.channels(), attention_2.channels()

    assert channels_1 == [(A2F, "afd/a2f/0", 2, 3), (F2A, "afd/f2a/0", 2, 3), (CONTROL, "afd/ctrl", 3, 4)]
    assert channels_2 == [(A2F, "afd/a2f/1", 1, 2), (F2A, "afd/f2a/1", 1, 2)]
    assert (A2F, F2A, CONTROL) == ("a2f", "f2a", "ctrl")


def test_label_names_role_and_rank():
    assert place("ffn", 1, 4, 2).label == "ffn rank 1"
    assert place("attention", 3, 4, 2, tp_size=2).label == "attention rank 3"


def test_an_ffn_rank_serves_its_block_in_subgroup_order():
    ffn = place("ffn", 1, 5, 2)

    peers = ffn.attention_peers

    assert list(peers) == [3, 4]
    assert [ffn.num_ffn_ranks + j for j in peers] == list(ffn.subgroup_members[1:])


# --- properties over whole deployments -----------------------------------------------------------


@given(_placements)
@example(place("attention", 2, 3, 2))
def test_every_rank_is_a_member_of_its_own_subgroup_and_peers_exclude_it(placement):
    members = placement.subgroup_members

    assert placement.afd_rank in members and members[placement.subgroup_rank] == placement.afd_rank
    assert members[0] == placement.subgroup and members == tuple(sorted(members))
    assert (placement.role, placement.role_rank) not in placement.peers
    assert list(placement.peers) == sorted(set(placement.peers))


@given(_placements)
def test_channels_are_created_in_one_order_with_control_last(placement):
    channels = placement.channels()

    control = [CONTROL] if placement.control_rank is not None else []
    assert [name for name, _, _, _ in channels] == [A2F, F2A] + control
    for name, prefix, group_rank, group_size in channels:
        assert 0 <= group_rank < group_size
        if name == CONTROL:
            assert (prefix, group_rank, group_size) == ("afd/ctrl", placement.afd_rank, 2 * placement.num_ffn_ranks)
        else:
            assert (prefix, group_rank, group_size) == (
                f"afd/{name}/{placement.subgroup}", placement.subgroup_rank, len(placement.subgroup_members))


@given(_sizes)
@example((5, 2))
def test_members_of_one_group_agree_on_it_and_hold_distinct_ranks(sizes):
    num_ffn, groups = sizes[1], {}

    for placement in deployment(*sizes):
        for name, prefix, group_rank, group_size in placement.channels():
            groups.setdefault((name, prefix), []).append((group_rank, group_size))

    assert len(groups) == 2 * num_ffn + 1
    for members in groups.values():
        sizes_seen = {size for _, size in members}
        assert len(sizes_seen) == 1
        assert sorted(rank for rank, _ in members) == list(range(sizes_seen.pop()))
    assert len(groups[(CONTROL, "afd/ctrl")]) == 2 * num_ffn


@given(_sizes)
@example((2, 1))
@example((4, 2))
def test_peers_are_symmetric(sizes):
    placements = {(p.role, p.role_rank): p for p in deployment(*sizes)}

    pairs = {(me, peer) for me, p in placements.items() for peer in p.peers}

    for me, peer in pairs:
        assert peer in placements
        assert (peer, me) in pairs, f"{me} lists {peer} as a peer but not the reverse"


@given(_placements)
def test_peers_include_every_data_and_control_peer(placement):
    num_attention, num_ffn = placement.num_attention_ranks, placement.num_ffn_ranks

    peers = set(placement.peers)

    if placement.role == "attention":
        assert ("ffn", ffn_rank_for_attention(placement.role_rank, num_attention, num_ffn)) in peers
    else:
        assert {("attention", j) for j in attention_block(placement.role_rank, num_attention, num_ffn)} <= peers
    # docs/topology.md#control-pairing: attention k <-> FFN k for k < F.
    control = placement.role_rank if placement.role_rank < num_ffn else None
    other_role = "ffn" if placement.role == "attention" else "attention"
    assert (control is None) == (placement.control_rank is None)
    if control is not None:
        assert (other_role, control) in peers


@pytest.mark.parametrize(("num_attention", "num_ffn", "role", "rank", "expected"), [
    (1, 1, "attention", 0, (("ffn", 0),)),
    (1, 1, "ffn", 0, (("attention", 0),)),
    (3, 2, "attention", 2, (("ffn", 1),)),
    (4, 2, "ffn", 1, (("attention", 1), ("attention", 2), ("attention", 3))),
    (2, 1, "attention", 1, (("ffn", 0),)),  # regression: sibling attention ranks were watched too
    (4, 2, "attention", 1, (("ffn", 0), ("ffn", 1))),
])
def test_peers_are_the_ranks_of_the_documented_watch_list(num_attention, num_ffn, role, rank, expected):
    placement = place(role, rank, num_attention, num_ffn)

    peers = placement.peers

    assert peers == expected


# --- refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "text"), [
    (("moe", 0, 1, 1), "AFD placement: role must be 'attention' or 'ffn', got 'moe'"),
    (("ffn", 0, 1, 2, 2, 1), "AFD placement: expected num_attention_ranks >= num_ffn_ranks >= 1, got A=1, F=2. "
                             "Fix additional_config['afd']"),
    (("ffn", 0, 1, 0, 0, 1), "AFD placement: expected num_attention_ranks >= num_ffn_ranks >= 1, got A=1, F=0. "
                             "Fix additional_config['afd']"),
    (("attention", 0, 4, 1, 2, 1), "AFD placement: attention DP x TP = 2 x 1 differs from num_attention_ranks=4; "
                                   "set num_attention_ranks to the role's DP x TP"),
    (("ffn", 0, 4, 2), "AFD placement: ffn DP x TP = 1 x 1 differs from num_ffn_ranks=2; "
                       "set num_ffn_ranks to the role's DP x TP"),
    (("ffn", 2, 4, 2, 2, 1), "AFD placement: ffn rank 2 is outside 0..1"),
    (("attention", -1, 2, 1, 2, 1), "AFD placement: attention rank -1 is outside 0..1"),
])
def test_bad_placements_are_refused_with_the_values_named(args, text):
    with pytest.raises(ValueError) as info:
        Placement(*args)

    assert str(info.value) == text


def test_placement_is_frozen():
    placement = place("ffn", 0, 1, 1)

    with pytest.raises(dataclasses.FrozenInstanceError):
        placement.role_rank = 1


# --- for_rank -------------------------------------------------------------------------------------

@st.composite
def rank_layouts(draw):
    """(role, A, F, dp_rank, tp_rank, dp_size, tp_size) of one worker of a valid deployment."""
    role = draw(st.sampled_from(["attention", "ffn"]))
    dp_size, tp_size = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    role_size, other = dp_size * tp_size, draw(st.integers(1, 12))
    num_attention, num_ffn = (role_size, min(other, role_size)) if role == "attention" else (
        max(other, role_size), role_size)
    return (role, num_attention, num_ffn, draw(st.integers(0, dp_size - 1)), draw(st.integers(0, tp_size - 1)),
            dp_size, tp_size)


@given(rank_layouts())
@example(("attention", 4, 2, 1, 1, 2, 2))
@example(("ffn", 4, 2, 1, 0, 2, 1))
def test_for_rank_agrees_with_compute_role_rank(layout):
    role, num_attention, num_ffn, dp_rank, tp_rank, dp_size, tp_size = layout

    placement = Placement.for_rank(role, num_attention, num_ffn, dp_rank=dp_rank, tp_rank=tp_rank,
                                   dp_size=dp_size, tp_size=tp_size)

    assert placement.role_rank == compute_role_rank(role, dp_rank, tp_rank, tp_size, dp_size * tp_size)
    assert (placement.role, placement.dp_size, placement.tp_size) == (role, dp_size, tp_size)
    assert (placement.num_attention_ranks, placement.num_ffn_ranks) == (num_attention, num_ffn)


def test_for_rank_refuses_a_dp_rank_counted_twice():
    """Regression (reference bug #192): the global DP rank plus the DP start rank again."""
    with pytest.raises(ValueError, match="AFD role rank derived from distributed ranks is out of range: role=ffn, "
                                         "dp_rank=2, tp_rank=0, role_size=2"):
        Placement.for_rank("ffn", 4, 2, dp_rank=2, tp_rank=0, dp_size=2, tp_size=1)


@pytest.mark.parametrize("given_role", ["attention", "ffn"])
def test_the_role_string_is_parsed_to_a_role_that_still_reads_as_the_string(given_role):
    placement = Placement(given_role, 0, 1, 1)

    assert placement.role is Role(given_role)
    assert placement.role == given_role and str(placement.role) == given_role and f"{placement.role}" == given_role
    assert placement == Placement(Role(given_role), 0, 1, 1)
    assert json.dumps({"role": placement.role}) == json.dumps({"role": given_role})
