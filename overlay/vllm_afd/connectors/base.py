"""The AFD connector contract (AFD_SPEC.md §4.1) and the control-plane interface.

Importable without torch or vLLM: the factory, the config checks and the null connector use these
classes in processes that never touch a device.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm_afd.config import check_p2p_extra_config

if TYPE_CHECKING:
    import torch

    from vllm_afd.config import AFDConfig
    from vllm_afd.connectors.metadata import (
        AFDA2FTransferPayload,
        AFDControlPayload,
        AFDDPMetadata,
        AFDExpertRoutingSpec,
        AFDTransferContext,
    )

__all__ = ["AFDConnectorBase", "AFDControlPlane", "ConnectorExtraInfo"]

# What `parse_extra_config` returns: an immutable mapping (empty for both of our connectors).
ConnectorExtraInfo = Mapping[Any, Any]


class AFDControlPlane(ABC):
    """Carries one control payload per attention step from attention rank k to FFN rank k (§3.3, §4.3).

    Responsibilities:
      1. ``update_state_from_dp_metadata(payload)`` is local: it stores the stage map and flags that
         size every exchange of the step. The attention calls it before sending, the FFN after
         receiving and before any CUDA-graph capture; never inside a capture body.
      2. ``send_dp_metadata_list(payload)`` transmits on the attention ranks < F and is a no-op on every
         other rank, so callers never check who sends.
      3. ``recv_dp_metadata_list()`` blocks on an FFN rank for the next payload: the FFN's only
         unbounded wait (an idle attention is legal), guarded by the heartbeat and by ``close()``.
      4. Liveness (ours, §3.8): ``mark_startup_done()`` arms the step timeout once the attention's
         profile, warm-up and capture are over; ``mark_step_done()`` ends the step that the last
         payload opened.
    """

    @abstractmethod
    def update_state_from_dp_metadata(self, payload: AFDControlPayload) -> None:
        """Adopt ``payload``'s stages and flags for the exchanges that follow (local, no traffic)."""

    @abstractmethod
    def send_dp_metadata_list(self, payload: AFDControlPayload) -> None:
        """Transmit ``payload`` to this rank's control peer; no-op on non-senders."""

    @abstractmethod
    def recv_dp_metadata_list(self) -> AFDControlPayload:
        """Block for the next payload (FFN ranks only)."""

    @abstractmethod
    def send_dp_metadata(
        self, stages: Mapping[int, AFDDPMetadata | Any], **flags: bool
    ) -> AFDControlPayload:
        """The publish rule of §5.3: build the payload, update the local state, then send it."""

    @abstractmethod
    def mark_startup_done(self) -> None:
        """Attention: flag in the store that start-up (profile, warm-up, capture) is over."""

    @abstractmethod
    def mark_step_done(self) -> None:
        """End the current step (attention: after the forward returned; FFN: after its last send)."""


