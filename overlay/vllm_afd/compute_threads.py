"""What a thread of the overlay does before it runs vLLM's CPU kernels (docs/failures.md#24-amx-on-stage-threads)."""

from __future__ import annotations

import torch


def prepare_compute_thread() -> bool:
    """Ask Linux for AMX tile state on the calling thread; False (and nothing done) where the CPU has no AMX.

    vLLM's CPU attention and fused-MoE kernels use AMX tiles where the CPU has them.  On the AMX development
    host their first call on a thread the overlay started (a micro-batch stage thread, the FFN loop thread)
    killed the worker with SIGILL unless that thread had made this request; the workers' main threads ran the
    same kernels without it.
    """
    return torch.cpu._init_amx()  # noqa: SLF001
