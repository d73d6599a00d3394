"""Test oracles of the stage split: the request and token ranges of each stage of a step.

No production path needs them (vLLM slices the batch itself; the runners publish `stage_sizes` through
`stage_counts`), so they live here, checked against vLLM's `maybe_create_ubatch_slices` in test_stages.py.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_afd.attention.stages import stage_sizes, stages_for_step


@dataclass(frozen=True, slots=True)
class StageRange:
    """One stage of a step: half-open ranges over the batch's requests and (padded) tokens."""

    # Requests whose tokens meet [token_start, token_stop); empty for a stage of padding only.
    req_start: int
    req_stop: int
    # Tokens of the stage in batch order; past the real tokens they are padding.
    token_start: int
    token_stop: int

    @property
    def num_tokens(self) -> int:
        """Rows the stage sends in every crossing layer."""
        return self.token_stop - self.token_start


def split_tokens(num_scheduled_tokens: Sequence[int], num_tokens_padded: int,
                 num_stages: int) -> tuple[StageRange, ...]:
    """vLLM's token-balanced split of a (padded) step into `num_stages` ranges.

    Stage j < k-1 holds tokens [j*s, (j+1)*s) with s = num_tokens_padded // k; the last stage holds the
    rest, padding included.  `num_scheduled_tokens`: tokens per request (each >= 1), in batch order.
    """
    counts = list(num_scheduled_tokens)
    assert all(n >= 1 for n in counts) and num_tokens_padded >= sum(counts), (counts, num_tokens_padded)
    starts = [0, *itertools.accumulate(counts)]  # [num_reqs + 1]: first token of each request, then the end
    bounds = [0, *itertools.accumulate(stage_sizes(num_tokens_padded, num_stages))]
    ranges = []
    for token_start, token_stop in itertools.pairwise(bounds):
        # The request holding token_start (none past the real tokens), up to the last one starting before token_stop.
        req_start = min(bisect.bisect_right(starts, token_start) - 1, len(counts))
        req_stop = min(bisect.bisect_left(starts, token_stop), len(counts))
        ranges.append(StageRange(req_start, max(req_start, req_stop), token_start, token_stop))
    return tuple(ranges)


def plan_stages(num_stages: int, num_scheduled_tokens: Sequence[int], num_tokens_padded: int, *,
                min_tokens_per_stage: int = 1, allowed: bool = True) -> tuple[StageRange, ...]:
    """The stages one step runs: `stages_for_step` on the real tokens, then `split_tokens` of the padded step.

    NOTE: the decision counts real tokens, so padding never splits a step (a batch of 1 padded to a
    graph size of 2 stays one stage instead of sending a stage of padding only).
    """
    count = stages_for_step(num_stages, sum(num_scheduled_tokens), min_tokens_per_stage=min_tokens_per_stage,
                            allowed=allowed)
    return split_tokens(num_scheduled_tokens, num_tokens_padded, count)
