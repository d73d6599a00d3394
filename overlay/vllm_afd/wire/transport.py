"""The transport interface: what a backend implements so that ``AFDConnector`` can run over it.

A transport moves whole contiguous tensors between group ranks of three channels (``a2f``,
``f2a``, ``ctrl``; ``Placement.channels()`` says which groups a rank joins and in which order).
Everything else — rendezvous, handshake, step state, row checks, exchange order, liveness — is the
connector's, so a transport is one file: ``transports/gloo.py``, ``transports/nccl.py``.

Data sends are issued with ``isend``, which never waits for the peer: both gloo and NCCL are
rendezvous transports (a send completes only once the peer posted its receive), so with more than
one micro-batch stage a blocking send deadlocks (docs/pingpong.md#5-ordering-why-the-receives-cannot-deadlock).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

import torch

from vllm_afd.wire.placement import Placement

__all__ = ["DONE", "Deferred", "RecvHandle", "SendHandle", "Transport"]


class SendHandle(Protocol):
    """An issued send; ``wait()`` returns once the sent tensor may be reused (raises what the send raised)."""

    def wait(self) -> None: ...


class _Done:
    """The handle of a send that completed when it was issued (in-memory or stream-ordered transports)."""

    def wait(self) -> None:
        return None


# The shared completed handle.
DONE: SendHandle = _Done()


class RecvHandle(Protocol):
    """A posted receive; ``wait()`` returns the received tensor (raises what the receive raised)."""

    def wait(self) -> torch.Tensor: ...


class Deferred:
    """A receive that runs when waited: what ``post``/``post_rows`` return on a transport that does not pre-post."""

    def __init__(self, receive: Any, *args: Any) -> None:
        self._receive, self._args = receive, args

    def wait(self) -> torch.Tensor:
        return self._receive(*self._args)


class Transport(ABC):
    """Moves whole contiguous tensors on the three channels; ranks are group ranks.

    Contract:
      1. Construction takes no resources; ``open`` creates the groups of ``placement.channels()``
         in that order on prefixes of the rendezvous store, bounded by ``timeout_s``.
      2. ``send``/``recv`` move one tensor each, any dtype; ``recv`` fills the given tensor. The
         ``ctrl`` channel's tensors are CPU tensors, so the control plane never waits for a GPU.
         ``recv_rows`` receives a data message of ``rows`` rows into the head of a buffer of the
         message's agreed maximum; with ``bounded_receives`` it posts the whole buffer (see there).
         ``isend`` issues a data send without waiting for the peer and returns its ``SendHandle``;
         the caller keeps the tensor unchanged until ``wait()`` returned. Sends and receives of one
         (channel, peer) pair are matched in issue order. ``post``/``post_rows`` issue a data receive
         and return its ``RecvHandle``; where ``preposts(device)`` it is posted at once (the caller keeps
         the tensor for it until ``wait()`` returned or ``close`` returned), otherwise it runs when waited,
         and the ends post nothing ahead.
      3. ``abort`` may run on any thread and makes pending transfers fail where the backend allows;
         ``close`` releases everything, is idempotent and bounded.
    """

    # Host synchronisations the transport made since it was built (a blocking device copy, an event
    # wait); the connector's timeline counts them per step. Stream-ordered transports keep 0.
    host_syncs: int = 0
    # Bound in seconds on a host-side wait for one data transfer or control send, or None (unbounded);
    # set by the connector once step timeouts are armed. A wait past it fails the transfer, which is how
    # a rank blocked on a stuck peer is released (an abort cannot interrupt a blocked receive of its own
    # process). Control receives stay unbounded: the FFN may wait idle for the next step.
    transfer_timeout_s: float | None = None
    # Whether ``recv_rows`` posts its whole buffer, so a longer data message than published (up to the buffer)
    # is read and ignored past the published rows. The ends then pass buffers of the agreed maximum
    # (max_rows rows, docs/protocol.md#bounds), reused; otherwise buffers of exactly the published rows.
    # NOTE: for backends that end the process on a message longer than the posted receive (gloo).
    bounded_receives: bool = False
    # Whether ``post``/``post_rows`` post the receive at once, so the ends post a data message's receive one exchange
    # ahead of its wait (docs/protocol.md#receive-order). For rendezvous transports whose sender writes a message
    # whose receive is not posted yet from another thread (gloo's loop thread), late by a context switch.
    prepost_receives: bool = False

    @abstractmethod
    def open(self, store: Any, placement: Placement, timeout_s: float) -> None:
        """Create a2f, then f2a, then the control group if ``placement.control_rank`` is set."""

    @abstractmethod
    def send(self, channel: str, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to group rank ``dst``."""

    @abstractmethod
    def isend(self, channel: str, tensor: torch.Tensor, dst: int) -> SendHandle:
        """Issue a send of ``tensor`` to group rank ``dst`` without waiting for the peer."""

    @abstractmethod
    def recv(self, channel: str, tensor: torch.Tensor, src: int) -> None:
        """Fill ``tensor`` from group rank ``src``."""

    def recv_rows(self, channel: str, buffer: torch.Tensor, rows: int, src: int) -> torch.Tensor:
        """Receive a message of ``rows`` rows from group rank ``src`` into the head of ``buffer`` (contiguous,
        ``[capacity, width]``, ``rows <= capacity``) and return that head, ``buffer[:rows]`` (contiguous).
        A bounded transport posts the whole buffer; this default receives exactly the head."""
        head = buffer[:rows]
        self.recv(channel, head, src)
        return head

    def post(self, channel: str, tensor: torch.Tensor, src: int) -> RecvHandle:
        """Issue a receive into ``tensor`` from group rank ``src``; its handle's ``wait()`` returns ``tensor`` once
        filled. This default receives when waited."""
        return Deferred(self._recv_into, channel, tensor, src)

    def post_rows(self, channel: str, buffer: torch.Tensor, rows: int, src: int) -> RecvHandle:
        """Issue ``recv_rows``; its handle's ``wait()`` returns ``buffer[:rows]``. This default receives when waited."""
        return Deferred(self.recv_rows, channel, buffer, rows, src)

    def preposts(self, device: torch.device) -> bool:
        """Whether ``post``/``post_rows`` post a receive into a tensor on ``device`` at once (the ends then post the
        next exchange's receives ahead, docs/protocol.md#receive-order); this default: ``prepost_receives``."""
        return self.prepost_receives

    def _recv_into(self, channel: str, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self.recv(channel, tensor, src)
        return tensor

    @abstractmethod
    def abort(self) -> None:
        """Best effort, from any thread: make pending transfers fail where the backend allows."""

    @abstractmethod
    def close(self) -> None:
        """Release the channels; idempotent, bounded."""
