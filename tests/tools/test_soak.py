"""The soak driver's pure parts (tests/harness/afd_harness/soak.py): outcomes, memory verdict, parsing."""

from __future__ import annotations

import os
import random

from afd_harness.soak import (
    KINDS, OK_OUTCOMES, Attempt, Chunk, classify, choose_kind, group_rss_mb, memory_growth, parse_stream_line,
)
from hypothesis import example, given
from hypothesis import strategies as st

EXPECTED = [[1, 2, 3], [4, 5]]
DOWN = [(10.0, 20.0)]


def attempt(**fields) -> Attempt:
    return Attempt(**{"kind": "plain", "prompt_index": 0, "started": 1.0, "ended": 2.0, **fields})


def test_the_baseline_tokens_complete_and_other_tokens_fail():
    assert classify(attempt(status=200, token_ids=(1, 2, 3)), EXPECTED, DOWN) == "completed"
    assert classify(attempt(status=200, token_ids=(1, 2, 4)), EXPECTED, DOWN) == "wrong_tokens"
    assert classify(attempt(status=200, token_ids=(4, 5)), EXPECTED, DOWN) == "wrong_tokens"
    assert classify(attempt(status=200), EXPECTED, DOWN) == "wrong_tokens"


def test_a_stream_completes_only_with_done_and_the_baseline_tokens():
    ended = attempt(kind="stream", status=200, token_ids=(4, 5), prompt_index=1, done=True)

    assert classify(ended, EXPECTED, DOWN) == "completed"
    assert classify(ended._replace(done=False), EXPECTED, DOWN) == "stream_incomplete"
    assert classify(ended._replace(error="stream_error", message="x"), EXPECTED, DOWN) == "stream_error"


def test_only_the_afd_503_is_a_clear_http_error():
    unavailable = attempt(status=503, message="AFD attention server unavailable: its engine stopped")

    assert classify(unavailable, EXPECTED, DOWN) == "unavailable_503"
    assert classify(unavailable._replace(message="Service Unavailable"), EXPECTED, DOWN) == "http_503"
    generic = attempt(status=500, message="EngineCore encountered an issue. See stack trace (above)")
    assert classify(generic, EXPECTED, DOWN) == "http_500"


def test_a_client_abort_is_an_outcome_of_its_own():
    assert classify(attempt(kind="abort", status=200, aborted=True, token_ids=(1,)), EXPECTED, DOWN) == "aborted"


def test_a_timeout_fails_even_while_the_attention_is_down():
    assert classify(attempt(error="timeout", started=11.0, ended=19.0), EXPECTED, DOWN) == "timeout"


@given(start=st.floats(0, 40), length=st.floats(0, 5))
@example(start=9.0, length=1.0)  # started before the kill, reset by it
@example(start=20.0, length=0.0)  # refused at the instant the restarted server became healthy
def test_a_refused_connection_is_clear_exactly_when_it_touches_a_down_window(start, length):
    refused = attempt(error="connection", started=start, ended=start + length)

    outcome = classify(refused, EXPECTED, DOWN)

    touches = 10.0 <= start <= 20.0 or 10.0 <= start + length <= 20.0
    assert outcome == ("refused_while_down" if touches else "connection_while_up")


attempts = st.builds(
    Attempt, kind=st.sampled_from(KINDS), prompt_index=st.sampled_from([0, 1]),
    started=st.floats(0, 40), ended=st.floats(0, 40),
    status=st.none() | st.sampled_from([200, 400, 500, 503]), message=st.text(max_size=40),
    token_ids=st.none() | st.lists(st.integers(0, 6), max_size=4).map(tuple),
    error=st.sampled_from(["", "connection", "timeout", "stream_error"]),
    done=st.booleans(), aborted=st.booleans(), finish_reason=st.sampled_from(["", "stop", "length", "abort"]),
)


@given(attempts)
def test_every_attempt_gets_exactly_one_named_outcome(a):
    outcome = classify(a, EXPECTED, DOWN)

    failures = {"wrong_tokens", "stream_incomplete", "connection_while_up", "timeout", "aborted_while_up"}
    assert outcome in OK_OUTCOMES or outcome in failures or outcome.startswith("http_")
    if outcome == "completed":
        assert list(a.token_ids) == EXPECTED[a.prompt_index] and not a.error


@given(st.lists(st.floats(100, 5000), min_size=2, max_size=40), st.floats(-1000, 1000))
def test_growth_ignores_a_constant_offset_and_flat_memory_has_none(mbs, offset):
    points = [(10 * i, mb) for i, mb in enumerate(mbs)]
    shifted = [(n, mb + offset) for n, mb in points]

    assert abs(memory_growth(points).growth_mb - memory_growth(shifted).growth_mb) < 1e-6
    assert memory_growth([(n, mbs[0]) for n, _ in points]).growth_mb == 0.0


