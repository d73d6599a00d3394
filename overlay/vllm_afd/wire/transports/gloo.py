"""The gloo transport (connector name ``P2pGlooAFDConnector``): groups on prefixes of the AFD store.

Every tensor crosses as a ``uint8`` view of a contiguous CPU tensor, so gloo's dtype support does not
matter (bf16 included); CUDA tensors are staged through pinned host buffers: a send waits for its
device-to-host copy (one host synchronisation), a receive's host-to-device copy is left in flight on the
caller's stream (its staging buffer is reused only after that copy's event passed). ``isend`` returns
the ``Work`` of ``ProcessGroupGloo.send`` (gloo's TCP pair sends once the peer posted its receive, so
the caller must not wait for it before its own receives); a CUDA tensor's pinned staging buffer is
held by the handle until it is waited. Host-synchronous,
hence eager only: the CPU path and both roles on one GPU. A dead peer closes its TCP connections, so
a receive from it fails at once; the watchdog reports a peer that hangs, and ``transfer_timeout_s``
(the step timeout plus a margin, once armed) releases a wait on it. gloo cannot interrupt a blocked
receive of its own process (neither ``abort()`` nor ``shutdown()`` does, torch 2.13): ``close()`` drops
the groups, which fails the peers' pending transfers at once, and a local blocked data transfer ends
at its native timeout.

gloo ends the process (``std::terminate`` from its device thread) when a message is longer than the receive
posted for it, and accepts a shorter one silently. So a control receive is posted with the control channel's
largest message (``CONTROL_CAPACITY``, through a reusable scratch whose head is zeroed first) and only the
bytes asked for are copied out: a lying control peer is read and refused by the connector's checks
(docs/security.md#what-is-validated), never a native abort. Data receives come through ``recv_rows``
(``bounded_receives``): posted at the whole buffer the end passes, the message's agreed maximum (the
attention's ``max_rows`` rows, docs/protocol.md#bounds), whose first published rows are the message; more rows
than published are read and ignored. Only a message longer than that maximum (or a control message over
``CONTROL_CAPACITY``, or a seal over its 64 bytes) still ends the process.

A message sent before its receive is posted waits for the receiver's notice, then leaves from the sender's gloo
loop thread: one more trip and a wake-up on the sender's core, which may be computing (on a busy core,
milliseconds). So ``post``/``post_rows`` (``prepost_receives``) post a CPU data receive at once, and the ends post
each exchange's receives before the peer sends
(docs/protocol.md#receive-order); ``abort()`` and ``close()`` drop a receive posted and never waited, after its
groups, so that the pairs close.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

from vllm_afd.wire.placement import CONTROL, Placement
from vllm_afd.wire.transport import RecvHandle, SendHandle, Transport

__all__ = ["CONTROL_CAPACITY", "GlooRecv", "GlooSend", "GlooTransport"]

# Every control receive is posted this large: the control frame's largest body (messages.MAX_CONTROL_BYTES).
CONTROL_CAPACITY = 1 << 20

# Native timeout of a gloo wait with no bound: a control receive (the FFN's wait for the next payload
# is legally unbounded), and every wait before step timeouts are armed (start-up may compile for long).
# NOTE: passed to every ``wait()``: without it gloo uses the group's creation timeout (the rest of the
# rendezvous), and ``set_timeout`` does not change that for pending sends and receives (torch 2.13).
GLOO_OP_TIMEOUT = datetime.timedelta(days=365)


def _gloo_options(store: Any, timeout: datetime.timedelta) -> tuple[Any, str]:
    """Gloo options whose device binds the local address that routes to the AFD store's host, and
    that address ("GLOO_SOCKET_IFNAME=<name>" when the operator chose the interface).

    NOTE: without a device torch binds the address this machine's hostname resolves to, which is
    loopback in most containers (127.0.0.1) and on Debian-style hosts (127.0.1.1): with the roles on
    two hosts every rank would publish a loopback address (docs/connection.md#roles-on-different-hosts).
    The route to the store's host is the route to the other role. ``_Options``/``_devices`` are the
    fields torch's own ``new_group`` fills; GLOO_SOCKET_IFNAME, when set, still wins.
    """
    import os
    import socket

    from torch.distributed import ProcessGroupGloo

    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    # NOTE: torch's own new_group fills these private fields; there is no public constructor for them.
    options = ProcessGroupGloo._Options()  # noqa: SLF001
    options._timeout = timeout  # noqa: SLF001
    if interface:
        options._devices = [ProcessGroupGloo.create_device(interface=interface.split(",")[0])]  # noqa: SLF001
        return options, f"GLOO_SOCKET_IFNAME={interface}"
    family, kind, proto, _, address = socket.getaddrinfo(store.host, store.port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.connect(address)  # a UDP connect picks the route and its source address; nothing is sent
        local = probe.getsockname()[0]
    options._devices = [ProcessGroupGloo.create_device(hostname=local)]  # noqa: SLF001
    return options, local


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The uint8 view of a contiguous CPU tensor (gloo moves bytes; bf16 and fp8 included)."""
    return tensor.reshape(-1).view(torch.uint8)


def _op_timeout(timeout_s: float | None) -> datetime.timedelta:
    """The native timeout of one wait: ``transfer_timeout_s`` when set, else effectively none."""
    return GLOO_OP_TIMEOUT if timeout_s is None else datetime.timedelta(seconds=timeout_s)


class GlooSend:
    """A pending gloo send: its ``Work``, the bytes it reads, and what to do once they are free."""

    def __init__(self, work: Any, data: torch.Tensor, release: Any = None, timeout_s: float | None = None) -> None:
        self._work, self._data, self._release, self._timeout_s = work, data, release, timeout_s

    def wait(self) -> None:
        if self._work is None:
            return
        work, self._work = self._work, None
        try:
            work.wait(_op_timeout(self._timeout_s))
        finally:
            work = None  # NOTE: as GlooRecv.wait: a failed wait's traceback must not keep the Work (and the store)
            if self._release is not None:
                self._release(self._data)  # a staging buffer goes back to its free list
            self._data = None


class GlooRecv:
    """A posted gloo receive of a CPU tensor: its ``Work`` and what ``wait()`` returns once it is filled."""

    def __init__(self, transport: GlooTransport, work: Any, result: torch.Tensor) -> None:
        self._transport, self._work, self._result = transport, work, result
        self._dropped = False

    def wait(self) -> torch.Tensor:
        work, self._work = self._work, None
        if work is None:
            if self._dropped:
                raise RuntimeError("P2pGlooAFDConnector: a receive posted ahead was dropped by the transport's abort() "
                                   "or close() before it was waited; its pairing is gone")
            return self._result
        try:
            # NOTE: the bound in force when waited (the step's), not when posted.
            work.wait(_op_timeout(self._transport.transfer_timeout_s))
        finally:
            # NOTE: a failed wait's traceback keeps this frame, and a live Work keeps its gloo context, with its pairs
            # and the store, until the traceback goes: a re-forming FFN rank 0 could not host the store again.
            work = None
            self._transport._posted.discard(self)  # noqa: SLF001
        return self._result

    def drop(self) -> None:
        """Let go of the ``Work`` (a later ``wait()`` raises): while one lives, its group's pairs and store do."""
        self._dropped = True
        self._work = None


class GlooTransport(Transport):
    """Three gloo groups (a2f, f2a, ctrl) built directly on ``PrefixStore``s of the AFD store.

    NOTE: ``ProcessGroupGloo`` objects are built without ``init_process_group``: they never become
    torch's default group and never enter its global rank maps, which vLLM owns.
    """

    # recv_rows posts the whole buffer: a data message longer than published is read, not a native abort.
    bounded_receives = True
    # post/post_rows post a CPU receive at once (a CUDA one runs when waited: its host staging is shared): a
    # message whose receive is posted leaves from the sender's own thread. Instances may turn it off (benches).
    prepost_receives = True

    def __init__(self, device: torch.device, channels: tuple[str, ...] | None = None) -> None:
        self.device = device
        # Receives posted and not waited yet; abort() and close() drop them, after the groups.
        self._posted: set[GlooRecv] = set()
        # The channels to open (None: all of placement.channels()); the IPC transport keeps only ctrl here.
        self.channels = channels
        self._groups: dict[str, Any] = {}
        # Pinned host staging for CUDA tensors, per direction and size in bytes, with the event of the
        # last copy that read or wrote it (a buffer is reused only after that copy finished).
        self._staging: dict[tuple[str, int], tuple[torch.Tensor, Any]] = {}
        # Pinned host buffers of issued CUDA sends that were waited, free for the next isend, by size in bytes.
        self._free_sends: dict[int, list[torch.Tensor]] = {}
        # Host synchronisations this transport made, for the connector's timeline.
        self.host_syncs = 0
        # The scratch every control receive is posted into (CONTROL_CAPACITY bytes), made on first use.
        self._control_scratch: torch.Tensor | None = None

    def open(self, store: Any, placement: Placement, timeout_s: float) -> None:
        from torch.distributed import PrefixStore, ProcessGroupGloo

        timeout = datetime.timedelta(seconds=timeout_s)
        options, local = _gloo_options(store, timeout)
        for name, prefix, rank, size in placement.channels():
            if self.channels is not None and name not in self.channels:
                continue
            # Creation is bounded by what is left of the rendezvous; traffic by GLOO_OP_TIMEOUT.
            try:
                self._groups[name] = ProcessGroupGloo(PrefixStore(prefix, store), rank, size, options)
            except RuntimeError as exc:
                if "connectFullMesh" not in str(exc):
                    raise
                raise RuntimeError(
                    f"P2pGlooAFDConnector: the {name} group of {placement.label} could not connect its gloo "
                    f"pairs ({exc}); this rank published {local}. Every rank must reach the others' published "
                    "addresses: set GLOO_SOCKET_IFNAME to the interface that reaches the other role on every "
                    "rank (docs/connection.md#roles-on-different-hosts)"
                ) from exc

    def send(self, channel: str, tensor: torch.Tensor, dst: int) -> None:
        if tensor.device.type == "cpu":
            host = tensor.contiguous()
        else:
            host = self._staging_for("send", tensor)
            host.copy_(tensor, non_blocking=True)
            self._record_copy("send", host).synchronize()  # gloo reads the bytes from the host
            self.host_syncs += 1
        self._group(channel).send([_bytes(host)], dst, 0).wait(_op_timeout(self.transfer_timeout_s))

    def isend(self, channel: str, tensor: torch.Tensor, dst: int) -> SendHandle:
        if tensor.device.type == "cpu":
            host = tensor.contiguous()
            return GlooSend(self._group(channel).send([_bytes(host)], dst, 0), host, timeout_s=self.transfer_timeout_s)
        # NOTE: a pending send owns its staging buffer until waited: two stages of one size may be in flight.
        nbytes = tensor.numel() * tensor.element_size()
        free = self._free_sends.setdefault(nbytes, [])
        host = free.pop() if free else torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        host.view(tensor.dtype).view(tensor.shape).copy_(tensor, non_blocking=True)
        torch.cuda.current_stream().synchronize()  # gloo reads the bytes from the host
        self.host_syncs += 1
        return GlooSend(self._group(channel).send([host], dst, 0), host, free.append, self.transfer_timeout_s)

    def recv(self, channel: str, tensor: torch.Tensor, src: int) -> None:
        # NOTE: a timed-out gloo wait closes its pair, so the channel is lost: fine once the step is late.
        if channel == CONTROL:
            self._recv_control(tensor, src)
            return
        timeout = _op_timeout(self.transfer_timeout_s)
        if tensor.device.type == "cpu" and tensor.is_contiguous():
            self._group(channel).recv([_bytes(tensor)], src, 0).wait(timeout)
            return
        staging = self._staging_for("recv", tensor)
        self._group(channel).recv([_bytes(staging)], src, 0).wait(timeout)
        tensor.copy_(staging, non_blocking=tensor.device.type == "cuda")
        if tensor.device.type == "cuda":
            self._record_copy("recv", staging)

    def recv_rows(self, channel: str, buffer: torch.Tensor, rows: int, src: int) -> torch.Tensor:
        """Post the whole of ``buffer`` (the message's agreed maximum) and return its first ``rows`` rows: a longer
        message up to the buffer is read and ignored past them, never a native abort. A CPU buffer is received
        into directly (no copy); a CUDA one through its host staging, of which only the head is copied over."""
        assert buffer.is_contiguous() and 0 <= rows <= buffer.shape[0], "recv_rows takes a contiguous buffer of >= rows"
        head = buffer[:rows]
        timeout = _op_timeout(self.transfer_timeout_s)
        if buffer.device.type == "cpu":
            self._group(channel).recv([_bytes(buffer)], src, 0).wait(timeout)
            return head
        staging = self._staging_for("recv", buffer)
        self._group(channel).recv([_bytes(staging)], src, 0).wait(timeout)
        head.copy_(staging[:rows], non_blocking=True)
        self._record_copy("recv", staging)
        return head

    def preposts(self, device: torch.device) -> bool:
        """CPU only: a CUDA receive goes through host staging shared by its size, so it runs when waited."""
        return self.prepost_receives and device.type == "cpu"

    def post(self, channel: str, tensor: torch.Tensor, src: int) -> RecvHandle:
        if not self.preposts(tensor.device) or not tensor.is_contiguous() or channel == CONTROL:
            return super().post(channel, tensor, src)
        return self._post(channel, tensor, tensor, src)

    def post_rows(self, channel: str, buffer: torch.Tensor, rows: int, src: int) -> RecvHandle:
        """``recv_rows`` posted now: the whole of a CPU ``buffer``, whose head ``buffer[:rows]`` the handle returns."""
        if not self.preposts(buffer.device):
            return super().post_rows(channel, buffer, rows, src)
        assert buffer.is_contiguous() and 0 <= rows <= buffer.shape[0], "recv_rows takes a contiguous buffer of >= rows"
        return self._post(channel, buffer, buffer[:rows], src)

    def _post(self, channel: str, posted: torch.Tensor, result: torch.Tensor, src: int) -> GlooRecv:
        handle = GlooRecv(self, self._group(channel).recv([_bytes(posted)], src, 0), result)
        self._posted.add(handle)
        return handle

    def _recv_control(self, tensor: torch.Tensor, src: int) -> None:
        """A control receive posted at ``CONTROL_CAPACITY``: a longer or shorter message than ``tensor`` is read,
        never a native abort; ``tensor`` gets its first bytes, zeros where the message was shorter."""
        nbytes = tensor.numel() * tensor.element_size()
        assert tensor.device.type == "cpu" and tensor.is_contiguous() and nbytes <= CONTROL_CAPACITY, \
            "control tensors are small contiguous CPU tensors"
        if self._control_scratch is None:
            self._control_scratch = torch.empty(CONTROL_CAPACITY, dtype=torch.uint8)
        scratch = self._control_scratch
        scratch[:nbytes].zero_()
        self._group(CONTROL).recv([scratch], src, 0).wait(GLOO_OP_TIMEOUT)
        tensor.reshape(-1).view(torch.uint8).copy_(scratch[:nbytes])

    def abort(self) -> None:
        groups, self._groups = self._groups, {}
        for group in groups.values():
            group.abort()
        self._drop_posted()

    def close(self) -> None:
        # NOTE: dropping the groups closes their TCP pairs, so peers blocked on us fail at once, and
        # releases the store (FFN rank 0's server stops). A receive still blocked in this process keeps
        # what it uses alive and returns when its peer goes away (gloo cannot interrupt it).
        groups, self._groups = self._groups, {}
        for group in groups.values():
            group.shutdown()
        self._drop_posted()

    def _drop_posted(self) -> None:
        """Let go of the receives posted and never waited (a step cut short), after their groups: while one holds its
        ``Work``, the group's pairs stay open and the peer would not see this end go (docs/protocol.md#receive-order).
        A message arriving for a dropped receive is not read (gloo holds a weak reference to its buffer)."""
        posted, self._posted = self._posted, set()
        for handle in posted:
            handle.drop()

    def _group(self, channel: str) -> Any:
        try:
            return self._groups[channel]
        except KeyError:
            raise RuntimeError(
                f"P2pGlooAFDConnector: the AFD {channel} group is missing (groups: {sorted(self._groups)}); "
                "expected AFDConnector.init() to have created it. Only attention ranks < "
                "num_ffn_ranks and FFN ranks join the control group"
            ) from None

    def _staging_for(self, direction: str, tensor: torch.Tensor) -> torch.Tensor:
        """The host buffer for ``tensor``'s bytes, once the last copy through it has finished."""
        nbytes = tensor.numel() * tensor.element_size()
        buffer, event = self._staging.get((direction, nbytes), (None, None))
        if buffer is None:
            pinned = tensor.device.type == "cuda"
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            self._staging[(direction, nbytes)] = (buffer, None)
        elif event is not None and not event.query():
            event.synchronize()  # rare: the previous receive's copy of this size is still running
            self.host_syncs += 1
        return buffer.view(tensor.dtype).view(tensor.shape)

    def _record_copy(self, direction: str, staging: torch.Tensor) -> Any:
        """Record the event of the copy just enqueued through ``staging`` (on the current stream)."""
        event = torch.cuda.Event()
        event.record()
        nbytes = staging.numel() * staging.element_size()
        buffer, _ = self._staging[(direction, nbytes)]
        self._staging[(direction, nbytes)] = (buffer, event)
        return event
