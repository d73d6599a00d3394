"""The NCCL transport (connector name ``P2pNcclAFDConnector``): one communicator per data channel.

One communicator per data channel (a2f, f2a), each over a group on a prefix of the AFD store and
bound to the rank's GPU; the control channel is a gloo group on the host, like the IPC transport's,
so publishing and reading a step's payload never waits for the GPU (docs/timeline.md). The
communicator is made by the caller's ``make_communicator``: the
vLLM-facing layer passes vLLM's ``PyNcclCommunicator`` (vllm_afd/connect.py), so this package
imports no vLLM. Receives and control-free ``send``s run on the current stream *of the rank's GPU*, so
they can be captured in CUDA graphs; an ``isend`` runs on the channel's comm stream after
an event of the current stream, and its handle makes the current stream wait for the send's
completion event (an NCCL send kernel waits for the receiver: on the compute stream it would hold
every later receive, docs/pingpong.md#5-ordering-why-the-receives-cannot-deadlock). Every stream is
looked up for the transport's device (``RankGpu``), never the calling thread's current device: a thread
starts on cuda:0, and a rank on cuda:1 whose FFN loop thread asked vLLM's communicator for "the current
stream" would enqueue its NCCL calls on another GPU's stream (docs/protocol.md#multi-gpu-readiness). NCCL refuses
two ranks on one GPU, so the ranks'
GPU UUIDs are compared through the store first and the refusal names the fix. ``abort()`` and
``close()`` destroy the communicators (``ncclCommAbort`` on a daemon thread inside vLLM); after that
vLLM's ``send``/``recv`` silently do nothing, which is why the protocol checks for failure before
every transport call.

Nothing read from the store is unpickled (docs/connection.md#store-values): group rank 0 of each
channel mints the NCCL unique id (``new_unique_id``) and writes its 128 raw bytes under the channel's
prefix; the others check the length before building their communicator from those bytes
(``exchange_unique_id``), so the communicator factory takes the id itself. vLLM's own path, a
``PyNcclCommunicator`` on a ``StatelessProcessGroup``, would ``pickle.loads`` the id from the store;
``connect.py`` uses ``PyNcclCommunicator.from_unique_id_bytes`` (vLLM 0.30 and 0.32) instead.
"""

from __future__ import annotations

import datetime
import socket
import time
from collections.abc import Callable
from typing import Any

import torch

from vllm_afd.wire.errors import AFDPeerLostError, AFDProtocolError
from vllm_afd.wire.placement import CONTROL, Placement
from vllm_afd.wire.transport import SendHandle, Transport
from vllm_afd.wire.transports.gloo import GlooTransport

__all__ = ["DUPLICATE_GPU_MESSAGE", "MakeCommunicator", "NCCL_UNIQUE_ID_BYTES", "NcclSend", "NcclTransport",
           "RankGpu", "exchange_unique_id"]

# (the channel's NCCL unique id, group rank, group size, device) -> a communicator with
# ``send(tensor, dst)``, ``recv(tensor, src)``, ``destroy()`` and a ``disabled`` flag.
MakeCommunicator = Callable[[bytes, int, int, torch.device], Any]
NCCL_UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId): NCCL_UNIQUE_ID_BYTES of nccl.h
UNIQUE_ID_KEY = "nccl_unique_id"  # under the channel's prefix
MAX_IDENTITY_BYTES = 1024  # a "hostname/GPU-UUID" published for the duplicate-GPU check

DUPLICATE_GPU_MESSAGE = (
    "P2pNcclAFDConnector needs a distinct GPU per rank; use P2pGlooAFDConnector to run both roles on one GPU"
)


def gpu_identity(device: torch.device) -> str:
    """``hostname/GPU-UUID`` of ``device``: equal for two ranks exactly when NCCL would refuse them."""
    uuid = torch.cuda.get_device_properties(device).uuid
    return f"{socket.gethostname()}/{uuid}"


class RankGpu:
    """The rank's GPU as the transport uses it: its identity and its streams, always named by device.

    Tests on CPU pass a recording fake with the same methods (tests/wire/test_nccl_transport.py).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def identity(self) -> str:
        return gpu_identity(self.device)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def use(self, stream: Any) -> Any:
        """Context manager: ``stream`` (and its device) current on this thread."""
        return torch.cuda.stream(stream)

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        """The caching allocator must not reuse ``tensor`` before ``stream``'s work read it."""
        tensor.record_stream(stream)


