"""What one attention step tells the FFN, and the two custom ops that exchange its rows.

The one answer to "what does the attention tell the FFN this step?": `AttentionStep` is the only producer
of a step's control payload (its rows per stage and attention DP rank, its flags), whichever runner
publishes it (docs/attention.md#publish-rule):

  Model Runner V2 (CUDA), every executed step     `publish_executed`  (runner.before_model_forward)
  Model Runner V2, graph warm-up and capture      `publish_capture`   (capture.before_capture_forward)
  V1 (CPU), a step split into stages              `publish_stages`    (cpu_runner._model_forward)
  V1, any other forward: its first AFD op          `publish_forward`   (the send op, lazily)

Invariant (NCCL hangs when broken): the count published for a rank equals the rows that rank sends in
the step, after DP and CUDA-graph padding (docs/topology.md#row-counts).

It also holds the ops' side: the forward-context sidecar (`ForwardSidecar`, installed by the runner's
hook), the handle registry through which the ops find the runner's step (custom ops cannot take
objects), and the op bodies behind `torch.ops.vllm_afd.afd_send` / `afd_recv`, which the parameter-free
proxies of `models/proxy.py` call. Inside a step (`in_step`) a failed publish or exchange does not
raise: it is deferred to the step gate, which raises it on every tensor-parallel rank at the step's end
(attention/step_gate.py); a failed receive leaves zeros.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from vllm_afd.attention.stages import whole_number
from vllm_afd.wire.errors import AFDError

__all__ = [
    "SIDECAR_KEY",
    "AttentionStep",
    "ForwardSidecar",
    "register_afd_ops",
    "register_step",
    "stage_counts",
    "step_counts",
    "unregister_step",
]

# Key of the sidecar in forward_context.additional_kwargs.
SIDECAR_KEY = "afd_metadata"


# ---- the counts: one per attention DP rank (the connector expands them to one per attention rank) -------


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


def stage_counts(stage_rows: Sequence[int], num_dp_ranks: int) -> dict[int, list[int]]:
    """The payload's counts from each stage's rows (`stages.stage_sizes`, or a vLLM micro-batch slice's): per
    stage, its rows for every attention DP rank alike (vLLM pads them so, `UBatchRunner._make_forward_contexts`)."""
    num_dp_ranks = whole_number("num_dp_ranks", num_dp_ranks, 1)
    if not stage_rows:
        raise ValueError("AFD stages: no stages; a step runs at least one (stages_for_step)")
    return {stage: [int(rows)] * num_dp_ranks for stage, rows in enumerate(stage_rows)}


# ---- the step -----------------------------------------------------------------------------------------


@dataclass(slots=True)
class ForwardSidecar:
    """What the ops need from one forward context; the attention runner's hook installs it."""

    # Handle of the runner's AttentionStep in this module's registry.
    handle: int
    # Stage (micro-batch) this forward runs; 0 while steps have one stage.
    stage: int = 0
    # Whether this forward's payload was published: True on Model Runner V2 (its per-step hook
    # publishes) and for the CPU runner's stage contexts, False on V1 until the first op publishes it.
    published: bool = False
    # What the send op yields right after issuing its send, so the next stage runs: the CPU stage
    # baton (attention/ubatch.py) or vLLM's micro-batch handoff (attention/cuda_stages.py, a no-op
    # outside a split step). None when the forward never runs as one of several stages.
    baton: Any = None


class AttentionStep:
    """One attention runner's step: what it publishes, and its exchanges' failures (module docstring)."""

    def __init__(self, connector: Any, dp_size: int = 1, dp_rank: int = 0) -> None:
        self.connector = connector  # the attention end of the wire (publish, send_a2f, recv_f2a, defer_failure)
        # This attention server's DP size and rank (vLLM's parallel config).
        self.dp_size, self.dp_rank = dp_size, dp_rank
        # Inside execute_model: failures are deferred to the step gate (the mixin sets it around the step).
        self.in_step = False
        # Inside vLLM's memory-profile run: payloads carry is_profile.
        self.in_profile = False

    def publish_executed(self, num_tokens: int, num_tokens_across_dp: Sequence[int] | None,
                         stage_rows: Sequence[int] | None, *, is_graph_replaying: bool) -> None:
        """Model Runner V2, any executed step: one stage of `num_tokens` padded rows, or `stage_rows` when split."""
        if stage_rows is None:
            counts = {0: step_counts(self.dp_size, self.dp_rank, num_tokens, num_tokens_across_dp)}
        else:
            counts = stage_counts(stage_rows, self.dp_size)
        self._publish(counts, is_graph_replaying=is_graph_replaying, is_profile=self.in_profile)

    def publish_capture(self, stage_rows: Sequence[int], *, warmup: bool) -> None:
        """A graph warm-up (`warmup`) or recorded forward: each stage's rows, the same on every DP rank (every
        rank records the same descriptor)."""
        self._publish(stage_counts(stage_rows, self.dp_size), is_warmup=warmup, is_graph_capturing=not warmup)

    def publish_stages(self, stage_rows: Sequence[int]) -> None:
        """V1, a step split into stages: every stage's rows at once (every DP rank split the same count)."""
        self._publish(stage_counts(stage_rows, self.dp_size))

    def publish_forward(self, context: Any, sidecar: ForwardSidecar, num_rows: int) -> None:
        """V1, the first op of a forward context: its rows, from vLLM's DP metadata at DP > 1."""
        if self.dp_size > 1:
            if context.dp_metadata is None:
                raise RuntimeError(
                    f"AFD: attention DP size {self.dp_size} but the forward context has no "
                    "dp_metadata; expected vLLM's MoE DP engine to set it"
                )
            counts = [int(n) for n in context.dp_metadata.num_tokens_across_dp_cpu]
        else:
            counts = [int(num_rows)]
        self.connector.publish({sidecar.stage: counts}, is_profile=self.in_profile)
        sidecar.published = True

    def run(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
        """`call(...)`: True when it ran; inside a step a failure is deferred to the step gate (False)."""
        try:
            call(*args, **kwargs)
        except AFDError as exc:
            if not self.in_step:
                raise
            self.connector.defer_failure(exc)
            return False
        return True

    def _publish(self, counts: dict[int, list[int]], **flags: bool) -> None:
        self.run(self.connector.publish, counts, **flags)


# ---- the handle registry: the ops find the runner's step by handle ---------------------------------------

_lock = threading.Lock()
# Keeps the op library alive for the process's lifetime; None until registered.
_library: Optional[torch.library.Library] = None
# handle -> step; handles are never reused within a process.
_steps: dict[int, AttentionStep] = {}
_handles = itertools.count(1)


def register_step(step: AttentionStep) -> int:
    """Register ``step``; returns the integer handle the sidecar carries into the ops."""
    with _lock:
        handle = next(_handles)
        _steps[handle] = step
    return handle


def unregister_step(handle: int) -> None:
    """Forget ``handle``; unknown handles are ignored so teardown paths may repeat it."""
    with _lock:
        _steps.pop(handle, None)


# ---- op bodies -------------------------------------------------------------------------------------------


def _forward_state() -> tuple[Any, ForwardSidecar, AttentionStep]:
    """The current forward context, its AFD sidecar and the step the sidecar names."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        raise RuntimeError(
            "RemoteFFNProxy: no vLLM forward context is set; expected the model to run inside the AFD "
            "attention runner's forward"
        )
    context = get_forward_context()
    sidecar = context.additional_kwargs.get(SIDECAR_KEY)
    if not isinstance(sidecar, ForwardSidecar):
        raise RuntimeError(
            f"RemoteFFNProxy: additional_kwargs[{SIDECAR_KEY!r}] is {type(sidecar).__name__}; expected the "
            "AFD attention runner's forward-context hook to install a ForwardSidecar"
        )
    try:
        step = _steps[sidecar.handle]
    except KeyError:
        raise RuntimeError(
            f"RemoteFFNProxy: AFD connector handle {sidecar.handle} is not registered (registered: "
            f"{sorted(_steps)}); the runner unregisters it at shutdown: no forward may run after that"
        ) from None
    return context, sidecar, step


def _send(step: AttentionStep, context: Any, sidecar: ForwardSidecar, hidden: torch.Tensor,
          router_logits: Optional[torch.Tensor]) -> None:
    if not sidecar.published:
        step.publish_forward(context, sidecar, hidden.shape[0])
    step.connector.send_a2f(sidecar.stage, hidden, router_logits)


def _afd_send_impl(hidden: torch.Tensor, router_logits: Optional[torch.Tensor], layer_idx: int) -> None:
    context, sidecar, step = _forward_state()
    step.run(_send, step, context, sidecar, hidden, router_logits)
    if sidecar.baton is not None:
        sidecar.baton.yield_stage()  # the next stage computes while this one's rows travel


def _afd_send_fake(hidden: torch.Tensor, router_logits: Optional[torch.Tensor], layer_idx: int) -> None:
    return None


def _receive_into(step: AttentionStep, stage: int, out: torch.Tensor) -> None:
    result = step.connector.recv_f2a(stage, out)
    if result is not out:
        out.copy_(result)


def _afd_recv_impl(out: torch.Tensor, layer_idx: int) -> None:
    _, sidecar, step = _forward_state()
    if not step.run(_receive_into, step, sidecar.stage, out):
        out.zero_()  # NOTE: the step gate raises at the step's end; these rows are never used


def _afd_recv_fake(out: torch.Tensor, layer_idx: int) -> None:
    return None


def register_afd_ops() -> None:
    """Define ``vllm_afd::afd_send`` and ``vllm_afd::afd_recv`` once per process (later calls no-op)."""
    global _library
    with _lock:
        if _library is not None:
            return
        from vllm.utils.torch_utils import direct_register_custom_op

        library = torch.library.Library("vllm_afd", "FRAGMENT")
        direct_register_custom_op(
            op_name="afd_send",
            op_func=_afd_send_impl,
            mutates_args=["hidden", "router_logits"],
            fake_impl=_afd_send_fake,
            target_lib=library,
        )
        direct_register_custom_op(
            op_name="afd_recv",
            op_func=_afd_recv_impl,
            mutates_args=["out"],
            fake_impl=_afd_recv_fake,
            target_lib=library,
        )
        _library = library
