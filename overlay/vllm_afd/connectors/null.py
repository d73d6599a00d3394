"""``NULL_CONNECTOR``: the idle connector, a shared value instead of ``None``.

Modelled on vLLM's ``NO_OP_KV_CONNECTOR``: code that holds "a connector" can call its lifecycle
methods unconditionally; only a transfer through it is an error, because a transfer means AFD
logic ran in a process where AFD is off.
"""

from __future__ import annotations

from typing import Any, NoReturn

from vllm_afd.connectors.base import AFDConnectorBase

__all__ = ["NULL_CONNECTOR", "NullAFDConnector"]


class NullAFDConnector(AFDConnectorBase):
    """Lifecycle calls are no-ops; transfers raise. Has no control plane."""

    control_plane = None

    def __init__(self) -> None:
        # NOTE: no super().__init__: the idle connector has no config, role rank or extra info.
        self.rank = 0
        self.local_rank = 0
        self.vllm_config = None
        self.afd_config = None
        self.role_rank = 0
        self.extra_info = {}

    @property
    def role(self) -> str:
        return "none"

    @property
    def dp_size(self) -> int:
        return 1

    def init_afd_connector(self) -> None:
        return None

    @property
    def is_initialized(self) -> bool:
        return False

    def close(self) -> None:
        return None

    def check_failed(self) -> None:
        return None

    def _no_transfer(self, what: str) -> NoReturn:
        raise RuntimeError(
            f"NullAFDConnector.{what}: AFD is not active in this process (no additional_config"
            '["afd"]); expected no AFD transfer. Pass --additional-config \'{"afd": {...}}\' to both '
            "roles"
        )

    def send_attn_output(self, hidden_states: Any, context: Any, router_logits: Any = None) -> None:
        self._no_transfer("send_attn_output")

    def recv_ffn_output(self, ref_tensor: Any, ubatch_idx: int = 0) -> Any:
        self._no_transfer("recv_ffn_output")

    def recv_attn_output(self, ubatch_idx: int = 0, routing_spec: Any = None) -> Any:
        self._no_transfer("recv_attn_output")

    def send_ffn_output(self, output: Any, context: Any) -> None:
        self._no_transfer("send_ffn_output")

    def __repr__(self) -> str:
        return "NULL_CONNECTOR"


NULL_CONNECTOR = NullAFDConnector()
