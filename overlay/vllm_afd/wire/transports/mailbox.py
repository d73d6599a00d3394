"""The control channel through shared memory: one mailbox per control pair (attention k -> FFN k).

Used by ``P2pIpcAFDConnector`` (ipc.py), whose ranks share a host. Over a gloo group, a step's control
payload took 0.5-0.7 ms from the attention's publish to the FFN's adopt on the H200 machine (run 7 of
evidence/gpu-log.md): two TCP messages, each waking a thread blocked in the kernel. That latency sits
on every step's critical path (the FFN launches its step only once it knows the step), so here the
attention writes the payload into a page of ``/dev/shm`` and the FFN's loop thread, which has nothing
else to do, polls it.

Page: a 64-byte header holding ``read_seq`` (u64: messages the FFN consumed), then ``SLOTS`` message
slots, each ``[seq u64][nbytes u32][crc32 u32][payload]``. The writer fills message n (from 1) into
slot ``(n - 1) % SLOTS`` once ``n - read_seq <= SLOTS``, payload first and ``seq = n`` last; the reader
takes message n when its slot's ``seq == n`` and the payload's CRC matches (a slot read while it is
being written fails the CRC and is read again, whatever order the CPU makes the stores visible in),
then publishes ``read_seq = n``.

Waiting: a receive polls with ``time.sleep(0)`` (a yield: other threads and processes run) for up to
``spin_s`` after the last message, then every ``poll_s``, so a stream of steps is picked up within
microseconds and an idle FFN costs no core. ``abort()`` makes every wait raise at its next poll;
``close()`` unmaps under the lock the polls take. The page is unlinked once both ends mapped it. The
page's record in the store is checked before the page is opened (``records.parse_mailbox``).
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
import zlib
from typing import Any, Callable

import torch

from vllm_afd.role import Role
from vllm_afd.wire.placement import CONTROL, Placement
from vllm_afd.wire.transport import SendHandle, Transport
from vllm_afd.wire.transports.records import parse_mailbox
from vllm_afd.wire.transports.shm import FlagBlock

__all__ = ["MailboxTransport"]

NAME = "P2pIpcAFDConnector"
HEADER_BYTES = 64
SLOT_HEADER = struct.Struct("<QII")  # seq, nbytes, crc32
SLOTS = 8  # messages in flight: a payload is two messages, async scheduling publishes a step ahead
SLOT_BYTES = 64 << 10  # largest message; a control body is well under 1 KiB per stage
SPIN_S = 0.05
POLL_S = 0.0005


class MailboxTransport(Transport):
    """The ``ctrl`` channel of one control pair in a shared page; see the module docstring."""

    def __init__(self, *, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES, spin_s: float = SPIN_S,
                 poll_s: float = POLL_S) -> None:
        self.slots, self.slot_bytes, self.spin_s, self.poll_s = slots, slot_bytes, spin_s, poll_s
        self._lock = threading.Lock()
        self._page: FlagBlock | None = None
        self._view: memoryview | None = None
        self._aborted = False
        self._closed = False
        self._written = 0  # messages this writer sent
        self._read = 0  # messages this reader took
        self._last_message = 0.0  # monotonic time of the last message taken (spin window)

    # ---- lifecycle --------------------------------------------------------------------------------

    def open(self, store: Any, placement: Placement, timeout_s: float) -> None:
        if placement.control_rank is None:
            return  # attention ranks >= F publish nothing
        key = f"afd/mailbox/{placement.role_rank}"
        wait = lambda keys: store.wait(keys, _timedelta(timeout_s))  # noqa: E731
        page_bytes = HEADER_BYTES + self.slots * (SLOT_HEADER.size + self.slot_bytes)
        if placement.role == Role.FFN:
            page = FlagBlock.create(page_bytes)
            try:
                self._attach(page)
                store.set(key, json.dumps({"name": page.name, "host": socket.gethostname(), "slots": self.slots,
                                           "slot_bytes": self.slot_bytes}))
                wait([f"{key}/attached"])
            finally:
                page.unlink()  # both ends mapped it (or never will): nothing is left behind in /dev/shm
            return
        wait([key])
        record = parse_mailbox(store.get(key), key)  # checked before anything is opened
        if record["host"] != socket.gethostname():
            raise RuntimeError(
                f"{NAME}: attention rank {placement.role_rank} is on {socket.gethostname()} but its control peer, "
                f"FFN rank {placement.role_rank}, on {record['host']}; the control mailbox is shared memory of one "
                "host. Run the control pairs on one host, or use P2pNcclAFDConnector across hosts"
            )
        if (record["slots"], record["slot_bytes"]) != (self.slots, self.slot_bytes):
            raise RuntimeError(
                f"{NAME}: the FFN's control mailbox has {record['slots']} slots of {record['slot_bytes']} bytes, this "
                f"rank expects {self.slots} of {self.slot_bytes}; run the same vllm_afd version on both roles"
            )
        self._attach(FlagBlock.attach(record["name"], page_bytes))
        store.set(f"{key}/attached", "1")

    def _attach(self, page: FlagBlock) -> None:
        with self._lock:
            self._page, self._view = page, page.bytes_view()

    def abort(self) -> None:
        self._aborted = True

    def close(self) -> None:
        self._aborted = True
        with self._lock:
            self._closed = True
            view, page, self._view, self._page = self._view, self._page, None, None
            if view is not None:
                view.release()
            if page is not None:
                page.close()

    # ---- messages ---------------------------------------------------------------------------------

    def send(self, channel: str, tensor: torch.Tensor, dst: int) -> None:
        self._require_control(channel)
        payload = _bytes_of(tensor)
        if len(payload) > self.slot_bytes:
            raise ValueError(
                f"{NAME}: a control message of {len(payload)} bytes does not fit the mailbox's {self.slot_bytes}-byte "
                "slots; expected a control payload of a few hundred bytes per stage"
            )
        number = self._written + 1
        self._wait(lambda view: number - _read_seq(view) <= self.slots, "control send: the FFN's mailbox is full")
        with self._lock:
            view = self._live_view("control send")
            offset = self._slot_offset(number)
            body = offset + SLOT_HEADER.size
            view[body:body + len(payload)] = payload
            struct.pack_into("<II", view, offset + 8, len(payload), zlib.crc32(payload))
            struct.pack_into("<Q", view, offset, number)  # last: the message is complete
        self._written = number

    def isend(self, channel: str, tensor: torch.Tensor, dst: int) -> SendHandle:
        raise ValueError(f"{NAME}: isend({channel!r}): the mailbox carries only the {CONTROL!r} channel, whose "
                         "sends are plain send()s; data channels belong to the IPC slots")

    def recv(self, channel: str, tensor: torch.Tensor, src: int) -> None:
        self._require_control(channel)
        number = self._read + 1
        offset = self._slot_offset(number)
        received: list[bytes] = []

        def arrived(view: memoryview) -> bool:
            seq, nbytes, crc = SLOT_HEADER.unpack_from(view, offset)
            if seq != number or nbytes > self.slot_bytes:
                return False
            payload = bytes(view[offset + SLOT_HEADER.size:offset + SLOT_HEADER.size + nbytes])
            if zlib.crc32(payload) != crc:
                return False  # read while being written: read again
            received.append(payload)
            return True

        self._wait(arrived, "control receive: waiting for the attention's next step")
        payload = received[0]
        expected = tensor.numel() * tensor.element_size()
        if len(payload) != expected:
            raise RuntimeError(
                f"{NAME}: control message {number} has {len(payload)} bytes, the receive expects {expected}; "
                "the two ends disagree on the control framing. Run the same vllm_afd version on both roles"
            )
        if payload:
            tensor.view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        with self._lock:
            struct.pack_into("<Q", self._live_view("control receive"), 0, number)
        self._read = number
        self._last_message = time.monotonic()

    # ---- helpers ----------------------------------------------------------------------------------

    def _wait(self, ready: Callable[[memoryview], bool], what: str) -> None:
        """Poll ``ready`` on the page until it holds; raise once aborted or closed."""
        while True:
            with self._lock:
                if self._aborted or self._closed:
                    raise RuntimeError(f"{NAME}: {what}: the connector aborted or closed the mailbox")
                if ready(self._live_view(what)):
                    return
            time.sleep(0 if time.monotonic() - self._last_message < self.spin_s else self.poll_s)

    def _live_view(self, what: str) -> memoryview:
        if self._view is None:
            raise RuntimeError(f"{NAME}: {what}: the control mailbox is not open; expected AFDConnector.init() "
                               "first (attention ranks >= num_ffn_ranks have no mailbox)")
        return self._view

    def _slot_offset(self, number: int) -> int:
        return HEADER_BYTES + ((number - 1) % self.slots) * (SLOT_HEADER.size + self.slot_bytes)

    @staticmethod
    def _require_control(channel: str) -> None:
        if channel != CONTROL:
            raise ValueError(f"{NAME}: the mailbox carries the {CONTROL!r} channel only, got {channel!r}")


def _read_seq(view: memoryview) -> int:
    return struct.unpack_from("<Q", view, 0)[0]


def _bytes_of(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _timedelta(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=max(seconds, 0.1))
