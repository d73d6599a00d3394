"""``make_connector``: one rank's end of the AFD wire, picked by its role.

The attention gets an ``AttentionConnector`` (attention_end.py), the FFN an ``FFNConnector``
(ffn_end.py); both share the link of connector.py. Construction communicates nothing.
"""

from __future__ import annotations

from typing import Any

from vllm_afd.wire.attention_end import AttentionConnector
from vllm_afd.wire.ffn_end import FFNConnector
from vllm_afd.wire.handshake import Fingerprint
from vllm_afd.role import Role
from vllm_afd.wire.placement import Placement
from vllm_afd.wire.spec import ConnectorSpec
from vllm_afd.wire.transport import Transport

__all__ = ["ENDS", "make_connector"]

# Role -> the class of its end.
ENDS: dict[Role, type[AttentionConnector] | type[FFNConnector]] = {
    Role.ATTENTION: AttentionConnector,
    Role.FFN: FFNConnector,
}


def make_connector(spec: ConnectorSpec, placement: Placement, transport: Transport, fingerprint: Fingerprint,
                   **kwargs: Any) -> AttentionConnector | FFNConnector:
    """The end for ``placement.role`` over ``transport``; ``kwargs`` go to ``AFDConnector.__init__``
    (``terminate``, ``new_transport``, ``on_failure``, ``secret``)."""
    return ENDS[placement.role](spec, placement, transport, fingerprint, **kwargs)
