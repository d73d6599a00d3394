"""vllm_afd.wire.steps: what a control payload sets on one rank (docs/protocol.md#step-state-and-receive-buffers)."""

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from vllm_afd.wire.errors import AFDProtocolError
from vllm_afd.wire.messages import ControlPayload
from vllm_afd.wire.placement import Placement
from vllm_afd.wire.steps import Stage, StepState
from vllm_afd.wire.topology import ffn_dp_counts, peer_rows, rows

NAME = "P2pGlooAFDConnector"


def state(role, role_rank, num_attention, num_ffn, *, tp_size=1, exchanges_per_stage=4):
    role_size = num_attention if role == "attention" else num_ffn
    placement = Placement(role, role_rank, num_attention, num_ffn, role_size // tp_size, tp_size)
    return StepState(placement, exchanges_per_stage, NAME)


# --- new_payload (attention) -----------------------------------------------------------------------


def test_new_payload_repeats_each_dp_count_for_the_dp_ranks_tp_peers():
    attention = state("attention", 3, 4, 2, tp_size=2)

    payload = attention.new_payload({0: [3, 0], 1: [5, 7]}, is_warmup=True)

    assert payload.counts == {0: (3, 3, 0, 0), 1: (5, 5, 7, 7)}
    assert payload.is_warmup and not payload.is_graph_replaying
    assert attention.stages == {} and attention.payload is None  # publishing is not adopting


def test_step_seq_counts_the_payloads_from_zero():
    attention = state("attention", 0, 1, 1)

    seqs = [attention.new_payload({0: [n]}).step_seq for n in range(3)]
    attention.adopt(ControlPayload({0: (1,)}, step_seq=99))
    seqs.append(attention.new_payload({0: [1]}).step_seq)

    assert seqs == [0, 1, 2, 3]  # adopting a payload never renumbers the next one


def test_a_count_list_of_the_wrong_length_is_refused_without_using_a_step_seq():
    attention = state("attention", 0, 4, 2, tp_size=2)

    with pytest.raises(ValueError) as info:
        attention.new_payload({0: [1, 2, 3, 4]})

    assert str(info.value) == (
        f"{NAME}: stage 0 counts [1, 2, 3, 4] have 4 entries; expected one per attention DP rank (2). "
        "Publish num_tokens_across_dp"
    )
    assert attention.new_payload({0: [1, 2]}).step_seq == 0


# --- adopt -----------------------------------------------------------------------------------------


def test_attention_adopts_its_own_rows_clamped_to_one():
    idle, busy = state("attention", 0, 2, 1), state("attention", 1, 2, 1)
    payload = ControlPayload({0: (0, 4)})

    idle.adopt(payload)
    busy.adopt(payload)

    assert idle.stage(0) == Stage((0, 4), 1, ())
    assert busy.stage(0) == Stage((0, 4), 4, ())
    assert idle.payload is payload


def test_ffn_adopts_the_rows_of_its_block_in_subgroup_order():
    ffn_0, ffn_1 = state("ffn", 0, 3, 2), state("ffn", 1, 3, 2)
    payload = ControlPayload({0: (0, 4, 9), 1: (2, 2, 0)})

    ffn_0.adopt(payload)
    ffn_1.adopt(payload)

    # Two FFN ranks at FFN TP 1 are two FFN DP ranks: each also adopts both ranks' rows (dp_counts).
    assert (ffn_0.stage(0), ffn_0.stage(1)) == (Stage((0, 4, 9), 5, (1, 4), (5, 9)),
                                                Stage((2, 2, 0), 4, (2, 2), (4, 1)))
    assert (ffn_1.stage(0), ffn_1.stage(1)) == (Stage((0, 4, 9), 9, (9,), (5, 9)), Stage((2, 2, 0), 1, (1,), (4, 1)))


_deployments = st.integers(1, 12).flatmap(lambda a: st.tuples(st.just(a), st.integers(1, a))).flatmap(
    lambda s: st.tuples(st.just(s), st.lists(st.integers(0, 64), min_size=s[0], max_size=s[0]))
)


@given(_deployments)
@example(((2, 1), [0, 4]))
@example(((5, 2), [0, 0, 0, 0, 0]))
def test_the_rows_sent_by_attention_ranks_are_the_rows_received_by_ffn_ranks(deployment):
    (num_attention, num_ffn), counts = deployment
    payload = ControlPayload({0: tuple(counts)})
    attention = [state("attention", j, num_attention, num_ffn) for j in range(num_attention)]
    ffn = [state("ffn", k, num_attention, num_ffn) for k in range(num_ffn)]

    for rank in attention + ffn:
        rank.adopt(payload)

    sent = [rank.stage(0).own_rows for rank in attention]
    assert sent == [rows(n) for n in counts]
    assert [n for rank in ffn for n in rank.stage(0).peer_rows] == sent
    for k, rank in enumerate(ffn):
        assert list(rank.stage(0).peer_rows) == peer_rows(counts, k, num_attention, num_ffn)
        assert rank.stage(0).own_rows == sum(rank.stage(0).peer_rows)


@given(st.lists(st.integers(0, 99), min_size=1, max_size=4), st.integers(1, 3), st.integers(1, 3))
@example([0, 5], 2, 1)
def test_a_payload_published_by_an_attention_rank_sizes_the_ffn_after_the_wire(counts_dp, tp_size, num_ffn_dp):
    num_attention = len(counts_dp) * tp_size
    num_ffn = min(num_ffn_dp, num_attention)
    attention = state("attention", 0, num_attention, num_ffn, tp_size=tp_size)
    ffn = state("ffn", 0, num_attention, num_ffn)

    ffn.adopt(ControlPayload.decode(attention.new_payload({0: counts_dp}).encode()))

    expanded = [n for n in counts_dp for _ in range(tp_size)]
    assert ffn.stage(0).counts == tuple(expanded)
    assert list(ffn.stage(0).peer_rows) == peer_rows(expanded, 0, num_attention, num_ffn)


@pytest.mark.parametrize("role", ["attention", "ffn"])
def test_a_payload_of_the_wrong_length_is_refused_and_changes_nothing(role):
    rank = state(role, 0, 4, 2)
    good = ControlPayload({0: (1, 2, 3, 4)}, step_seq=5)
    rank.adopt(good)
    rank.count_exchange()
    before = (rank.payload, dict(rank.stages), rank.num_exchanges)

    with pytest.raises(AFDProtocolError) as info:
        rank.adopt(ControlPayload({0: (7, 7, 7, 7), 1: (1, 2)}))  # stage 0 fine, stage 1 a DP-level vector

    assert str(info.value) == (
        f"{NAME}: control payload stage 1 has 2 counts [1, 2]; expected one per attention rank (4). "
        "Run the same vllm_afd version and num_attention_ranks on both roles"
    )
    assert (rank.payload, rank.stages, rank.num_exchanges) == before


def test_a_stage_without_published_rows_is_a_runtime_error():
    attention = state("attention", 0, 1, 1)
    attention.adopt(ControlPayload({0: (3,)}))

    with pytest.raises(RuntimeError) as info:
        attention.stage(1)

    assert str(info.value) == (
        f"{NAME}: no published rows for stage 1 (stages [0]); expected a control payload for this step "
        "before its first exchange"
    )


def test_before_any_payload_no_stage_has_rows():
    ffn = state("ffn", 0, 1, 1)

    with pytest.raises(RuntimeError, match=r"no published rows for stage 0 \(stages \[\]\)"):
        ffn.stage(0)


# --- adopt at FFN DP > 1 (docs/topology.md#row-counts) ---------------------------------------------


def ffn_pool(num_attention, num_ffn, *, tp_size=1):
    return [state("ffn", k, num_attention, num_ffn, tp_size=tp_size) for k in range(num_ffn)]


@pytest.mark.parametrize("num_attention, counts, dp_counts", [
    (2, (3, 5), (3, 5)),  # 2A2F: FFN k serves attention k
    (2, (0, 4), (1, 4)),  # an idle attention DP rank sends its 1-row dummy batch
    (4, (1, 2, 3, 4), (3, 7)),  # 4A2F: FFN 0 serves attention 0, 1; FFN 1 serves 2, 3
    (4, (0, 0, 0, 6), (2, 7)),
    (3, (2, 3, 4), (5, 4)),  # 3A2F: blocks of 2 and 1, no divisibility rule at FFN TP 1
    (3, (0, 0, 0), (2, 1)),  # every attention rank idle: still >= 1 row per FFN DP rank
])
def test_every_ffn_dp_rank_adopts_the_rows_of_every_ffn_dp_rank(num_attention, counts, dp_counts):
    pool = ffn_pool(num_attention, 2)

    for rank in pool:
        rank.adopt(ControlPayload({0: counts, 1: (1,) * num_attention}))

    assert [rank.stage(0).dp_counts for rank in pool] == [dp_counts, dp_counts]
    assert [rank.stage(0).own_rows for rank in pool] == list(dp_counts)
    ones = tuple(ffn_dp_counts((1,) * num_attention, num_attention, 2, 1))
    assert [rank.stage(1).dp_counts for rank in pool] == [ones, ones]


def test_the_tp_peers_of_an_ffn_dp_rank_adopt_its_rows_once():
    """Attention 2x2 and FFN 2x2 (the layout rule's symmetric case): one entry per FFN DP rank, not per FFN rank."""
    pool = ffn_pool(4, 4, tp_size=2)

    for rank in pool:
        rank.adopt(ControlPayload({0: (3, 3, 5, 5)}))

    assert [rank.stage(0).dp_counts for rank in pool] == [(3, 5)] * 4


@pytest.mark.parametrize("role, num_ffn", [("ffn", 1), ("attention", 2)])
def test_ffn_dp_1_and_attention_ranks_adopt_no_dp_counts(role, num_ffn):
    rank = state(role, 0, 2, num_ffn)

    rank.adopt(ControlPayload({0: (3, 5)}))

    assert rank.stage(0).dp_counts == ()


@given(_deployments)
@example(((3, 2), [0, 7, 0]))
def test_the_ffn_dp_counts_are_the_rows_each_ffn_rank_receives(deployment):
    (num_attention, num_ffn), counts = deployment
    pool = ffn_pool(num_attention, num_ffn)

    for rank in pool:
        rank.adopt(ControlPayload({0: tuple(counts)}))

    received = tuple(rank.stage(0).own_rows for rank in pool)
    assert sum(received) == sum(rows(n) for n in counts)
    assert {rank.stage(0).dp_counts for rank in pool} == {received if num_ffn > 1 else ()}  # () at FFN DP 1


def test_dp_counts_that_disagree_with_the_received_rows_are_a_protocol_error(monkeypatch):
    import vllm_afd.wire.steps as steps

    rank = state("ffn", 1, 2, 2)
    monkeypatch.setattr(steps, "ffn_dp_counts", lambda *args: [3, 9])  # an overlay function: a broken topology

    with pytest.raises(AFDProtocolError) as info:
        rank.adopt(ControlPayload({0: (3, 5)}))

    assert str(info.value) == (
        f"{NAME}: stage 0 gives ffn rank 1 (FFN DP rank 1) 9 rows among the FFN DP counts [3, 9], but its "
        "attention peers send 5; expected equal. Run the same vllm_afd version on every rank"
    )
    assert rank.payload is None and rank.stages == {}


# --- count_exchange ----------------------------------------------------------------------------------


@given(st.integers(1, 6), st.integers(1, 4), st.sampled_from(["attention", "ffn"]))
@example(4, 1, "attention")
def test_the_step_ends_with_its_last_exchange(exchanges_per_stage, num_stages, role):
    rank = state(role, 0, 2, 1, exchanges_per_stage=exchanges_per_stage)
    rank.adopt(ControlPayload({stage: (1, 1) for stage in range(num_stages)}))

    ends = [rank.count_exchange() for _ in range(exchanges_per_stage * num_stages + 2)]

    assert ends.index(True) == exchanges_per_stage * num_stages - 1
    assert ends.count(True) == 1


def test_adopting_the_next_payload_restarts_the_exchange_count():
    rank = state("ffn", 0, 1, 1, exchanges_per_stage=2)
    rank.adopt(ControlPayload({0: (1,)}))
    rank.count_exchange()

    rank.adopt(ControlPayload({0: (2,)}))

    assert rank.num_exchanges == 0
    assert [rank.count_exchange(), rank.count_exchange()] == [False, True]
