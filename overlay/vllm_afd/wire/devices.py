"""The rank's GPU on a thread AFD starts: made current there before any device work.

CUDA's current device belongs to a host thread, and a new thread starts on cuda:0. vLLM gives each rank
of a role its own GPU (``cuda:<local rank>``; with DP, local DP rank x TP size + TP rank) and makes it
current on the worker's main thread only; the FFN loop runs every step on a thread of its own
(ffn/loop.py). There, whatever looks up "the current device" would reach cuda:0 on a rank that is not
on cuda:0: vLLM's pynccl (the FFN DP/EP collectives take ``current_stream()``), Triton's launches (the
fused MoE kernels), ``torch.cuda.current_stream()`` without a device, a graph capture's stream. So the
loop makes its rank's GPU current first (docs/protocol.md#multi-gpu-readiness). A CPU rank has nothing
to bind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["bind_thread"]


def bind_thread(device: torch.device, set_device: Callable[[Any], None] | None = None) -> None:
    """Make ``device`` current on the calling thread (CUDA); nothing on CPU.

    ``set_device``: ``torch.cuda.set_device`` unless given (tests pass a recording one).
    """
    if device.type != "cuda":
        return
    if device.index is None:
        raise ValueError(f"AFD: device {device} has no index; expected the rank's cuda:<N> from vLLM's worker, "
                         "so that the FFN loop thread runs on the rank's own GPU")
    (set_device or torch.cuda.set_device)(device)
