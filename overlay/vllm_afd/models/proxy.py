"""The attention role's stand-ins for the FFN half, and the two custom ops they call.

The native decoder `forward` calls `self.mlp(hidden_states)` right after
`post_attention_layernorm`. On the attention role that slot holds a proxy, which calls two
opaque custom ops, `torch.ops.vllm_afd.afd_send` and `torch.ops.vllm_afd.afd_recv`. vLLM
compiles the model with Dynamo guards dropped, so Python state read inside the compiled module
is frozen at trace time: the ops declare their tensor arguments mutated (compile neither drops
nor reorders them) and take only the trace-stable layer index. Everything per step happens in
the op bodies at every call: reading the forward-context sidecar the attention runner installs,
finding the connector by its integer handle (custom ops cannot take objects), the lazy publish of
the step's control payload on the V1 runner, and the exchange itself.

From the `mlp` slot to the wire: proxy `forward` -> `remote_ffn` -> op body ->
`AFDConnector.send_a2f` (wire/connector.py) -> the transport (wire/transports/).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from vllm_afd.wire.connector import AFDConnector
from vllm_afd.wire.errors import AFDError

__all__ = [
    "SIDECAR_KEY",
    "ForwardSidecar",
    "RemoteFFNProxy",
    "RemoteMoEProxyMixin",
    "register_afd_ops",
    "register_connector",
    "remote_ffn",
    "unregister_connector",
]

# Key of the sidecar in forward_context.additional_kwargs.
SIDECAR_KEY = "afd_metadata"


@dataclass(slots=True)
class ForwardSidecar:
    """What the ops need from one forward context; the attention runner's hook installs it."""

    # Handle of the runner's connector in this module's registry.
    handle: int
    # Stage (micro-batch) this forward runs; 0 while steps have one stage.
    stage: int = 0
    # Whether this forward's payload was published: True on Model Runner V2 (its per-step hook
    # publishes), False on V1 until the first op of the forward publishes it.
    published: bool = False
    # vLLM's memory-profile forward; the lazy V1 publish copies it into the payload's flag.
    is_profile: bool = False
    # What the send op yields right after issuing its send, so the next stage runs: the CPU stage
    # baton (attention/ubatch.py) or vLLM's micro-batch handoff (attention/cuda_stages.py, a no-op
    # outside a split step). None when the forward never runs as one of several stages.
    baton: Any = None
    # Inside a step (execute_model): a failed exchange fills zeros instead of raising, and the step gate
    # raises at the step's end on every tensor-parallel rank (attention/step_gate.py). Elsewhere (profile,
    # warm-up, capture) the op raises.
    defer_failures: bool = False


# ---- the proxies -----------------------------------------------------------------------------------


def remote_ffn(hidden_states: torch.Tensor, router_logits: torch.Tensor | None, layer_idx: int) -> torch.Tensor:
    """One exchange: send `hidden_states` (then `router_logits`), receive the FFN's output.

    The output lands in the tensor just sent, which the native decoder never reads again.
    NOTE: this also chains the two ops through one tensor. Receiving into a fresh buffer instead
    leaves the send's declared mutation of a dead intermediate as its only effect, and inductor then
    drops the send as dead code (tests/models/test_proxy.py checks both ops survive compilation).
    """
    torch.ops.vllm_afd.afd_send(hidden_states, router_logits, layer_idx)
    torch.ops.vllm_afd.afd_recv(hidden_states, layer_idx)  # [num_tokens, hidden_size]
    return hidden_states


