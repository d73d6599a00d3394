"""Integrity mode (``afd.integrity``): a seal after every data message, checked on receipt.

With the mode on, each (exchange, peer) message group of a data channel is followed on the same channel by
one seal: an int64 ``[SEAL_WORDS]`` tensor ``[magic, step, exchange, stage, rows, nbytes, crc32, 0]``
(``exchange``: the message's position in its step, layer-major and stage-minor; ``nbytes`` and ``crc32``
over every tensor of the group in order, CRC-32 of their bytes on the host). The receiver checks each field
against what it expects and posted; any difference is an ``AFDPeerProtocolError``, a lost peer
(docs/protocol.md#integrity-mode). Both roles agree on the mode in the handshake (``integrity``). The CRC
reads the bytes on the host, so on CUDA the mode is eager only (connect.py refuses it with graphs).
Off, the ends hold ``NULL_INTEGRITY``, whose seal list is empty and whose checks do nothing.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from vllm_afd.wire.errors import AFDPeerProtocolError

__all__ = ["NULL_INTEGRITY", "SEAL_FIELDS", "SEAL_WORDS", "Integrity", "NullIntegrity", "make_integrity"]

SEAL_MAGIC = 0x41464453  # "AFDS"
SEAL_FIELDS = ("magic", "step", "exchange", "stage", "rows", "nbytes", "crc32", "reserved")
SEAL_WORDS = len(SEAL_FIELDS)


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor`` on the host (a device tensor is copied: integrity mode is eager only)."""
    host = tensor.detach().contiguous().cpu()
    return memoryview(host.reshape(-1).view(torch.uint8).numpy())


def seal_words(step: int, exchange: int, stage: int, tensors: Sequence[torch.Tensor]) -> list[int]:
    """The seal's words for one message group (rows: the first tensor's)."""
    crc, nbytes = 0, 0
    for tensor in tensors:
        data = _host_bytes(tensor)
        crc, nbytes = zlib.crc32(data, crc), nbytes + data.nbytes
    return [SEAL_MAGIC, step, exchange, stage, int(tensors[0].shape[0]), nbytes, crc, 0]


class Integrity:
    """Seals and checks the data messages of one connector end; positions restart with every step."""

    enabled = True

    def __init__(self, connector_name: str, device: torch.device) -> None:
        self.connector_name = connector_name
        self.device = device
        self._positions: dict[str, int] = {}

    def start_step(self) -> None:
        self._positions = {}

    def next_position(self, direction: str) -> int:
        """This end's next message position in ``direction`` ("send a2f", "recv f2a", ...) in the step."""
        position = self._positions.get(direction, 0)
        self._positions[direction] = position + 1
        return position

    def seals(self, step: int | None, exchange: int, stage: int, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """[the seal of ``tensors``] as a tensor on this end's device, to send right after them."""
        words = seal_words(-1 if step is None else step, exchange, stage, tensors)
        return [torch.tensor(words, dtype=torch.int64).to(self.device)]

    def blanks(self) -> list[torch.Tensor]:
        """[a seal buffer] to receive right after a message group."""
        return [torch.zeros(SEAL_WORDS, dtype=torch.int64, device=self.device)]

    def check(self, received: Sequence[torch.Tensor], step: int | None, exchange: int, stage: int,
              tensors: Sequence[torch.Tensor], peer: str) -> None:
        """Raise ``AFDPeerProtocolError`` unless the received seal matches ``tensors`` and the expected place."""
        (seal,) = received
        got = [int(w) for w in seal.cpu().tolist()]
        want = seal_words(-1 if step is None else step, exchange, stage, tensors)
        wrong = [f"{name} {g} (expected {w})" for name, g, w in zip(SEAL_FIELDS, got, want) if g != w]
        if wrong:
            raise AFDPeerProtocolError(
                f"{self.connector_name}: the data message of exchange {exchange}, stage {stage} from {peer} fails "
                f"its integrity seal: {'; '.join(wrong)}. The peer sent other bytes than it sealed, or its messages "
                "are out of step; the pairing is dropped (docs/protocol.md#integrity-mode)"
            )


class NullIntegrity:
    """Integrity mode off: no seals, no checks."""

    enabled = False

    def start_step(self) -> None:
        pass

    def next_position(self, direction: str) -> int:
        return 0

    def seals(self, step: int | None, exchange: int, stage: int, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return []

    def blanks(self) -> list[torch.Tensor]:
        return []

    def check(self, received: Sequence[torch.Tensor], step: int | None, exchange: int, stage: int,
              tensors: Sequence[torch.Tensor], peer: str) -> None:
        pass


NULL_INTEGRITY = NullIntegrity()


def make_integrity(enabled: bool, connector_name: str, device: torch.device) -> Integrity | NullIntegrity:
    return Integrity(connector_name, device) if enabled else NULL_INTEGRITY