class AFDConnectorBase(ABC):
    """Moves hidden states between attention and FFN ranks, one exchange per (layer, stage).

    Contract (AFD_SPEC.md §4; every AFD runner relies on it):
      1. Construction stores ``rank`` (vLLM world rank, informational), ``local_rank`` (the device
         index), ``vllm_config``, ``afd_config`` and the derived ``role_rank``, parses
         ``connector_extra_config`` into ``extra_info``, and communicates nothing: no socket, no
         group, no device memory.
      2. ``init_afd_connector()`` is collective over all F + A ranks and idempotent: rendezvous at
         ``host:port``, claim the role rank, fingerprint handshake, data channels (``a2e`` then
         ``e2a``), the control group, the watchdog; bounded by ``rendezvous_timeout_s``.
      3. ``is_initialized`` is true once usable, false after ``close()`` or a failure.
      4. ``close()`` releases channels and stops the watchdog; it is safe repeatedly, after a partial
         init and when never initialised, unblocks a pending receive where the backend allows (NCCL
         abort) and never waits more than 5 s.
      5. Exchanges are positional (no tags): per step, layer-major and stage-minor; the attention
         sends hidden states (then router logits when the gate runs on attention and the layer is
         MoE) on ``a2e`` and receives the result on ``e2a``; the FFN receives from its peers in
         ascending order and answers each with its slice. Rows are checked against the published
         counts before anything is sent.
      6. ``check_failed()`` raises the sticky failure (lost peer, step timeout, transport error);
         every other member calls it first, so no transfer runs after a failure.
      7. ``control_plane`` is an ``AFDControlPlane`` or None; callers branch on ``control_plane is
         None``, never on class names. Both of our connectors install one.
    """

    # The control plane of this connector; None for connectors without one (none of ours).
    control_plane: AFDControlPlane | None = None
    # A: attention ranks (attention DP x TP) this connector serves.
    attn_size: int = 0
    # F: FFN ranks (FFN DP x TP) this connector serves.
    ffn_size: int = 0

    @classmethod
    def parse_extra_config(cls, raw: Any) -> ConnectorExtraInfo:
        """``connector_extra_config`` -> immutable extra info; takes no resources (empty for ours)."""
        return check_p2p_extra_config(cls.__name__, raw)

    def __init__(
        self,
        rank: int,
        local_rank: int,
        vllm_config: Any,
        afd_config: AFDConfig,
        role_rank: int,
    ) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.vllm_config = vllm_config
        self.afd_config = afd_config
        self.role_rank = role_rank
        self.attn_size = afd_config.num_attention_ranks
        self.ffn_size = afd_config.num_ffn_ranks
        self.extra_info = self.parse_extra_config(afd_config.connector_extra_config)

    @property
    def role(self) -> str:
        """"attention" or "ffn"."""
        return self.afd_config.role

    @property
    def dp_size(self) -> int:
        """DP size of this rank's role; the V1 publish path picks its row-count source by it."""
        return self.vllm_config.parallel_config.data_parallel_size

    # ---- lifecycle ------------------------------------------------------------------------------

    @abstractmethod
    def init_afd_connector(self) -> None:
        """Rendezvous, handshake, channels, watchdog (§3.6); collective and idempotent."""

    @property
    @abstractmethod
    def is_initialized(self) -> bool:
        """True once usable; false after ``close()`` or a failure."""

    @abstractmethod
    def close(self) -> None:
        """Release everything; safe repeatedly, after partial init and uninitialised."""

    @abstractmethod
    def check_failed(self) -> None:
        """Raise the sticky failure, if any."""

    # ---- attention side -------------------------------------------------------------------------

    @abstractmethod
    def send_attn_output(
        self,
        hidden_states: torch.Tensor,
        context: AFDTransferContext,
        router_logits: torch.Tensor | None = None,
    ) -> None:
        """One exchange's send: ``[rows, hidden_size]`` (+ ``[rows, num_experts]`` router logits)."""

    @abstractmethod
    def recv_ffn_output(self, ref_tensor: torch.Tensor, ubatch_idx: int = 0) -> torch.Tensor:
        """The FFN result shaped like ``ref_tensor``, received into it when shape/dtype/device fit."""

    # ---- FFN side -------------------------------------------------------------------------------

    @abstractmethod
    def recv_attn_output(
        self, ubatch_idx: int = 0, routing_spec: AFDExpertRoutingSpec | None = None
    ) -> AFDA2FTransferPayload:
        """Receive stage ``ubatch_idx`` from every peer in subgroup order, concatenated."""

    @abstractmethod
    def send_ffn_output(self, output: torch.Tensor, context: AFDTransferContext) -> None:
        """Send each peer its slice of ``output`` (split by the context's ``seq_lens``)."""

    # ---- control-plane shortcut -----------------------------------------------------------------

    def update_state_from_dp_metadata(self, payload: AFDControlPayload) -> None:
        """Forward to the control plane (the FFN runner calls it on the connector)."""
        if self.control_plane is None:
            raise RuntimeError(
                f"{type(self).__name__}: update_state_from_dp_metadata needs a control plane "
                "(control_plane is None); use a control-plane-driven connector"
            )
        self.control_plane.update_state_from_dp_metadata(payload)