@given(st.integers(2, 60), st.floats(0.0, 5.0))
def test_a_steady_leak_is_measured_per_100_requests(num_samples, mb_per_request):
    points = [(50 * i, 800.0 + 50 * i * mb_per_request) for i in range(num_samples)]

    growth = memory_growth(points)

    assert growth.growth_mb >= 0.0 and growth.requests == 50 * (num_samples - 1)
    if num_samples >= 8:
        assert growth.growth_mb >= 0.5 * 50 * (num_samples - 1) * mb_per_request - 1e-6


def test_growth_skips_samples_taken_while_a_role_was_down():
    assert memory_growth([(0, None), (5, 700.0)]) is None
    assert memory_growth([(0, 700.0), (5, None), (9, 710.0)]).growth_mb == 10.0


@given(st.integers(0, 10_000))
def test_the_request_mix_only_draws_the_known_kinds(seed):
    kinds = {choose_kind(random.Random(seed), (0.45, 0.45, 0.10)) for _ in range(20)}

    assert kinds <= set(KINDS)
    assert {choose_kind(random.Random(seed), (0, 0, 1)) for _ in range(5)} == {"abort"}


@given(st.floats(0, 40), st.floats(0, 5), st.sampled_from(["plain", "stream"]))
@example(9.0, 1.0, "plain")  # the FFN died at 10.0, while it was in the engine
def test_an_engine_abort_is_clear_exactly_for_a_request_in_flight_at_the_ffns_death(start, length, kind):
    ended_by_fault = attempt(kind=kind, status=200, token_ids=(1,), done=kind == "stream", finish_reason="abort",
                             started=start, ended=start + length)

    outcome = classify(ended_by_fault, EXPECTED, DOWN, ffn_deaths=[10.0])

    in_flight = start < 10.0 <= start + length
    assert outcome == ("ended_by_fault" if in_flight else "aborted_while_up")


def test_stream_lines_parse_into_chunks_errors_and_done():
    assert parse_stream_line('data: {"choices": [{"token_ids": [7, 8]}]}') == ("chunk", Chunk([7, 8], ""))
    assert parse_stream_line('data: {"choices": [{"token_ids": [], "finish_reason": "abort"}]}') == (
        "chunk", Chunk([], "abort"))
    assert parse_stream_line('data: {"error": {"message": "boom", "code": 500}}') == ("error", "boom")
    assert parse_stream_line("data: [DONE]") == ("done", None)
    assert parse_stream_line("") == ("skip", None)


def test_group_rss_sums_vmrss_of_the_group_only(tmp_path):
    for pid, pgrp, kb in ((10, 10, 2048), (11, 10, 1024), (12, 99, 4096)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (VLLM::Worker (x)) S 1 {pgrp} {pgrp} 0\n")
        (tmp_path / str(pid) / "status").write_text(f"Name:\tx\nVmRSS:\t{kb} kB\n")
    (tmp_path / "self").mkdir()

    assert group_rss_mb(10, proc=tmp_path) == 3.0
    assert group_rss_mb(42, proc=tmp_path) == 0.0
    assert group_rss_mb(os.getpgrp()) > 0.0  # the real /proc


def test_the_engine_dead_500_is_accepted_only_for_a_request_in_flight_when_the_ffn_died():
    def died(started, ended):
        return attempt(status=500, message="EngineCore encountered an issue. See stack trace (above) for the root "
                       "cause.", started=started, ended=ended)

    assert classify(died(9.0, 10.5), EXPECTED, DOWN, ffn_deaths=[10.0]) == "engine_died_in_flight"
    assert classify(died(10.2, 10.5), EXPECTED, DOWN, ffn_deaths=[10.0]) == "http_500"  # arrived after: needs the 503
    assert classify(died(9.0, 10.5), EXPECTED, DOWN) == "http_500"


def test_a_stream_the_fault_closed_without_an_abort_chunk_ended_by_fault_only_while_in_flight():
    """vLLM's fault path may close an open stream with [DONE] and no finish reason (seen in CI)."""
    cut = attempt(kind="stream", status=200, token_ids=(), done=True, finish_reason="", started=9.9, ended=10.2)

    assert classify(cut, EXPECTED, DOWN, ffn_deaths=[10.0]) == "ended_by_fault"
    assert classify(cut, EXPECTED, DOWN, ffn_deaths=[30.0]) == "wrong_tokens"  # no fault while it was open
    assert classify(cut._replace(token_ids=(1, 2, 3)), EXPECTED, DOWN, ffn_deaths=[10.0]) == "completed"
