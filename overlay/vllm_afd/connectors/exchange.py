"""The per-layer data exchange of the AFD P2P protocol (AFD_SPEC.md §4.4-4.5): row checks and order.

One exchange per (layer, stage): the attention sends hidden states (then router logits) on ``a2e``
and receives the result on ``e2a``; the FFN receives from its peers in ascending subgroup order and
answers each with its slice. Rows, widths, dtypes and devices are checked against the published
stage state before any byte is sent. ``P2pExchange`` only does the data plane: the protocol checks
readiness before each call, passes the guarded transport call (``transfer``: watchdog timing, sticky
failure) and counts finished exchanges.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from vllm_afd.connectors.channels import A2E, E2A, ChannelPlan, P2pSettings, P2pTransport
from vllm_afd.connectors.metadata import (
    AFDA2FTransferPayload,
    AFDExpertRoutingSpec,
    AFDTransferContext,
    AFDTransferMetadata,
)
from vllm_afd.connectors.steps import StepState

__all__ = ["P2pExchange", "Transfer"]

# ``P2pProtocol._transfer``: runs one transport call; label and peer name it in a failure.
# NOTE: passed per call, not stored: a stored bound method would make every protocol a reference
# cycle, and an unclosed protocol would keep its store (FFN rank 0's server) until the collector runs.
Transfer = Callable[[Callable[[], Any], str, int], Any]


class P2pExchange:
    """One rank's data plane; see the module docstring."""

    def __init__(self, settings: P2pSettings, plan: ChannelPlan, transport: P2pTransport, steps: StepState) -> None:
        self.settings = settings
        self.plan = plan
        self.transport = transport
        self._steps = steps
        self._routing_specs: set[tuple[int, torch.dtype]] = set()
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    # ---- data plane: attention ------------------------------------------------------------------

    def send_attn_output(
        self,
        transfer: Transfer,
        hidden: torch.Tensor,
        context: AFDTransferContext,
        router_logits: torch.Tensor | None = None,
    ) -> None:
        s = self.settings
        metadata = context.metadata
        stage = self._steps.stage(metadata.stage_idx)
        self._check_tensor(hidden, "hidden states", s.hidden_size, s.dtype)
        if hidden.shape[0] != stage.own_rows:
            raise ValueError(
                f"AFD send rows ({hidden.shape[0]}) differ from the published count ({stage.own_rows}) for "
                f"attention rank {s.role_rank} (layer {metadata.layer_idx}, stage {metadata.stage_idx}); "
                "publish the padded, >= 1 row count this rank sends"
            )
        metadata.validate_tensor_shape(hidden.shape)
        if router_logits is not None:
            if not s.compute_gate_on_attention:
                raise ValueError(
                    f"{s.connector_name}: router logits given with compute_gate_on_attention=false; "
                    "expected hidden states only. Only MoE layers under compute_gate_on_attention=true send them"
                )
            self._check_tensor(router_logits, "router logits", s.num_routed_experts, None)
            if router_logits.shape[0] != hidden.shape[0]:
                raise ValueError(
                    f"router_logits and hidden_states must have equal token counts (router_logits "
                    f"{router_logits.shape[0]}, hidden_states {hidden.shape[0]}); pass this layer's logits"
                )
        label, peer = "a2e send to ffn", self.plan.subgroup
        transfer(lambda: self.transport.send(A2E, hidden.contiguous(), 0), label, peer)
        if router_logits is not None:
            transfer(lambda: self.transport.send(A2E, router_logits.contiguous(), 0), label, peer)

    def recv_ffn_output(self, transfer: Transfer, ref_tensor: torch.Tensor, ubatch_idx: int = 0) -> torch.Tensor:
        s = self.settings
        stage = self._steps.stage(ubatch_idx)
        shape = (ref_tensor.shape[0], s.hidden_size)
        if ref_tensor.shape[0] != stage.own_rows:
            raise ValueError(
                f"AFD receive rows ({ref_tensor.shape[0]}) differ from the published count "
                f"({stage.own_rows}) for attention rank {s.role_rank} (stage {ubatch_idx}); pass the "
                "tensor just sent as ref_tensor"
            )
        fits = (tuple(ref_tensor.shape) == shape and ref_tensor.dtype == s.dtype
                and ref_tensor.device == s.device and ref_tensor.is_contiguous())
        out = ref_tensor if fits else torch.empty(shape, dtype=s.dtype, device=s.device)
        transfer(lambda: self.transport.recv(E2A, out, 0), "e2a receive from ffn", self.plan.subgroup)
        return out

    # ---- data plane: FFN ------------------------------------------------------------------------

    def recv_attn_output(
        self, transfer: Transfer, ubatch_idx: int = 0, routing_spec: AFDExpertRoutingSpec | None = None
    ) -> AFDA2FTransferPayload:
        s = self.settings
        stage = self._steps.stage(ubatch_idx)
        if not stage.peer_rows:
            raise RuntimeError(f"P2P FFN rank has no Attention peers (ffn rank {s.role_rank})")
        if routing_spec is not None:
            self._routing_specs.add((routing_spec.router_logits_width, routing_spec.router_logits_dtype))
        hidden_parts, logit_parts = [], []
        for peer, num_rows in enumerate(stage.peer_rows, start=1):
            label = f"a2e receive from attention (subgroup rank {peer}) on"
            hidden = self._recv_buffer(ubatch_idx, peer, num_rows, s.hidden_size, s.dtype)
            transfer(lambda: self.transport.recv(A2E, hidden, peer), label, s.role_rank)
            hidden_parts.append(hidden)
            if routing_spec is not None:
                width, dtype = routing_spec.router_logits_width, routing_spec.router_logits_dtype
                logits = self._recv_buffer(ubatch_idx, peer, num_rows, width, dtype)
                transfer(lambda: self.transport.recv(A2E, logits, peer), label, s.role_rank)
                logit_parts.append(logits)
        metadata = AFDTransferMetadata.create_ffn_metadata(0, ubatch_idx, stage.peer_rows)
        return AFDA2FTransferPayload(
            _concat(hidden_parts), AFDTransferContext(metadata), _concat(logit_parts) if logit_parts else None
        )

    def send_ffn_output(self, transfer: Transfer, output: torch.Tensor, context: AFDTransferContext) -> None:
        s = self.settings
        metadata = context.metadata
        self._check_tensor(output, "FFN output", s.hidden_size, s.dtype)
        metadata.validate_tensor_shape(output.shape)
        num_peers = self.plan.subgroup_size - 1
        if num_peers == 1:
            parts: Sequence[torch.Tensor] = [output]
        elif len(metadata.seq_lens) == num_peers:
            parts = output.split(metadata.seq_lens)
        elif output.shape[0] % num_peers == 0:
            parts = output.split(output.shape[0] // num_peers)
        else:
            raise ValueError(
                f"cannot evenly split FFN output across Attention peers ({output.shape[0]} rows, "
                f"{num_peers} peers, seq_lens {metadata.seq_lens}); pass the context recv_attn_output returned"
            )
        for peer, part in enumerate(parts, start=1):
            label = f"e2a send to attention (subgroup rank {peer}) from"
            transfer(lambda: self.transport.send(E2A, part.contiguous(), peer), label, s.role_rank)

    def preallocate_buffers(self) -> None:
        """FFN with graph buffers: every receive buffer the adopted stages need, before any capture."""
        s = self.settings
        for stage_idx, stage in self._steps.stages.items():
            for peer, num_rows in enumerate(stage.peer_rows, start=1):
                self._recv_buffer(stage_idx, peer, num_rows, s.hidden_size, s.dtype)
                for width, dtype in self._routing_specs:
                    self._recv_buffer(stage_idx, peer, num_rows, width, dtype)

    # ---- helpers --------------------------------------------------------------------------------

    def _check_tensor(self, tensor: torch.Tensor, what: str, width: int | None, dtype: torch.dtype | None) -> None:
        s = self.settings
        problems = []
        if tensor.dim() != 2:
            problems.append(f"rank {tensor.dim()}, expected 2-D [rows, {width or 'width'}]")
        elif width is not None and tensor.shape[1] != width:
            problems.append(f"width {tensor.shape[1]}, expected {width}")
        if tensor.device != s.device:
            problems.append(f"device {tensor.device}, expected {s.device}")
        if dtype is not None and tensor.dtype != dtype:
            problems.append(f"dtype {tensor.dtype}, expected {dtype}")
        if problems:
            raise ValueError(
                f"{s.connector_name}: {what} of shape {list(tensor.shape)} cannot be sent: "
                f"{'; '.join(problems)}. Pass the model's [rows, hidden] tensor on the connector's device"
            )

    def _recv_buffer(self, stage_idx: int, peer: int, num_rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        s = self.settings
        if not s.use_graph_buffers:
            return torch.empty((num_rows, width), dtype=dtype, device=s.device)
        key = (stage_idx, peer, num_rows, width, dtype)
        buffer = self._buffers.get(key)
        if buffer is None:  # never evicted: a replayed graph finds the address it recorded
            buffer = self._buffers[key] = torch.empty((num_rows, width), dtype=dtype, device=s.device)
        return buffer


def _concat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