class RemoteFFNProxy(nn.Module):
    """Parameter-free `mlp` of a layer whose MLP or MoE block runs on the FFN role."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return remote_ffn(hidden_states, None, self.layer_idx)

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}"


class RemoteMoEProxyMixin:
    """`forward` of the MoE proxies, mixed in front of a native MoE block class.

    The per-model subclass inherits from the native block so native code that tells MoE from
    dense layers by `isinstance` still does, but never runs the native `__init__` (it would build
    the fused-MoE layer and its expert weights): it calls `init_proxy` instead. With the gate on
    attention, `gate` is the native router and its logits follow the hidden states on the wire;
    otherwise the proxy has no parameters.
    """

    layer_idx: int
    gate: nn.Module | None

    def init_proxy(self, layer_idx: int, gate: nn.Module | None, num_routed_experts: int) -> None:
        """Stand-in for the native block's `__init__`: the layer, the router, the counts.

        The counts carry the native attribute names, as set by `Qwen3MoeSparseMoeBlock` and
        `DeepseekV2MoE` at 0.30.0 and read by `Qwen3MoeForCausalLM.__init__` and
        `DeepseekV2MixtureOfExperts.extract_moe_parameters`. EPLB is off under AFD, so no expert
        is redundant; the attention role holds no expert, so none is local.
        """
        nn.Module.__init__(self)  # type: ignore[arg-type]
        self.layer_idx = layer_idx
        self.gate = gate
        self.n_routed_experts = num_routed_experts
        self.n_logical_experts = num_routed_experts
        self.n_redundant_experts = 0
        self.n_physical_experts = num_routed_experts
        self.n_local_physical_experts = 0

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits = None
        if self.gate is not None:
            router_logits, _ = self.gate(hidden_states)  # [num_tokens, num_routed_experts]
        return remote_ffn(hidden_states, router_logits, self.layer_idx)

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, gate_on_attention={self.gate is not None}"


# ---- connector registry: the ops find the runner's connector by handle ------------------------------

_lock = threading.Lock()
# Keeps the op library alive for the process's lifetime; None until registered.
_library: Optional[torch.library.Library] = None
# handle -> connector; handles are never reused within a process.
_connectors: dict[int, AFDConnector] = {}
_handles = itertools.count(1)


def register_connector(connector: AFDConnector) -> int:
    """Register ``connector``; returns the integer handle the sidecar carries into the ops."""
    with _lock:
        handle = next(_handles)
        _connectors[handle] = connector
    return handle


def unregister_connector(handle: int) -> None:
    """Forget ``handle``; unknown handles are ignored so teardown paths may repeat it."""
    with _lock:
        _connectors.pop(handle, None)


# ---- op bodies ---------------------------------------------------------------------------------------


def _forward_state() -> tuple[Any, ForwardSidecar, AFDConnector]:
    """The current forward context, its AFD sidecar and the connector the sidecar names."""
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
        connector = _connectors[sidecar.handle]
    except KeyError:
        raise RuntimeError(
            f"RemoteFFNProxy: AFD connector handle {sidecar.handle} is not registered (registered: "
            f"{sorted(_connectors)}); the runner unregisters it at shutdown: no forward may run after that"
        ) from None
    return context, sidecar, connector


def _publish_lazily(connector: AFDConnector, context: Any, sidecar: ForwardSidecar, hidden: torch.Tensor) -> None:
    """V1 runner: the first op of a forward context publishes that step's payload."""
    if connector.placement.dp_size > 1:
        if context.dp_metadata is None:
            raise RuntimeError(
                f"AFD: attention DP size {connector.placement.dp_size} but the forward context has no "
                "dp_metadata; expected vLLM's MoE DP engine to set it"
            )
        counts = [int(n) for n in context.dp_metadata.num_tokens_across_dp_cpu]
    else:
        counts = [int(hidden.shape[0])]
    connector.publish({sidecar.stage: counts}, is_profile=sidecar.is_profile)
    sidecar.published = True


def _afd_send_impl(hidden: torch.Tensor, router_logits: Optional[torch.Tensor], layer_idx: int) -> None:
    context, sidecar, connector = _forward_state()
    try:
        if not sidecar.published:
            _publish_lazily(connector, context, sidecar, hidden)
        connector.send_a2f(sidecar.stage, hidden, router_logits)
    except AFDError as exc:
        if not sidecar.defer_failures:
            raise
        connector.defer_failure(exc)
    if sidecar.baton is not None:
        sidecar.baton.yield_stage()  # the next stage computes while this one's rows travel


def _afd_send_fake(hidden: torch.Tensor, router_logits: Optional[torch.Tensor], layer_idx: int) -> None:
    return None


def _afd_recv_impl(out: torch.Tensor, layer_idx: int) -> None:
    _, sidecar, connector = _forward_state()
    try:
        result = connector.recv_f2a(sidecar.stage, out)
    except AFDError as exc:
        if not sidecar.defer_failures:
            raise
        connector.defer_failure(exc)
        out.zero_()  # NOTE: the step gate raises at the step's end; these rows are never used
        return
    if result is not out:
        out.copy_(result)


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
