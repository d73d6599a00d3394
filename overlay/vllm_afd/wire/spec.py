"""``ConnectorSpec``: what a connector exchanges and its bounds, as plain values (connect.py builds it).

Both ends read it (connector.py, attention_end.py, ffn_end.py), and a preallocating transport sizes
itself from it (connect.TRANSPORTS). ``check_tensor`` is the shape check every send runs before any
byte reaches the wire.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ConnectorSpec"]


@dataclass(frozen=True, slots=True)
class ConnectorSpec:
    """What the connector exchanges and its bounds; plain values (vllm_afd/connect.py builds it)."""

    # Registered connector name, used in messages.
    name: str
    # Width and dtype of every exchanged row, and the device tensors live on.
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    # Store address (FFN rank 0) and the three bounds of docs/config.md.
    host: str
    port: int
    rendezvous_timeout_s: float
    step_timeout_s: float
    peer_timeout_s: float
    # Exchanges per stage of one step: the crossing layers (MoE layers only with the gate on attention).
    exchanges_per_stage: int
    # Router-logit width the attention sends with the gate on attention; None when it sends none.
    router_logits_width: int | None = None
    # FFN: persistent receive buffers keyed by (stage, peer, shape), for CUDA-graph replay.
    use_graph_buffers: bool = False
    # Largest rows one exchange carries per attention rank (vLLM's max_num_batched_tokens); sizes the
    # slots of a preallocating transport (P2pIpcAFDConnector). None where nothing is preallocated.
    max_rows: int | None = None
    # Which clock stamps the per-exchange timeline (docs/timeline.md): "host", "device", or None (off).
    timeline_clock: str | None = None
    # Micro-batch stages per step at most (the handshake's num_stages, docs/pingpong.md); a payload with
    # more is refused, and a preallocating transport sizes its slots by it.
    num_stages: int = 1
    # Integrity mode: every data message is followed by its seal, checked on receipt (wire/integrity.py).
    integrity: bool = False
    # Bound on a step, a transfer or device work before step timeouts are armed (docs/config.md).
    startup_timeout_s: float = 1800.0

    def check_tensor(self, tensor: torch.Tensor, what: str, width: int | None, dtype: torch.dtype | None) -> None:
        """Raise ValueError unless ``tensor`` is 2-D, ``width`` wide, of ``dtype`` and on this spec's device."""
        problems = []
        if tensor.dim() != 2:
            problems.append(f"rank {tensor.dim()}, expected 2-D [rows, {width or 'width'}]")
        elif width is not None and tensor.shape[1] != width:
            problems.append(f"width {tensor.shape[1]}, expected {width}")
        if tensor.device != self.device:
            problems.append(f"device {tensor.device}, expected {self.device}")
        if dtype is not None and tensor.dtype != dtype:
            problems.append(f"dtype {tensor.dtype}, expected {dtype}")
        if problems:
            raise ValueError(
                f"{self.name}: {what} of shape {list(tensor.shape)} cannot be sent: {'; '.join(problems)}. "
                "Pass the model's [rows, hidden] tensor on the connector's device"
            )
