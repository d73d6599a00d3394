"""The CUDA IPC transport (connector name ``P2pIpcAFDConnector``): host-free, SM-free, capturable.

For the ranks of one node: both roles on one GPU, or on GPUs of one host with peer access. Data
moves by copies into memory the peer owns, and readiness by 32-bit flags the GPU itself writes and
waits on (stream memory operations), so a layer's exchange needs no host round trip and no kernel,
and a CUDA graph records it like any other stream work.

Memory. Every receiver owns one device allocation holding its receive *slots*; the plan and the
flag protocol are ``slots.py``. Allocations are exported with CUDA IPC at ``open`` and mapped by
their senders. Each slot's ready flag is a 32-bit word in one page of host shared memory
(``/dev/shm``, ``shm.py``) that the data subgroup maps and registers for the device: a flag in host
memory can be released by a plain CPU store, which no GPU queue blocked on a wait can hold up
(docs/decisions.md#20-a-capturable-one-node-transport-p2pipcafdconnector). Sends never wait (a copy
and a flag write), so ``isend`` enqueues them on the current stream and returns a completed handle.

Store. What the members publish at ``open`` (``records.py``) is parsed and checked before use: sizes
against this rank's own and against bounds, names against the flag page's pattern. A sender also asks
the driver how large the allocation it mapped is, and refuses one smaller than its plan, so no
record, forged or stale, can make it write past a peer's slots.

Failure. ``abort()`` stores ABORT into every flag this rank waits on and keeps storing it until
``close()``: a released receive resets its flag to EMPTY, and a later wait on the same slot (the next
layer, the rest of a replayed graph) must find ABORT again. The data is garbage from then on; the
connector raises its sticky failure at its next call, as with gloo. ``close()`` releases the waits as
well, lets the device drain, then frees everything. Refused with the fix before any resource is
taken: a CPU device, a data-subgroup member on another host (P2pNcclAFDConnector), in the same
process, without stream memory operations V2, or on a GPU without peer access. The control channel
is host data, never inside a graph: a shared-memory mailbox per control pair (mailbox.py), which the
FFN's loop polls.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from vllm_afd.role import Role
from vllm_afd.wire.errors import AFDProtocolError
from vllm_afd.wire.placement import CONTROL, Placement
from vllm_afd.wire.transport import DONE, SendHandle, Transport
from vllm_afd.wire.transports.cuda_driver import CudaDriver, Op, warn_without_mps
from vllm_afd.wire.transports.mailbox import MailboxTransport
from vllm_afd.wire.transports.records import (
    check_members, exchange_access, exchange_mem, exchange_who, gather, ranks_sharing_gpu,
)
from vllm_afd.wire.transports.shm import FlagBlock
from vllm_afd.wire.transports.slots import (
    ABORT, FLAG_STRIDE, Slot, check_sizes, message_row_bytes, plan_slots, receiver_bytes, recv_ops, send_ops,
)

__all__ = ["IpcTransport", "message_row_bytes"]

logger = logging.getLogger(__name__)

NAME = "P2pIpcAFDConnector"
HOLD_PERIOD_S = 0.001  # after abort(), how often the flags this rank waits on are set to ABORT again
HOLD_JOIN_S = 1.0


class _Route(NamedTuple):
    slot: Slot
    pointer: int  # device address of the slot (own allocation, or the peer's mapped one)
    flag_pointer: int  # device address of its flag


class IpcTransport(Transport):
    """Slots in peer-visible device memory, flags in shared host memory; see the module docstring."""

    def __init__(self, device: torch.device, *, row_bytes: Mapping[str, Sequence[int]], max_rows: int,
                 num_stages: int = 1, driver: Any = None, control: Transport | None = None,
                 hold_period_s: float = HOLD_PERIOD_S) -> None:
        self.device = device
        self._driver = driver if driver is not None else CudaDriver(device)
        self._driver.check_device()
        check_sizes(row_bytes, max_rows, num_stages)
        self.row_bytes = {channel: tuple(widths) for channel, widths in row_bytes.items()}
        self.num_stages = num_stages
        self.max_rows = max_rows
        self._control = control if control is not None else MailboxTransport()
        self._hold_period_s = hold_period_s
        self._lock = threading.Lock()  # guards the flag page against a concurrent unmap
        self._stop = threading.Event()
        self._holder: threading.Thread | None = None
        self._closed = False
        self._used = False
        self._flags: FlagBlock | None = None
        self._flags_pointer: int | None = None
        self._region: int | None = None
        self._mapped: dict[int, int] = {}  # group rank -> its slot allocation, mapped here
        # ("send" | "recv", channel, peer group rank) -> routes by message position, and the next position.
        self._routes: dict[tuple[str, str, int], tuple[_Route, ...]] = {}
        self._positions: dict[tuple[str, str, int], int] = {}
        self._wait_flags: tuple[int, ...] = ()

    # ---- open -----------------------------------------------------------------------------------

    def open(self, store: Any, placement: Placement, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        driver, own, members = self._driver, placement.afd_rank, placement.subgroup_members
        prefix = f"afd/ipc/{placement.subgroup}"
        problem = driver.missing_capability()
        if problem is not None:  # published first, so that the peers refuse at once too
            store.set(f"{prefix}/who/{own}", json.dumps({"problem": problem}))
            check_members({own: {"problem": problem}}, own)
        driver.bind()
        record = {**driver.identity(), "max_rows": self.max_rows, "num_stages": self.num_stages, "problem": None,
                  "row_bytes": {channel: list(widths) for channel, widths in sorted(self.row_bytes.items())}}
        records = exchange_who(store, prefix, own, record, members, deadline)
        check_members(records, own)
        warn_without_mps(own, ranks_sharing_gpu(records, own))
        # Peer access is checked by the writer; the verdicts are exchanged, so every rank refuses before it allocates.
        verdict = next((f"AFD rank {own} cannot write into AFD rank {rank}'s GPU memory: {issue}"
                        for rank in (members[1:] if placement.role == Role.FFN else members[:1])
                        if (issue := driver.peer_problem(records[rank]["gpu"])) is not None), None)
        verdict = exchange_access(store, prefix, own, verdict, members, deadline)
        if verdict is not None:
            raise RuntimeError(f"{NAME}: {verdict}. Use P2pNcclAFDConnector")
        plan = plan_slots(self.row_bytes, {g: records[members[g]]["max_rows"] for g in range(1, len(members))},
                          self.num_stages)
        try:
            self._take(store, prefix, plan, members, placement.subgroup_rank, deadline)
            self._control.open(store, placement, max(deadline - time.monotonic(), 0.1))
        except BaseException:
            self._free()
            raise

    def _take(self, store: Any, prefix: str, plan: tuple[Slot, ...], members: Sequence[int], group: int,
              deadline: float) -> None:
        """Resources, from here on: flag page, own slot allocation, the peers' allocations, routes."""
        driver, own = self._driver, members[group]
        flag_bytes = len(plan) * FLAG_STRIDE * 4
        if group == 0:
            self._flags = FlagBlock.create(flag_bytes)
        sizes = [receiver_bytes(plan, g) for g in range(len(members))]
        self._region = driver.alloc(sizes[group])
        mine = {"handle": driver.ipc_handle(self._region).hex(), "bytes": sizes[group],
                "flags": self._flags.name if group == 0 else None}
        memory = exchange_mem(store, prefix, own, mine, members, sizes, deadline)
        if group != 0:
            self._flags = FlagBlock.attach(memory[members[0]]["flags"], flag_bytes)
        self._flags_pointer = driver.host_register(self._flags.address, self._flags.nbytes)
        for receiver in sorted({slot.receiver for slot in plan if slot.sender == group}):
            self._mapped[receiver] = pointer = driver.ipc_open(memory[members[receiver]]["handle"])
            if (size := driver.mapped_size(pointer)) < sizes[receiver]:
                raise AFDProtocolError(
                    f"{NAME}: the slot allocation of AFD rank {members[receiver]} mapped here has {size} bytes; the "
                    f"slot plan needs {sizes[receiver]}. Another client wrote the store: keep its port private"
                )
        routes: dict[tuple[str, str, int], list[_Route]] = {}
        for slot in plan:
            if group not in (slot.receiver, slot.sender):
                continue
            if slot.receiver == group:
                key, base = ("recv", slot.channel, slot.sender), self._region
            else:
                key, base = ("send", slot.channel, slot.receiver), self._mapped[slot.receiver]
            routes.setdefault(key, []).append(_Route(slot, base + slot.offset, self._flags_pointer + 4 * slot.flag))
        self._routes = {key: tuple(value) for key, value in routes.items()}
        self._wait_flags = tuple(slot.flag for slot in plan if slot.receiver == group)
        store.set(f"{prefix}/ready/{own}", "1")
        if group == 0:
            gather(store, prefix, "ready", members, deadline)
            self._flags.unlink()  # every member mapped it: nothing is left behind in /dev/shm

    # ---- data -----------------------------------------------------------------------------------

    def send(self, channel: str, tensor: torch.Tensor, dst: int) -> None:
        if channel == CONTROL:
            return self._control.send(channel, tensor, dst)
        key = ("send", channel, dst)
        route = self._route(key)
        nbytes = self._fits(route, tensor)
        self._enqueue(send_ops(route.pointer, route.flag_pointer, self._address(tensor), nbytes), key)

    def isend(self, channel: str, tensor: torch.Tensor, dst: int) -> SendHandle:
        self.send(channel, tensor, dst)  # a copy and a flag write on the stream: nothing waits for the peer
        return DONE

    def recv(self, channel: str, tensor: torch.Tensor, src: int) -> None:
        if channel == CONTROL:
            return self._control.recv(channel, tensor, src)
        key = ("recv", channel, src)
        route = self._route(key)
        nbytes = self._fits(route, tensor)
        self._enqueue(recv_ops(route.pointer, route.flag_pointer, self._address(tensor), nbytes), key)

    def _route(self, key: tuple[str, str, int]) -> _Route:
        routes = self._routes.get(key)
        if routes is None:
            kind, channel, peer = key
            raise RuntimeError(
                f"{NAME}: no {channel} slot to {kind} {'to' if kind == 'send' else 'from'} group rank {peer} (slots: "
                f"{sorted(self._routes)}); expected AFDConnector.init() to have opened the transport, and no use "
                "after close()"
            )
        return routes[self._positions.get(key, 0)]

    def _fits(self, route: _Route, tensor: torch.Tensor) -> int:
        nbytes = tensor.numel() * tensor.element_size()
        slot = route.slot
        if nbytes > slot.limit:
            raise ValueError(
                f"{NAME}: Too many bytes for the {slot.channel} slot: {nbytes} ({list(tensor.shape)} {tensor.dtype}). "
                f"The max is {slot.limit} ({slot.rows} rows, the attention rank's max_rows). Raise "
                "--max-num-batched-tokens on the attention role, which sizes the slots at start-up"
            )
        return nbytes

    def _address(self, tensor: torch.Tensor) -> int:
        if tensor.device != self.device or not tensor.is_contiguous():
            layout = "contiguous" if tensor.is_contiguous() else "non-contiguous"
            raise ValueError(f"{NAME}: got a {layout} tensor on {tensor.device}; expected a contiguous tensor on "
                             f"{self.device}. Pass the rank's [rows, width] tensor")
        return tensor.data_ptr()

    def _enqueue(self, ops: tuple[Op, ...], key: tuple[str, str, int]) -> None:
        self._used = True
        self._driver.enqueue(ops, self._driver.current_stream())
        self._positions[key] = (self._positions.get(key, 0) + 1) % len(self._routes[key])

    # ---- failure and teardown -------------------------------------------------------------------

    def release_waits(self) -> None:
        """Store ABORT into every flag this rank waits on: host stores, which no GPU queue can block."""
        with self._lock:
            if self._flags is not None:
                for index in self._wait_flags:
                    self._flags.write(index, ABORT)

    def abort(self) -> None:
        self.release_waits()
        self._hold()
        self._control.abort()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._used:
            # NOTE: as NCCL's abort, close releases this rank's pending waits (first: nothing else may delay
            # that); the device must drain before the memory it may still touch is freed. The connector runs
            # close() on a daemon thread.
            self.release_waits()
            self._hold()
        self._control.close()
        if self._used:
            try:
                self._driver.bind()
                self._driver.synchronize()
            except RuntimeError as exc:  # a broken context: free what can be freed
                logger.warning("%s: the device did not drain before close: %s", NAME, exc)
        self._free()

    def _hold(self) -> None:
        with self._lock:
            if self._holder is not None or self._flags is None:
                return
            self._holder = threading.Thread(target=self._hold_loop, name="afd-ipc-abort", daemon=True)
        self._holder.start()

    def _hold_loop(self) -> None:
        while not self._stop.wait(self._hold_period_s):
            self.release_waits()

    def _free(self) -> None:
        """Release whatever was taken; safe after a partial open and repeatedly."""
        self._stop.set()
        if self._holder is not None and self._holder is not threading.current_thread():
            self._holder.join(HOLD_JOIN_S)
        with self._lock:
            flags, self._flags, self._wait_flags, self._routes = self._flags, None, (), {}
        mapped, self._mapped = self._mapped, {}
        region, self._region = self._region, None
        registered, self._flags_pointer = self._flags_pointer, None
        steps: list[tuple[str, Any]] = []
        if region is not None or registered is not None or mapped:
            steps.append(("make the device current", self._driver.bind))  # close() runs on its own thread
        if flags is not None:
            if registered is not None:
                steps.append(("unregister the flag page", lambda: self._driver.host_unregister(flags.address)))
            steps += [("unlink the flag page", flags.unlink), ("unmap the flag page", flags.close)]
        steps += [(f"close group rank {g}'s slots", lambda p=pointer: self._driver.ipc_close(p))
                  for g, pointer in mapped.items()]
        if region is not None:
            steps.append(("free the slots", lambda: self._driver.free(region)))
        for what, step in steps:
            try:
                step()
            except (OSError, RuntimeError, BufferError) as exc:  # best effort: the process keeps running
                logger.warning("%s: could not %s: %s", NAME, what, exc)


