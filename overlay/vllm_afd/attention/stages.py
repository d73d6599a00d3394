"""The micro-batch stages of one attention step (docs/pingpong.md#3-splitting-a-step-into-stages-attention).

Pure and vLLM-free, testable on CPU.  The attention decides alone, per step, how many stages the
step runs (`stages_for_step`: 1 or `num_stages`, never in between) and splits its tokens the way
vLLM's micro-batching does (`split_tokens`, the token ranges of
`vllm/v1/worker/ubatch_utils.py:maybe_create_ubatch_slices` after padding), so that the rows each
stage publishes (`stage_counts`) equal the rows vLLM's slicing makes that stage send.  Requests may
straddle a stage boundary (a prefill chunk); one-token requests never do.
"""

from __future__ import annotations

import bisect
import itertools
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_afd.config import NUM_STAGES

__all__ = ["StageRange", "plan_stages", "split_tokens", "stage_counts", "stage_sizes", "stages_for_step"]


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


def _whole(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"AFD stages: {name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def stages_for_step(num_stages: int, num_tokens: int, *, min_tokens_per_stage: int = 1,
                    allowed: bool = True) -> int:
    """How many stages a step of `num_tokens` scheduled (unpadded) tokens runs: `num_stages`, or 1.

    1 when the deployment has one stage, when vLLM vetoes the split (`allowed=False`: a prefix-cache
    reader and its writer in one batch), or when some stage would get fewer than
    `min_tokens_per_stage` tokens (batch 1 is always one stage).
    """
    if isinstance(num_stages, bool) or num_stages not in NUM_STAGES:
        raise ValueError(f"AFD stages: num_stages must be one of {NUM_STAGES}, got {num_stages!r}; "
                         "pass AFDConfig.num_stages")
    num_tokens = _whole("num_tokens", num_tokens, 0)
    min_tokens_per_stage = _whole("min_tokens_per_stage", min_tokens_per_stage, 1)
    if num_stages == 1 or not allowed or num_tokens < num_stages * min_tokens_per_stage:
        return 1
    return num_stages


def stage_sizes(num_tokens_padded: int, num_stages: int) -> list[int]:
    """Tokens (rows) of each stage of a padded step: `num_tokens_padded // k` each, the rest to the last."""
    num_tokens_padded = _whole("num_tokens_padded", num_tokens_padded, 1)
    num_stages = _whole("num_stages", num_stages, 1)
    if num_tokens_padded < num_stages:
        raise ValueError(
            f"AFD stages: {num_tokens_padded} tokens cannot fill {num_stages} stages; ask stages_for_step first"
        )
    step = num_tokens_padded // num_stages
    return [step] * (num_stages - 1) + [num_tokens_padded - step * (num_stages - 1)]


def split_tokens(num_scheduled_tokens: Sequence[int], num_tokens_padded: int,
                 num_stages: int) -> tuple[StageRange, ...]:
    """vLLM's token-balanced split of a (padded) step into `num_stages` ranges.

    Stage j < k-1 holds tokens [j*s, (j+1)*s) with s = num_tokens_padded // k; the last stage holds the
    rest, padding included.  `num_scheduled_tokens`: tokens per request, in batch order.
    """
    num_stages = _whole("num_stages", num_stages, 1)
    counts = [_whole(f"num_scheduled_tokens[{i}]", n, 1) for i, n in enumerate(num_scheduled_tokens)]
    num_tokens_padded = _whole("num_tokens_padded", num_tokens_padded, 1)
    num_tokens = sum(counts)
    if num_tokens_padded < num_tokens:
        raise ValueError(
            f"AFD stages: num_tokens_padded ({num_tokens_padded}) is below the scheduled tokens ({num_tokens}); "
            "pass the step's token count after CUDA-graph and DP padding"
        )
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


def stage_counts(stage_rows: Sequence[int], num_dp_ranks: int) -> dict[int, list[int]]:
    """The payload's counts from each stage's rows (`stage_sizes`, a `StageRange.num_tokens`, or a vLLM
    micro-batch slice's): per stage, its rows for every attention DP rank alike (vLLM pads them so,
    `UBatchRunner._make_forward_contexts`)."""
    num_dp_ranks = _whole("num_dp_ranks", num_dp_ranks, 1)
    if not stage_rows:
        raise ValueError("AFD stages: no stages; a step runs at least one (plan_stages)")
    return {stage: [int(rows)] * num_dp_ranks for stage, rows in enumerate(stage_rows)}
