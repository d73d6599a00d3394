"""``P2pNcclAFDConnector``: the AFD protocol over vLLM's ``PyNcclCommunicator`` (AFD_SPEC.md §4.7).

One communicator per channel (a2e, e2a, ctrl), each over a ``StatelessProcessGroup`` on a prefix of
the AFD store and bound to ``cuda:<local_rank>``. Sends and receives run on the caller's current
stream, so they can be captured in CUDA graphs. NCCL refuses two ranks on one GPU, so the ranks'
GPU UUIDs are compared through the store first and the refusal names the fix. ``abort()`` and
``close()`` destroy the communicators (``ncclCommAbort`` on a daemon thread inside vLLM); after that
vLLM's ``send``/``recv`` silently do nothing, which is why the protocol checks for failure before
every transport call.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

import torch

from vllm_afd.connectors.channels import ChannelPlan, P2pSettings, P2pTransport
from vllm_afd.connectors.p2p import P2pAFDConnector

__all__ = ["DUPLICATE_GPU_MESSAGE", "NcclTransport", "P2pNcclAFDConnector"]

DUPLICATE_GPU_MESSAGE = (
    "P2pNcclAFDConnector needs a distinct GPU per rank; use P2pGlooAFDConnector to run both roles on one GPU"
)


def gpu_identity(device: torch.device) -> str:
    """``hostname/GPU-UUID`` of ``device``: equal for two ranks exactly when NCCL would refuse them."""
    uuid = torch.cuda.get_device_properties(device).uuid
    return f"{socket.gethostname()}/{uuid}"


def find_shared_gpu(identities: dict[int, str], own: int) -> int | None:
    """Another AFD rank of ``identities`` on the same GPU as ``own``, or None."""
    return next((rank for rank, ident in sorted(identities.items()) if rank != own and ident == identities[own]), None)


class NcclTransport(P2pTransport):
    """Three NCCL communicators on ``device``; every call runs on the current CUDA stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.control_device = device
        self._comms: dict[str, Any] = {}

    def open(self, store: Any, plan: ChannelPlan, timeout_s: float) -> None:
        self._check_distinct_gpus(store, plan, timeout_s)  # before any NCCL call (and any vLLM import)

        from torch.distributed import PrefixStore
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        for name, prefix, rank, size in plan.channels():
            group = StatelessProcessGroup(rank=rank, world_size=size, store=PrefixStore(prefix, store))
            try:
                comm = PyNcclCommunicator(group, device=self.device)
            except RuntimeError as exc:
                if "Duplicate GPU" in str(exc) or "invalid usage" in str(exc):
                    raise RuntimeError(f"{DUPLICATE_GPU_MESSAGE} (NCCL: {exc})") from exc
                raise
            if comm.disabled:
                raise RuntimeError(
                    f"P2pNcclAFDConnector: vLLM's PyNcclCommunicator for the AFD {name} channel is disabled "
                    "(VLLM_DISABLE_PYNCCL is set or the NCCL library failed to load); expected a working "
                    "NCCL. Unset VLLM_DISABLE_PYNCCL, or use P2pGlooAFDConnector"
                )
            self._comms[name] = comm

    def _check_distinct_gpus(self, store: Any, plan: ChannelPlan, timeout_s: float) -> None:
        """Fail with the fix instead of NCCL's "invalid usage" when two group members share a GPU."""
        members = set(plan.subgroup_members)
        if plan.control_rank is not None:
            members |= set(range(plan.control_size))
        store.set(f"afd/gpu/{plan.afd_rank}", gpu_identity(self.device))
        keys = {rank: f"afd/gpu/{rank}" for rank in sorted(members)}
        store.wait(list(keys.values()), datetime.timedelta(seconds=timeout_s))
        identities = {rank: store.get(key).decode() for rank, key in keys.items()}
        other = find_shared_gpu(identities, plan.afd_rank)
        if other is not None:
            raise RuntimeError(
                f"{DUPLICATE_GPU_MESSAGE} (AFD ranks {plan.afd_rank} and {other} are both on "
                f"{identities[other]})"
            )

    def send(self, channel: str, tensor: torch.Tensor, dst: int) -> None:
        self._require_gpu(tensor)
        self._comm(channel).send(tensor, dst)

    def recv(self, channel: str, tensor: torch.Tensor, src: int) -> int:
        self._require_gpu(tensor)
        self._comm(channel).recv(tensor, src)
        return src

    def abort(self) -> None:
        # NOTE: destroy() runs ncclCommAbort on its own daemon thread and joins it for at most 5 s.
        for comm in list(self._comms.values()):
            comm.destroy()

    def close(self) -> None:
        self.abort()
        self._comms = {}

    def _comm(self, channel: str) -> Any:
        try:
            return self._comms[channel]
        except KeyError:
            raise RuntimeError(
                f"P2pNcclAFDConnector: the AFD {channel} communicator is missing (have {sorted(self._comms)}); "
                "expected init_afd_connector() to have created it. Only attention ranks < num_ffn_ranks "
                "and FFN ranks join the control group"
            ) from None

    def _require_gpu(self, tensor: torch.Tensor) -> None:
        if tensor.device != self.device:
            raise ValueError(
                f"P2P hidden states must be on GPU {self.device} for P2pNcclAFDConnector (got a tensor on "
                f"{tensor.device}); move it to the rank's device, or use P2pGlooAFDConnector on CPU"
            )


class P2pNcclAFDConnector(P2pAFDConnector):
    """The P2P protocol over NCCL; graph-capturable, one GPU per rank."""

    @classmethod
    def make_device(cls, vllm_config: Any, local_rank: int) -> torch.device:
        return torch.device("cuda", local_rank)

    @classmethod
    def make_transport(cls, settings: P2pSettings) -> P2pTransport:
        return NcclTransport(settings.device)