def find_shared_gpu(identities: dict[int, str], own: int) -> int | None:
    """Another AFD rank of ``identities`` on the same GPU as ``own``, or None."""
    return next((rank for rank, ident in sorted(identities.items()) if rank != own and ident == identities[own]), None)


def exchange_unique_id(store: Any, rank: int, new_unique_id: Callable[[], bytes], timeout_s: float,
                       channel: str) -> bytes:
    """The NCCL unique id of one channel's communicator, as raw bytes through ``store`` (the channel's prefix).

    Group rank 0 mints it and sets it only if the key is still unset (a value already there was written by
    another client: ``AFDProtocolError``); the others wait for it until ``timeout_s`` (``AFDPeerLostError``
    naming the channel) and refuse a value that is not exactly NCCL_UNIQUE_ID_BYTES bytes.
    """
    if rank == 0:
        unique_id = bytes(new_unique_id())
        assert len(unique_id) == NCCL_UNIQUE_ID_BYTES, f"ncclGetUniqueId gave {len(unique_id)} bytes"
        stored = store.compare_set(UNIQUE_ID_KEY, b"", unique_id)
        if stored != unique_id:
            raise AFDProtocolError(
                f"P2pNcclAFDConnector: the NCCL unique id key of the AFD {channel} channel was set before this rank "
                "(group rank 0) minted it; another client wrote the rendezvous store. Keep the store port private "
                "to the deployment (docs/connection.md#store-values)"
            )
        return unique_id
    try:
        store.wait([UNIQUE_ID_KEY], datetime.timedelta(seconds=max(timeout_s, 0.01)))
    except RuntimeError as exc:  # torch's store timeout (DistStoreError) or a broken connection
        raise AFDPeerLostError(
            f"P2pNcclAFDConnector: group rank 0 of the AFD {channel} channel did not publish the channel's NCCL "
            f"unique id within {timeout_s:g} s ({exc}); expected every rank of the channel to open it. Check the "
            "other role's log"
        ) from exc
    unique_id = store.get(UNIQUE_ID_KEY)
    if not isinstance(unique_id, bytes) or len(unique_id) != NCCL_UNIQUE_ID_BYTES:
        size = len(unique_id) if isinstance(unique_id, bytes) else type(unique_id).__name__
        raise AFDProtocolError(
            f"P2pNcclAFDConnector: the NCCL unique id of the AFD {channel} channel in the store has {size} bytes; "
            f"expected the {NCCL_UNIQUE_ID_BYTES} raw bytes of an ncclUniqueId. Run the same vllm_afd version on "
            "every rank and keep the store port private (docs/connection.md#store-values)"
        )
    return unique_id


class NcclSend:
    """A send on a comm stream; ``wait()`` orders the GPU's current stream after it (no host wait)."""

    def __init__(self, done: Any, gpu: RankGpu) -> None:
        self._done = done
        self._gpu = gpu

    def wait(self) -> None:
        self._gpu.current_stream().wait_event(self._done)


