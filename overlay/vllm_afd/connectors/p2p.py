"""``P2pAFDConnector``: the vLLM-facing body that both P2P connectors (gloo.py, nccl.py) share.

It turns the connector contract of base.py into calls on one ``P2pProtocol``. Here ``VllmConfig``
becomes the rank's fingerprint and the plain ``P2pSettings`` (fingerprint.py) the protocol runs on,
so protocol.py and its modules never read vLLM's config. A backend subclass names its device and
its transport, nothing else.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch

from vllm_afd.connectors.base import AFDConnectorBase
from vllm_afd.connectors.channels import P2pSettings, P2pTransport
from vllm_afd.connectors.protocol import P2pProtocol

__all__ = ["P2pAFDConnector"]


class P2pAFDConnector(AFDConnectorBase):
    """Shared body of both P2P connectors: the contract of base.py delegated to one ``P2pProtocol``."""

    def __init__(self, rank: int, local_rank: int, vllm_config: Any, afd_config: Any, role_rank: int) -> None:
        super().__init__(rank, local_rank, vllm_config, afd_config, role_rank)
        from vllm_afd.connectors.fingerprint import build_fingerprint, settings_from_config

        device = self.make_device(vllm_config, local_rank)
        fingerprint = build_fingerprint(vllm_config, afd_config, afd_config.role, role_rank)
        settings = settings_from_config(vllm_config, afd_config, fingerprint, device, type(self).__name__)
        self.protocol = P2pProtocol(settings, self.make_transport(settings), lambda: fingerprint)
        self.control_plane = self.protocol

    @classmethod
    @abstractmethod
    def make_device(cls, vllm_config: Any, local_rank: int) -> torch.device:
        """The device exchanged tensors live on."""

    @classmethod
    @abstractmethod
    def make_transport(cls, settings: P2pSettings) -> P2pTransport:
        """A closed transport for ``settings`` (no communication)."""

    def init_afd_connector(self) -> None:
        self.protocol.init()

    @property
    def is_initialized(self) -> bool:
        return self.protocol.is_initialized

    def close(self) -> None:
        self.protocol.close()

    def check_failed(self) -> None:
        self.protocol.check_failed()

    @property
    def dp_size(self) -> int:
        """DP size of this rank's role (the ops need the attention's to pick the counts source)."""
        return self.protocol.settings.dp_size

    def send_attn_output(self, hidden_states: Any, context: Any, router_logits: Any = None) -> None:
        self.protocol.send_attn_output(hidden_states, context, router_logits)

    def recv_ffn_output(self, ref_tensor: Any, ubatch_idx: int = 0) -> Any:
        return self.protocol.recv_ffn_output(ref_tensor, ubatch_idx)

    def recv_attn_output(self, ubatch_idx: int = 0, routing_spec: Any = None) -> Any:
        return self.protocol.recv_attn_output(ubatch_idx, routing_spec)

    def send_ffn_output(self, output: Any, context: Any) -> None:
        self.protocol.send_ffn_output(output, context)
