"""scripts/paired_rounds.py: per-round ratios, the load filter, missing samples, the half split, unique prompts
(pure functions; no servers)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from paired_rounds import Prompts, half_split, pair_rounds, relative_gap, round_loads, unique_prompt

rates = st.floats(min_value=1.0, max_value=1000.0, allow_nan=False)


def test_a_ratio_is_taken_per_round_and_a_loaded_round_is_left_out():
    # Round 2 ran while other jobs took 1.4 cores: its ratio (0.5) is dropped, counted, and kept in all_ratios.
    cell = pair_rounds([120.0, 110.0, 50.0, 130.0], [100.0, 100.0, 100.0, 100.0], [0.1, 0.3, 1.4, 0.0], 0.5)

    assert cell.ratios == pytest.approx((1.2, 1.1, 1.3))
    assert (cell.dropped, cell.missing) == (1, 0)
    assert cell.all_ratios == pytest.approx((1.2, 1.1, 0.5, 1.3))
    assert cell.median == pytest.approx(1.2)
    assert (cell.low, cell.high) == pytest.approx((1.1, 1.3))


def test_the_ratio_of_medians_is_not_what_is_reported():
    """A slow minute that hits both samples of a round cancels in that round's ratio, not in a ratio of medians."""
    numerator = [200.0, 100.0, 210.0, 90.0, 220.0]  # the machine alternates fast and slow minutes
    denominator = [160.0, 80.0, 168.0, 72.0, 176.0]  # always 1.25x slower within a round

    cell = pair_rounds(numerator, denominator, [0.0] * 5, 0.5)

    assert cell.median == pytest.approx(1.25) and cell.low == pytest.approx(cell.high)


def test_without_loads_every_round_with_both_samples_is_kept():
    cell = pair_rounds([2.0, None, 3.0, 4.0], [1.0, 1.0, None, 2.0])

    assert cell.ratios == cell.all_ratios == (2.0, 2.0)
    assert (cell.dropped, cell.missing) == (0, 2)


def test_a_missing_sample_and_a_load_are_counted_apart():
    cell = pair_rounds([None, 1.0, 1.5], [1.0, 1.0, 1.0], [0.0, 0.9, 0.0], 0.5)

    assert cell.ratios == (1.5,) and cell.all_ratios == (1.0, 1.5)
    assert (cell.dropped, cell.missing) == (1, 1)


def test_samples_must_pair_one_to_one():
    with pytest.raises(ValueError, match="one sample of each target and one load per round"):
        pair_rounds([1.0, 2.0], [1.0], [0.0, 0.0], 0.5)
    with pytest.raises(ValueError, match="2 and 2 samples with 1 loads"):
        pair_rounds([1.0, 2.0], [1.0, 1.0], [0.0])


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


def test_the_halves_of_a_cell_are_those_of_its_kept_rounds_in_order():
    # Round 1 is dropped (load): the kept ratios 1.0, 1.1, 2.0, 2.2 split into 1.05 and 2.1.
    cell = pair_rounds([1.0, 5.0, 1.1, 2.0, 2.2], [1.0] * 5, [0.0, 1.0, 0.0, 0.0, 0.0], 0.5)

    assert cell.halves == (pytest.approx(1.05), pytest.approx(2.1))


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


def test_prompts_take_their_ids_from_the_range_given_and_go_on_where_another_stopped():
    first = Prompts(4, first_id=6, num_ids=506)
    one = first.batch(600)
    second = Prompts(9, first_id=6, num_ids=506, issued=first.issued)
    two = second.batch(600)

    heads = {tuple(p[:2]) for p in one + two}
    assert len(heads) == 1200  # the second Prompts repeats none of the first's leading ids
    assert all(6 <= i < 512 for p in one + two for i in p)
    assert {len(p) for p in two} == {9} and max(i for p in one for i in p) > 6 + 480  # the whole range is used
    assert unique_prompt(600, 9, 6, 506) == two[0]


def test_prompts_refuse_what_cannot_be_unique():
    with pytest.raises(ValueError, match="length >= 2"):
        Prompts(1).batch(1)
    small = Prompts(3, first_id=0, num_ids=4)
    assert len({tuple(p) for p in small.batch(16)}) == 16 == small.capacity
    with pytest.raises(ValueError, match="17 prompts asked, but 4 ids make only 16 unique ones"):
        small.batch(1)
