"""The micro-batch stages of one attention step (docs/pingpong.md#3-splitting-a-step-into-stages-attention).

Pure and vLLM-free, testable on CPU.  The attention decides alone, per step, how many stages the
step runs (`stages_for_step`: 1 or `num_stages`, never in between) and sizes its stages the way
vLLM's micro-batching does (`stage_sizes`, the token counts of
`vllm/v1/worker/ubatch_utils.py:maybe_create_ubatch_slices` after padding), so that the rows each
stage publishes (attention/step.py) equal the rows vLLM's slicing makes that stage send.  Requests
may straddle a stage boundary (a prefill chunk); one-token requests never do (the request ranges:
tests/attention/_stage_oracles.py).
"""

from __future__ import annotations

import numbers

from vllm_afd.config import NUM_STAGES

__all__ = ["stage_sizes", "stages_for_step", "whole_number"]


def whole_number(name: str, value: object, minimum: int) -> int:
    """`value` as an int, or the stages' ValueError naming `name` when it is no integer >= `minimum`."""
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
    num_tokens = whole_number("num_tokens", num_tokens, 0)
    min_tokens_per_stage = whole_number("min_tokens_per_stage", min_tokens_per_stage, 1)
    if num_stages == 1 or not allowed or num_tokens < num_stages * min_tokens_per_stage:
        return 1
    return num_stages


def stage_sizes(num_tokens_padded: int, num_stages: int) -> list[int]:
    """Tokens (rows) of each stage of a padded step: `num_tokens_padded // k` each, the rest to the last."""
    num_tokens_padded = whole_number("num_tokens_padded", num_tokens_padded, 1)
    num_stages = whole_number("num_stages", num_stages, 1)
    if num_tokens_padded < num_stages:
        raise ValueError(
            f"AFD stages: {num_tokens_padded} tokens cannot fill {num_stages} stages; ask stages_for_step first"
        )
    step = num_tokens_padded // num_stages
    return [step] * (num_stages - 1) + [num_tokens_padded - step * (num_stages - 1)]
