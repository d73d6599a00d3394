"""The attention role's stand-ins for the FFN half: parameter-free modules that call two custom ops.

The native decoder `forward` calls `self.mlp(hidden_states)` right after
`post_attention_layernorm`. On the attention role that slot holds a proxy, which calls two
opaque custom ops, `torch.ops.vllm_afd.afd_send` and `torch.ops.vllm_afd.afd_recv`, by name only.
vLLM compiles the model with Dynamo guards dropped, so Python state read inside the compiled module
is frozen at trace time: the ops declare their tensor arguments mutated (compile neither drops
nor reorders them) and take only the trace-stable layer index. Everything per step happens in
the op bodies at every call (attention/step.py, which registers the ops).

From the `mlp` slot to the wire: proxy `forward` -> `remote_ffn` -> op body (attention/step.py) ->
`send_a2f` of the attention end (wire/) -> the transport (wire/transports/).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RemoteFFNProxy", "RemoteMoEProxyMixin", "remote_ffn"]


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
