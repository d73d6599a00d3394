"""vllm_afd.attention.stages: the micro-batch stages of one step (docs/pingpong.md, section 3), with the
request and token ranges of tests/attention/_stage_oracles.py checked against vLLM's split."""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tests.attention._stage_oracles import StageRange, plan_stages, split_tokens
from vllm_afd.attention.stages import stage_sizes, stages_for_step
from vllm_afd.attention.step import stage_counts
from vllm_afd.config import NUM_STAGES
from vllm_afd.wire.placement import Placement
from vllm_afd.wire.steps import StepState
from vllm_afd.wire.topology import attention_block


@st.composite
def steps(draw, max_tokens_per_request=40):
    """(tokens per request, padded token count, stages) of a step that can be split."""
    counts = draw(st.lists(st.integers(1, max_tokens_per_request), min_size=1, max_size=12))
    num_stages = draw(st.sampled_from(NUM_STAGES))
    padded = draw(st.integers(max(sum(counts), num_stages), sum(counts) + 16))
    return counts, padded, num_stages


def owners(counts):
    """Token index -> its request, the simple model of a batch."""
    return [request for request, n in enumerate(counts) for _ in range(n)]


@given(steps())
@example(([1] * 5, 5, 2))  # decode of 5 requests: 2 + 3
@example(([1] * 3, 8, 3))  # FULL graph, 3 requests padded to 8: 2 + 2 + 4, the last all padding
@example(([1, 1, 1, 1000], 1003, 2))  # 3 decodes then a prefill that straddles: 501 + 502
def test_token_ranges_cover_the_padded_step_exactly_in_order(step):
    counts, padded, num_stages = step

    ranges = split_tokens(counts, padded, num_stages)

    assert len(ranges) == num_stages
    assert ranges[0].token_start == 0 and ranges[-1].token_stop == padded
    assert all(a.token_stop == b.token_start for a, b in zip(ranges, ranges[1:]))
    assert all(r.num_tokens >= 1 for r in ranges)
    assert [r.num_tokens for r in ranges[:-1]] == [padded // num_stages] * (num_stages - 1)
    assert sum(r.num_tokens for r in ranges) == padded


@given(steps())
def test_a_stage_holds_exactly_the_requests_its_tokens_belong_to(step):
    counts, padded, num_stages = step
    owner = owners(counts)

    ranges = split_tokens(counts, padded, num_stages)

    for r in ranges:
        real = owner[r.token_start:min(r.token_stop, len(owner))]
        assert list(range(r.req_start, r.req_stop)) == sorted(set(real))


@given(steps())
def test_a_request_spans_two_stages_only_when_a_boundary_cuts_it(step):
    counts, padded, num_stages = step
    starts = np.cumsum([0, *counts])

    ranges = split_tokens(counts, padded, num_stages)

    boundaries = [r.token_start for r in ranges[1:]]
    for request in range(len(counts)):
        stages = [j for j, r in enumerate(ranges) if r.req_start <= request < r.req_stop]
        cuts = sum(starts[request] < b < starts[request + 1] for b in boundaries)
        assert len(stages) == 1 + cuts


@given(st.integers(1, 64), st.sampled_from(NUM_STAGES), st.integers(0, 16))
def test_decode_requests_are_never_split(num_reqs, num_stages, padding):
    padded = max(num_reqs + padding, num_stages)

    ranges = split_tokens([1] * num_reqs, padded, num_stages)

    members = [request for r in ranges for request in range(r.req_start, r.req_stop)]
    assert sorted(members) == list(range(num_reqs))


@given(st.sampled_from(NUM_STAGES), st.integers(1, 8), st.booleans())
def test_batch_one_is_always_one_stage(num_stages, min_tokens, allowed):
    assert stages_for_step(num_stages, 1, min_tokens_per_stage=min_tokens, allowed=allowed) == 1
    assert plan_stages(num_stages, [1], 1) == (StageRange(0, 1, 0, 1),)
    assert plan_stages(num_stages, [1], 8) == (StageRange(0, 1, 0, 8),)  # padding never splits a step


@given(st.sampled_from(NUM_STAGES), st.integers(0, 200), st.integers(1, 16), st.booleans())
def test_a_step_splits_into_all_stages_or_none(num_stages, num_tokens, min_tokens, allowed):
    count = stages_for_step(num_stages, num_tokens, min_tokens_per_stage=min_tokens, allowed=allowed)

    splits = allowed and num_tokens >= num_stages * min_tokens
    assert count == (num_stages if splits else 1)


def test_a_vetoed_step_runs_one_stage():
    """vLLM's _allow_microbatching veto (a prefix-cache reader and its writer in one batch)."""
    assert plan_stages(2, [4, 4], 8, allowed=False) == (StageRange(0, 2, 0, 8),)


@given(steps())
def test_plan_stages_decides_on_real_tokens_and_splits_the_padded_step(step):
    counts, padded, num_stages = step

    ranges = plan_stages(num_stages, counts, padded)

    expected = num_stages if sum(counts) >= num_stages else 1
    assert len(ranges) == expected and ranges == split_tokens(counts, padded, expected)


@given(steps(), st.integers(1, 4))
def test_stage_counts_publish_each_stage_for_every_dp_rank(step, num_dp_ranks):
    counts, padded, num_stages = step

    published = stage_counts([r.num_tokens for r in split_tokens(counts, padded, num_stages)], num_dp_ranks)

    assert list(published) == list(range(num_stages))
    assert all(len(set(per_dp)) == 1 and len(per_dp) == num_dp_ranks for per_dp in published.values())
    assert sum(per_dp[0] for per_dp in published.values()) == padded


@given(steps(), st.integers(2, 5).flatmap(lambda a: st.tuples(st.just(a), st.integers(2, a))))
@example(([3, 3], 6, 2), (3, 2))  # 3A2F: FFN 0 serves attention 0-1, FFN 1 serves attention 2; stages 3 + 3
def test_a_split_step_gives_every_ffn_dp_rank_the_same_counts_per_stage(step, layout):
    """Attention DP A (TP 1) split a step; each attention rank publishes it and each FFN rank of an FFN DP pool
    (TP 1) adopts its control sender's payload: per stage, all FFN DP ranks size vLLM's MoE collectives by the
    same counts, each entry the rows its block sends in that stage (docs/topology.md#row-counts)."""
    counts, padded, num_stages = step
    num_attention, num_ffn = layout
    stage_rows = [r.num_tokens for r in split_tokens(counts, padded, num_stages)]

    payloads = [StepState(Placement("attention", j, num_attention, num_ffn, num_attention, 1), 1, "test")
                .new_payload(stage_counts(stage_rows, num_attention)) for j in range(num_attention)]
    pool = [StepState(Placement("ffn", k, num_attention, num_ffn, num_ffn, 1), 1, "test") for k in range(num_ffn)]
    for k, ffn in enumerate(pool):
        ffn.adopt(payloads[k])  # attention k sends FFN k its control payload

    assert all(p.counts == payloads[0].counts for p in payloads)
    blocks = [len(attention_block(k, num_attention, num_ffn)) for k in range(num_ffn)]
    for stage, per_rank in enumerate(stage_rows):
        assert [ffn.stage(stage).dp_counts for ffn in pool] == [tuple(per_rank * n for n in blocks)] * num_ffn
        assert [ffn.stage(stage).own_rows for ffn in pool] == [per_rank * n for n in blocks]
    assert [sum(ffn.stage(s).own_rows for s in range(num_stages)) for ffn in pool] == [padded * n for n in blocks]


@pytest.fixture(scope="module")
def ubatch_utils():
    return pytest.importorskip("vllm.v1.worker.ubatch_utils")


@given(step=steps())
def test_the_split_is_vllms(ubatch_utils, step):
    """Published rows must equal the rows vLLM's slicing makes each stage send (NCCL hangs otherwise)."""
    counts, padded, num_stages = step

    _, vllm_slices = ubatch_utils.maybe_create_ubatch_slices(
        True, np.array(counts, dtype=np.int32), padded, len(counts), num_stages)
    ours = split_tokens(counts, padded, num_stages)

    assert [(s.token_slice.start, s.token_slice.stop) for s in vllm_slices] == [
        (r.token_start, r.token_stop) for r in ours]
    for theirs, r in zip(vllm_slices, ours):  # vLLM's request ranges run into padded requests
        assert (min(theirs.request_slice.start, len(counts)), min(theirs.request_slice.stop, len(counts))) == (
            r.req_start, r.req_stop)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: stage_sizes(2, 3), r"2 tokens cannot fill 3 stages; ask stages_for_step first"),
    (lambda: stage_sizes(1, True), r"num_stages must be an integer >= 1, got True"),
    (lambda: stage_sizes(0, 1), r"num_tokens_padded must be an integer >= 1, got 0"),
    (lambda: stages_for_step(4, 8), r"num_stages must be one of \(1, 2, 3\), got 4; pass AFDConfig.num_stages"),
    (lambda: stages_for_step(True, 8), r"num_stages must be one of \(1, 2, 3\), got True"),
    (lambda: stages_for_step(2, -1), r"num_tokens must be an integer >= 0, got -1"),
    (lambda: stages_for_step(2, 8, min_tokens_per_stage=0), r"min_tokens_per_stage must be an integer >= 1"),
    (lambda: stage_counts((), 1), r"no stages; a step runs at least one"),
    (lambda: stage_counts((1,), 0), r"num_dp_ranks must be an integer >= 1, got 0"),
])
def test_bad_input_is_refused_naming_the_value(call, message):
    with pytest.raises(ValueError, match=message):
        call()
