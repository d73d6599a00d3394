"""The gloo transport (connector name ``P2pGlooAFDConnector``): groups on prefixes of the AFD store.

Every tensor crosses as a ``uint8`` view of a contiguous CPU tensor, so gloo's dtype support does not
matter (bf16 included); CUDA tensors are staged through host memory and copied back. Host-synchronous,
hence eager only: the CPU path and both roles on one GPU. A dead peer closes its TCP connections, so
a receive from it fails at once; the watchdog covers a peer that hangs. gloo cannot interrupt a
blocked receive of its own process: ``close()`` drops the groups, which fails the peers' pending
transfers at once, and leaves a local blocked receive to the peer's exit or the watchdog's
termination fallback.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

from vllm_afd.wire.placement import Placement
from vllm_afd.wire.transport import Transport

__all__ = ["GlooTransport"]

# Native timeout of every gloo send/receive. The watchdog enforces steps; the FFN's wait for the next
# payload is legally unbounded, so this only has to outlast any idle period.
# NOTE: passed to every ``wait()``: without it gloo uses the group's creation timeout (the rest of the
# rendezvous), and ``set_timeout`` does not change that for pending sends and receives (torch 2.13).
GLOO_OP_TIMEOUT = datetime.timedelta(days=365)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The uint8 view of a contiguous CPU tensor (gloo moves bytes; bf16 and fp8 included)."""
    return tensor.reshape(-1).view(torch.uint8)


class GlooTransport(Transport):
    """Three gloo groups (a2f, f2a, ctrl) built directly on ``PrefixStore``s of the AFD store.

    NOTE: ``ProcessGroupGloo`` objects are built without ``init_process_group``: they never become
    torch's default group and never enter its global rank maps, which vLLM owns.
    """

    control_device = torch.device("cpu")

    def __init__(self, device: torch.device, channels: tuple[str, ...] | None = None) -> None:
        self.device = device
        # The channels to open (None: all of placement.channels()); the IPC transport keeps only ctrl here.
        self.channels = channels
        self._groups: dict[str, Any] = {}
        # Host staging buffers for non-CPU tensors, by size in bytes: reused across exchanges.
        self._staging: dict[int, torch.Tensor] = {}

    def open(self, store: Any, placement: Placement, timeout_s: float) -> None:
        from torch.distributed import PrefixStore, ProcessGroupGloo

        timeout = datetime.timedelta(seconds=timeout_s)
        for name, prefix, rank, size in placement.channels():
            if self.channels is not None and name not in self.channels:
                continue
            # Creation is bounded by what is left of the rendezvous; traffic by GLOO_OP_TIMEOUT.
            self._groups[name] = ProcessGroupGloo(PrefixStore(prefix, store), rank, size, timeout)

    def send(self, channel: str, tensor: torch.Tensor, dst: int) -> None:
        host = tensor if tensor.device.type == "cpu" else tensor.to("cpu")
        self._group(channel).send([_bytes(host.contiguous())], dst, 0).wait(GLOO_OP_TIMEOUT)

    def recv(self, channel: str, tensor: torch.Tensor, src: int) -> None:
        direct = tensor.device.type == "cpu" and tensor.is_contiguous()
        staging = tensor if direct else self._staging_for(tensor)
        self._group(channel).recv([_bytes(staging)], src, 0).wait(GLOO_OP_TIMEOUT)
        if not direct:
            tensor.copy_(staging)

    def abort(self) -> None:
        groups, self._groups = self._groups, {}
        for group in groups.values():
            group.abort()

    def close(self) -> None:
        # NOTE: dropping the groups closes their TCP pairs, so peers blocked on us fail at once, and
        # releases the store (FFN rank 0's server stops). A receive still blocked in this process keeps
        # what it uses alive and returns when its peer goes away (gloo cannot interrupt it).
        groups, self._groups = self._groups, {}
        for group in groups.values():
            group.shutdown()

    def _group(self, channel: str) -> Any:
        try:
            return self._groups[channel]
        except KeyError:
            raise RuntimeError(
                f"P2pGlooAFDConnector: the AFD {channel} group is missing (groups: {sorted(self._groups)}); "
                "expected AFDConnector.init() to have created it. Only attention ranks < "
                "num_ffn_ranks and FFN ranks join the control group"
            ) from None

    def _staging_for(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        buffer = self._staging.get(nbytes)
        if buffer is None:
            pinned = tensor.device.type == "cuda"
            buffer = self._staging[nbytes] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        return buffer.view(tensor.dtype).view(tensor.shape)
