"""Per-round paired ratios: the method that makes a benchmark's ratios reproduce on a noisy machine.

A benchmark that compares deployments A and B sends the same kind of request to each in turn, round after
round (the order rotating), so that a slow minute of the machine lands on both samples of a round.  The ratio
is therefore taken per round, A's sample ÷ B's sample of the same round, and a cell reports the median of
those per-round ratios with their min–max; a median of A's rates ÷ a median of B's rates pairs samples from
different minutes and does not cancel the machine's drift (docs/benchmarks.md).  The rounds are then split in
halves (first and second in time) whose medians, side by side, are the run's own reproducibility estimate:
what a second run of half the length could show.

A round's ratio is left out where the round saw other jobs above a bound (`loads`, `max_load`: counted as
dropped) or where either sample is missing (None: a request that failed, a deployment that stopped answering;
counted as missing).  Every request gets prompts of its own (`Prompts`): token ids, of one length, none
repeated in the run, so that with prefix caching off every sample does the same work and none reuses
another's KV blocks.

Used by scripts/bench_afd_cpu.py (CPU, interleaved rounds) and scripts/device/ (the H200's decode bench,
repetitions); stdlib only (the GPU machine has no pip).  Tests: tests/tools/test_paired_rounds.py.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

# Token ids a prompt draws from by default: above the tiny tokenizers' special tokens, below their 512-entry
# vocabularies (tests/harness/afd_harness/tiny_models.py).
FIRST_ID, NUM_IDS = 16, 480


class Prompts:
    """Token-id prompts of `length` ids, a different one for every request of the run (no prefix cache hit).

    Ids are drawn from `first_id` .. `first_id + num_ids - 1`; `issued`: how many prompts came before (a second
    `Prompts` of the same run starts where the first stopped, so the two never repeat each other).
    """

    def __init__(self, length: int, first_id: int = FIRST_ID, num_ids: int = NUM_IDS, issued: int = 0) -> None:
        self.length = length
        self.first_id = first_id
        self.num_ids = num_ids
        self.issued = issued

    @property
    def capacity(self) -> int:
        """How many prompts can differ in their first two ids (the first block of any KV cache)."""
        return self.num_ids ** 2

    def batch(self, batch: int) -> list[list[int]]:
        if self.length < 2:
            raise ValueError(f"Prompts: length {self.length} cannot make every prompt unique; its first two ids "
                             "spell the prompt's number, so pass a length >= 2")
        if self.issued + batch > self.capacity:
            raise ValueError(f"Prompts: {self.issued + batch} prompts asked, but {self.num_ids} ids make only "
                             f"{self.capacity} unique ones; run fewer repetitions or batch sizes")
        first, self.issued = self.issued, self.issued + batch
        return [unique_prompt(r, self.length, self.first_id, self.num_ids) for r in range(first, first + batch)]


def unique_prompt(index: int, length: int, first_id: int = FIRST_ID, num_ids: int = NUM_IDS) -> list[int]:
    """Prompt number `index`: its first two ids spell `index` in base `num_ids`, so no two of the first
    `num_ids`² share their first block; the rest vary with `index` too."""
    head = [first_id + index // num_ids % num_ids, first_id + index % num_ids]
    tail = [first_id + (7 * i + 31 * index) % num_ids for i in range(max(0, length - 2))]
    return (head + tail)[:length]


@dataclass(frozen=True)
class PairedRatio:
    """One ratio cell: the per-round ratios of two targets' samples of one batch, in round order, without the
    rounds whose samples saw other jobs above the bound (`dropped` of them; `all_ratios` keeps every round that
    has both samples) and without the rounds that lack a sample (`missing` of them: no ratio at all)."""

    ratios: tuple[float, ...]
    dropped: int
    all_ratios: tuple[float, ...]
    missing: int = 0

    @property
    def median(self) -> float:
        return median(list(self.ratios))

    @property
    def low(self) -> float:
        return min(self.ratios, default=float("nan"))

    @property
    def high(self) -> float:
        return max(self.ratios, default=float("nan"))

    @property
    def halves(self) -> tuple[float, float]:
        return half_split(self.ratios)


def pair_rounds(numerator: Sequence[float | None], denominator: Sequence[float | None],
                loads: Sequence[float] | None = None, max_load: float = math.inf) -> PairedRatio:
    """Ratios numerator[i] / denominator[i] of the samples of round i, kept where loads[i] <= max_load.

    `loads[i]`: other jobs' CPU (cores) during round i's two samples, the larger of the two (None: no load is
    measured, every round is kept).  A round whose sample is None on either side has no ratio (`missing`).
    """
    loads = [0.0] * len(numerator) if loads is None else loads
    if not len(numerator) == len(denominator) == len(loads):
        raise ValueError(f"pair_rounds: {len(numerator)} and {len(denominator)} samples with {len(loads)} loads; "
                         "expected one sample of each target and one load per round (None for a missing sample)")
    present = [(n / d, load) for n, d, load in zip(numerator, denominator, loads) if n is not None and d is not None]
    every = tuple(r for r, _ in present)
    kept = tuple(r for r, load in present if load <= max_load)
    return PairedRatio(kept, len(every) - len(kept), every, len(numerator) - len(every))


def round_loads(*per_target: Sequence[float]) -> list[float]:
    """Per round, the largest other-jobs share any of the targets' samples of that round saw."""
    return [max(loads) for loads in zip(*per_target, strict=True)]


def half_split(values: Sequence[float]) -> tuple[float, float]:
    """Medians of the first and the second half of `values` (in time order; an odd middle one goes to neither);
    nan, nan below two values. Their difference is what a second run of half the length could show."""
    half = len(values) // 2
    if half == 0:
        return float("nan"), float("nan")
    return median(list(values[:half])), median(list(values[-half:]))


def relative_gap(first: float, second: float) -> float:
    """|first / second - 1|, the difference of two readings of one ratio as a share (nan if undefined)."""
    if not (second > 0 and first == first):
        return float("nan")
    return abs(first / second - 1.0)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
