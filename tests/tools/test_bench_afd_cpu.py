"""scripts/bench_afd_cpu.py's method on a shared machine: per-round ratios, the load filter, the half split, the
prompts (pure functions; no servers)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

import bench_afd_cpu
from bench_afd_cpu import OTHER_JOBS, Prompts, Target, half_split, pair_rounds, relative_gap, round_loads

rates = st.floats(min_value=1.0, max_value=1000.0, allow_nan=False)


def test_a_ratio_is_taken_per_round_and_a_loaded_round_is_left_out():
    # Round 2 ran while other jobs took 1.4 cores: its ratio (0.5) is dropped, counted, and kept in all_ratios.
    cell = pair_rounds([120.0, 110.0, 50.0, 130.0], [100.0, 100.0, 100.0, 100.0], [0.1, 0.3, 1.4, 0.0], 0.5)

    assert cell.ratios == pytest.approx((1.2, 1.1, 1.3))
    assert cell.dropped == 1
    assert cell.all_ratios == pytest.approx((1.2, 1.1, 0.5, 1.3))
    assert cell.median == pytest.approx(1.2)
    assert (cell.low, cell.high) == pytest.approx((1.1, 1.3))


def test_the_ratio_of_medians_is_not_what_is_reported():
    """A slow minute that hits both samples of a round cancels in that round's ratio, not in a ratio of medians."""
    numerator = [200.0, 100.0, 210.0, 90.0, 220.0]  # the machine alternates fast and slow minutes
    denominator = [160.0, 80.0, 168.0, 72.0, 176.0]  # always 1.25x slower within a round

    cell = pair_rounds(numerator, denominator, [0.0] * 5, 0.5)

    assert cell.median == pytest.approx(1.25) and cell.low == pytest.approx(cell.high)


def test_samples_must_pair_one_to_one():
    with pytest.raises(ValueError, match="one sample of each target and one load per round"):
        pair_rounds([1.0, 2.0], [1.0], [0.0, 0.0], 0.5)


def test_no_round_kept_gives_nan_not_an_error():
    cell = pair_rounds([1.0, 2.0], [1.0, 1.0], [0.9, 0.8], 0.5)

    assert cell.ratios == () and cell.dropped == 2
    assert math.isnan(cell.median) and math.isnan(cell.low) and math.isnan(cell.halves[0])


def test_a_rounds_load_is_the_larger_of_its_samples():
    assert round_loads([0.1, 0.9, 0.0], [0.4, 0.2, 0.0]) == [0.4, 0.9, 0.0]
    with pytest.raises(ValueError):
        round_loads([0.1, 0.2], [0.3])


def test_half_split_compares_first_and_second_half_in_time_order():
    assert half_split([1.0, 1.2, 9.0, 2.0, 2.2]) == (pytest.approx(1.1), pytest.approx(2.1))  # the middle one: neither
    assert half_split([1.0, 3.0]) == (1.0, 3.0)
    assert all(math.isnan(x) for x in half_split([1.0]))


@given(value=rates, n=st.integers(2, 30))
def test_a_steady_ratio_reproduces_across_halves(value, n):
    first, second = half_split([value] * n)

    assert relative_gap(first, second) == pytest.approx(0.0, abs=1e-12)


def test_relative_gap_is_symmetric_enough_and_undefined_without_a_reading():
    assert relative_gap(1.05, 1.0) == pytest.approx(0.05)
    assert relative_gap(1.0, 1.05) == pytest.approx(0.0476, abs=1e-4)
    assert math.isnan(relative_gap(float("nan"), 1.0)) and math.isnan(relative_gap(1.0, 0.0))


def test_every_request_gets_prompts_of_its_own_of_one_length():
    prompts = Prompts(12)
    issued = [tuple(p) for _ in range(200) for p in prompts.batch(32)]

    assert len(set(issued)) == len(issued) == 6400
    assert {len(p) for p in issued} == {12}
    assert all(16 <= i < 16 + 480 for p in issued for i in p)
    assert len({p[:2] for p in issued}) == len(issued)  # no two share a leading block's first ids


def test_the_report_drops_loaded_rounds_and_prints_halves():
    one, two = (Target(f"AFD {k} stage{'s' * (k > 1)}", "", {}, num_stages=k) for k in (1, 2))
    plain = Target("plain 1 core", "", {})
    loads = [0.0, 0.1, 2.0, 0.2, 0.0]
    for target, rates_ in ((plain, [100.0] * 5), (one, [80.0] * 5), (two, [100.0, 100.0, 40.0, 104.0, 104.0])):
        target.tok_s[8] = rates_
        target.windows[8] = [(0, 1)] * 5
        target.cpu[8] = [{OTHER_JOBS: load} for load in loads]

    text = "\n".join(bench_afd_cpu.report([plain, one, two], [8], "title", min_tokens_per_stage=4,
                                          max_other_cores=0.5))

    # Kept rounds 0, 1, 3, 4: 2 ÷ 1 is 1.25, 1.25, 1.30, 1.30 (median 1.275), halves 1.25 and 1.30; 2 ÷ plain 1.02.
    assert "| 8 | 100.0 | 80.0 | 100.0 | 1.27 (—) | 0.80 | 1.02 | 4/5 |" in text
    assert "| AFD 2 stages ÷ AFD 1 stage | 8 | 1.275 | 1.25–1.30 | 1.250 | 1.300 | 3.8 % | 1.250 | 1 |" in text