class NcclTransport(Transport):
    """Three NCCL communicators on ``device``; every call runs on the current CUDA stream."""

    def __init__(self, device: torch.device, make_communicator: MakeCommunicator,
                 new_unique_id: Callable[[], bytes], *, gpu: Any = None, control: Transport | None = None) -> None:
        if device.type != "cuda":
            raise ValueError(
                f"P2pNcclAFDConnector: device {device} is not a CUDA device; NCCL moves GPU memory. Use "
                "P2pGlooAFDConnector on CPU"
            )
        self.device = device
        self._make_communicator = make_communicator
        self._new_unique_id = new_unique_id
        self._gpu = gpu if gpu is not None else RankGpu(device)
        self._control = control if control is not None else GlooTransport(torch.device("cpu"), channels=(CONTROL,))
        self._comms: dict[str, Any] = {}
        self._comm_streams: dict[str, Any] = {}  # channel -> the stream its isends run on

    def open(self, store: Any, placement: Placement, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        self._check_distinct_gpus(store, placement, timeout_s)  # before any NCCL call

        from torch.distributed import PrefixStore

        for name, prefix, rank, size in placement.channels():
            if name == CONTROL:
                continue
            unique_id = exchange_unique_id(PrefixStore(prefix, store), rank, self._new_unique_id,
                                           deadline - time.monotonic(), name)
            try:
                comm = self._make_communicator(unique_id, rank, size, self.device)
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
        self._control.open(store, placement, timeout_s)

    def _check_distinct_gpus(self, store: Any, placement: Placement, timeout_s: float) -> None:
        """Fail with the fix instead of NCCL's "invalid usage" when two group members share a GPU."""
        members = set(placement.subgroup_members)  # the control channel is gloo: any GPU will do
        store.set(f"afd/gpu/{placement.afd_rank}", self._gpu.identity())
        keys = {rank: f"afd/gpu/{rank}" for rank in sorted(members)}
        store.wait(list(keys.values()), datetime.timedelta(seconds=timeout_s))
        identities = {rank: _identity(store.get(key), key) for rank, key in keys.items()}
        other = find_shared_gpu(identities, placement.afd_rank)
        if other is not None:
            raise RuntimeError(
                f"{DUPLICATE_GPU_MESSAGE} (AFD ranks {placement.afd_rank} and {other} are both on "
                f"{identities[other]})"
            )

    def send(self, channel: str, tensor: torch.Tensor, dst: int) -> None:
        if channel == CONTROL:
            return self._control.send(channel, tensor, dst)
        self._require_gpu(tensor)
        self._comm(channel).send(tensor, dst, stream=self._gpu.current_stream())

    def isend(self, channel: str, tensor: torch.Tensor, dst: int) -> SendHandle:
        self._require_gpu(tensor)
        comm = self._comm(channel)
        gpu = self._gpu
        stream = self._comm_streams.get(channel)
        if stream is None:
            stream = self._comm_streams[channel] = gpu.new_stream()
        stream.wait_stream(gpu.current_stream())  # the tensor is written on the compute stream
        with gpu.use(stream):
            comm.send(tensor, dst, stream=stream)
            gpu.keep_alive(tensor, stream)
            done = gpu.new_event()
            done.record(stream)
        return NcclSend(done, gpu)

    def recv(self, channel: str, tensor: torch.Tensor, src: int) -> None:
        if channel == CONTROL:
            return self._control.recv(channel, tensor, src)
        self._require_gpu(tensor)
        self._comm(channel).recv(tensor, src, stream=self._gpu.current_stream())

    def abort(self) -> None:
        # NOTE: destroy() runs ncclCommAbort on its own daemon thread and joins it for at most 5 s.
        self._control.abort()
        for comm in list(self._comms.values()):
            comm.destroy()

    def close(self) -> None:
        self.abort()
        self._control.close()
        self._comms = {}

    def _comm(self, channel: str) -> Any:
        try:
            return self._comms[channel]
        except KeyError:
            raise RuntimeError(
                f"P2pNcclAFDConnector: the AFD {channel} communicator is missing (have {sorted(self._comms)}); "
                "expected AFDConnector.init() to have created it. Only attention ranks < num_ffn_ranks "
                "and FFN ranks join the control group"
            ) from None

    def _require_gpu(self, tensor: torch.Tensor) -> None:
        if tensor.device != self.device:
            raise ValueError(
                f"P2P hidden states must be on GPU {self.device} for P2pNcclAFDConnector (got a tensor on "
                f"{tensor.device}); move it to the rank's device, or use P2pGlooAFDConnector on CPU"
            )


def _identity(raw: Any, key: str) -> str:
    """A member's ``hostname/GPU-UUID`` as read from the store: UTF-8 text of bounded length."""
    if isinstance(raw, bytes) and len(raw) <= MAX_IDENTITY_BYTES:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _bad_identity(raw, key) from exc
    raise _bad_identity(raw, key)


def _bad_identity(raw: Any, key: str) -> AFDProtocolError:
    return AFDProtocolError(f"P2pNcclAFDConnector: store record {key} is {raw!r:.80}; expected hostname/GPU-UUID as "
                            f"UTF-8 text of at most {MAX_IDENTITY_BYTES} bytes. Keep the store port private")
