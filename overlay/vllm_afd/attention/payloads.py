"""Row counts the CUDA attention runner publishes (docs/attention.md#publish-rule).

Pure, testable on CPU.  One count per attention DP rank; the connector expands it to one per attention rank.
Invariant (NCCL hangs when broken): the count published for a rank equals the rows that
rank sends in the step, after DP and CUDA-graph padding (docs/topology.md#row-counts).
"""

from __future__ import annotations

from collections.abc import Sequence


def step_counts(num_dp_ranks: int, dp_rank: int, num_tokens: int,
                num_tokens_across_dp: Sequence[int] | None) -> list[int]:
    """An executed step: `[padded tokens]` with one DP rank, vLLM's DP-synced vector otherwise."""
    if num_dp_ranks == 1:
        return [int(num_tokens)]
    if num_tokens_across_dp is None:
        raise RuntimeError("AFD expected vLLM DPMetadata for attention DP > 1")
    counts = [int(n) for n in num_tokens_across_dp]
    if len(counts) != num_dp_ranks or counts[dp_rank] != num_tokens:
        raise RuntimeError(
            f"AFD: vLLM's DP sync gives {counts} for {num_dp_ranks} DP ranks; expected entry "
            f"{dp_rank} to equal this rank's padded batch ({num_tokens}).")
    return counts


def capture_counts(num_tokens: int, num_dp_ranks: int) -> list[int]:
    """A graph warm-up or capture forward: every DP rank records the same descriptor."""
    return [int(num_tokens)] * num_dp_ranks

