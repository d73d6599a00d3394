"""CUDA graphs of the FFN step, keyed by the attention ranks' published row counts.

The key is per stage the counts exactly as published (attention-rank level, never
aggregated FFN totals: peer receive shapes are baked into a graph, and aggregated keys
alias layouts such as 4+4 vs 7+1).  A capture payload for a known key replaces that
graph (vLLM's graph-memory profiling captures before the real capture).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from vllm_afd.wire.messages import ControlPayload


def graph_key(payload: ControlPayload) -> tuple:
    """((stage, (count per attention rank, ...)), ...) over the payload's sorted stages."""
    return tuple((stage, tuple(counts)) for stage, counts in payload.counts.items())


def run_mode(payload: ControlPayload, *, use_cuda_graph: bool, has_graph: bool) -> str:
    """WARMUP, CAPTURE, REPLAY or EAGER for one payload (docs/ffn.md#run-mode-and-graph-key).

    REPLAY needs all three: graphs on, the attention replaying, and a graph for the key; a
    key match alone would replay during an eager prefill of the same shape.
    """
    if payload.is_warmup:
        return "WARMUP"
    if payload.is_graph_capturing:
        return "CAPTURE"
    if use_cuda_graph and payload.is_graph_replaying and has_graph:
        return "REPLAY"
    return "EAGER"


class FFNGraphCache:
    """Recorded FFN steps and the one memory pool they share."""

    def __init__(self, device: torch.device):
        self.device = device
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self._pool: Any = None

    def has(self, key: tuple) -> bool:
        return key in self._graphs

    def capture(self, key: tuple, forward: Callable[[], Any]) -> None:
        """Record `forward` under `key` (the step state was adopted before, outside the capture)."""
        from vllm.distributed.parallel_state import graph_capture

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with graph_capture(self.device) as capture_context:
            with torch.cuda.graph(graph, pool=self._pool, stream=capture_context.stream):
                output = forward()
        self._graphs[key] = (graph, output)

    def replay(self, key: tuple) -> Any:
        graph, output = self._graphs[key]
        graph.replay()
        return output

    def clear(self) -> None:
        self._graphs.clear()
        self._pool = None
