"""The CUDA IPC transport (connector name ``P2pIpcAFDConnector``): host-free, SM-free, capturable.

For the ranks of one node: both roles on one GPU, or on GPUs of one host with peer access. Data
moves by copies into memory the peer owns, and readiness by 32-bit flags the GPU itself writes and
waits on (stream memory operations), so a layer's exchange needs no host round trip and no kernel,
and a CUDA graph records it like any other stream work.

Memory. Every receiver owns one device allocation holding its receive *slots*, one per (channel,
attention peer, micro-batch stage, message position within one exchange): on ``a2f`` the FFN owns, per attention peer,
a slot for the hidden states and, with the gate on attention, one for the router logits; on ``f2a``
each attention rank owns one slot for its FFN output. A slot holds the attention rank's largest
step (``max_rows``: vLLM's max_num_batched_tokens, published at ``open``). Allocations are exported
with CUDA IPC at ``open`` and mapped by their senders. Each slot's *ready flag* is a 32-bit word in
one page of host shared memory (``/dev/shm``, ``shm.py``) that the data subgroup maps and registers
for the device: a flag in host memory can be released by a plain CPU store, which no GPU queue blocked on a
wait can hold up (docs/decisions.md#20-a-capturable-one-node-transport-p2pipcafdconnector).

Protocol, enqueued on the caller's current stream (no host wait, no kernel; capturable):

    send: copy tensor -> the peer's slot ; write(flag, FULL)        (the write fences the copy)
    recv: wait(flag >= FULL) ; copy slot -> tensor ; write(flag, EMPTY)

With one stage, one slot per message position suffices, because an exchange is a request/response
lockstep per (attention rank, FFN rank) pair: attention rank j writes its a2f slots for exchange e+1
only after its stream passed recv_f2a(e), i.e. after the FFN wrote j's f2a flag for e, which the FFN's
stream does after it copied exchange e out of j's a2f slots and reset their flags. Symmetrically, the
FFN writes j's f2a slot for e+1 only after its stream received a2f e+1 from j, which j's stream sends
after it copied f2a e out and reset that flag. With k stages (docs/pingpong.md) the pair is no longer
in lockstep, but each stage is: exchanges run in (layer, stage) order on both sides, and stage s of
layer l+1 is sent only after stage s of layer l was received, so at most k exchanges per direction are
unconsumed at any time. Each (channel, peer) therefore cycles through ``num_stages`` x positions
slots in message order (message n uses slot n mod that; its position is n mod positions, so sizes
match), which also serves a step of fewer stages than ``num_stages``. Sends never wait (a copy and a
flag write), so ``isend`` enqueues them on the current stream and returns a completed handle. Both
sides count message positions alike
(positional protocol), every step is whole exchanges, so a replayed graph begins and ends with
every flag EMPTY (tests/wire/test_ipc_protocol.py checks this on a simulated device).

Failure. A wait is cyclic >= FULL, so ABORT (2^30) releases it like FULL. ``abort()`` stores ABORT
into every flag this rank waits on and keeps storing it until ``close()``: a released receive resets
its flag to EMPTY, and a later wait on the same slot (the next layer, the rest of a replayed graph)
must find ABORT again. The data is garbage from then on; the connector raises its sticky failure at
its next call, as with gloo. ``close()`` releases the waits as well, lets the device drain, then
frees everything. Refused with the fix before any resource is taken: a CPU device, a data-subgroup
member on another host (P2pNcclAFDConnector), in the same process, without stream memory operations
V2, or on a GPU without peer access. The control channel is host data, never inside a graph: a
shared-memory mailbox per control pair (mailbox.py), which the FFN's loop polls.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from vllm_afd.wire.placement import A2F, CONTROL, F2A, Placement
from vllm_afd.wire.transport import DONE, SendHandle, Transport
from vllm_afd.wire.transports.cuda_driver import COPY, WAIT, WRITE, CudaDriver, Op
from vllm_afd.wire.transports.mailbox import MailboxTransport
from vllm_afd.wire.transports.shm import FlagBlock

__all__ = ["ABORT", "EMPTY", "FULL", "IpcTransport", "Slot", "check_members", "message_row_bytes", "mps_running",
           "plan_slots", "ranks_sharing_gpu", "recv_ops", "send_ops"]

logger = logging.getLogger(__name__)

NAME = "P2pIpcAFDConnector"
# Flag values: a cyclic >= FULL wait passes on FULL and on ABORT, never on EMPTY.
EMPTY, FULL, ABORT = 0, 1, 1 << 30
FLAG_STRIDE = 16  # words from one flag to the next: a 64-byte line each
SLOT_ALIGN = 256  # bytes; every slot starts aligned for the copy engines
ROUTER_LOGIT_BYTES = 4  # router logits are sized as float32, the widest gate output
HOLD_PERIOD_S = 0.001  # after abort(), how often the flags this rank waits on are set to ABORT again
HOLD_JOIN_S = 1.0


def message_row_bytes(hidden_size: int, dtype: torch.dtype,
                      router_logits_width: int | None) -> dict[str, tuple[int, ...]]:
    """Bytes per row of each message position of one exchange: a2f hidden[, router logits]; f2a output."""
    hidden = hidden_size * dtype.itemsize
    a2f = (hidden,) if router_logits_width is None else (hidden, router_logits_width * ROUTER_LOGIT_BYTES)
    return {A2F: a2f, F2A: (hidden,)}


@dataclass(frozen=True, slots=True)
class Slot:
    """One message position of one (channel, attention peer): a receive buffer and its ready flag."""

    channel: str  # A2F or F2A
    peer: int  # the attention rank's group rank in the data subgroup (1..n)
    stage: int  # the slot's turn among the num_stages sets of one (channel, peer): 0..num_stages-1
    position: int  # message position within one exchange (a2f: 0 hidden, 1 router logits)
    receiver: int  # group rank owning the buffer (0, the FFN, for a2f; the peer for f2a)
    sender: int
    rows: int  # the attention peer's max_rows
    limit: int  # bytes of the largest message: rows x bytes per row
    offset: int  # bytes into the receiver's slot allocation
    capacity: int  # bytes reserved: the limit rounded up to SLOT_ALIGN
    flag: int  # word index of its ready flag in the subgroup's flag page


def plan_slots(row_bytes: Mapping[str, Sequence[int]], max_rows: Mapping[int, int],
               num_stages: int = 1) -> tuple[Slot, ...]:
    """Every slot of one data subgroup, from the message widths, each attention peer's max_rows and the
    handshake's ``num_stages``.

    Every member computes the same plan from the same published values: peers ascending, a2f before
    f2a, stages ascending, positions ascending (message order); offsets run per receiver, flags over
    the whole subgroup.
    """
    slots: list[Slot] = []
    used: dict[int, int] = {}
    for peer in sorted(max_rows):
        for channel in (A2F, F2A):
            receiver, sender = (0, peer) if channel == A2F else (peer, 0)
            for stage in range(num_stages):
                for position, per_row in enumerate(row_bytes[channel]):
                    limit = max_rows[peer] * per_row
                    capacity = -(-limit // SLOT_ALIGN) * SLOT_ALIGN
                    offset = used.get(receiver, 0)
                    slots.append(Slot(channel, peer, stage, position, receiver, sender, max_rows[peer], limit, offset,
                                      capacity, len(slots) * FLAG_STRIDE))
                    used[receiver] = offset + capacity
    return tuple(slots)


def send_ops(slot_pointer: int, flag_pointer: int, src: int, nbytes: int) -> tuple[Op, ...]:
    return (Op(COPY, slot_pointer, src, nbytes), Op(WRITE, flag_pointer, value=FULL))


def recv_ops(slot_pointer: int, flag_pointer: int, dst: int, nbytes: int) -> tuple[Op, ...]:
    return (Op(WAIT, flag_pointer, value=FULL), Op(COPY, dst, slot_pointer, nbytes),
            Op(WRITE, flag_pointer, value=EMPTY))


def check_members(records: Mapping[int, Mapping[str, Any]], own: int) -> None:
    """Refuse, with the fix, a data subgroup the transport cannot serve (records by AFD rank)."""
    for rank, record in sorted(records.items()):
        if record.get("problem") is not None:
            raise RuntimeError(
                f"{NAME}: AFD rank {rank} cannot use CUDA stream memory operations ({record['problem']}); expected "
                "a CUDA 11.7+ driver on a GPU that maps host memory. Use P2pNcclAFDConnector (one GPU per rank) "
                "or P2pGlooAFDConnector (eager)"
            )
    mine = records[own]
    for rank, record in sorted(records.items()):
        if record["host"] != mine["host"]:
            raise RuntimeError(
                f"{NAME} needs every rank of a data subgroup on one host (AFD rank {own} on {mine['host']!r}, AFD "
                f"rank {rank} on {record['host']!r}); CUDA IPC does not cross hosts. Use P2pNcclAFDConnector"
            )
        if rank != own and record["pid"] == mine["pid"]:
            raise RuntimeError(
                f"{NAME}: AFD ranks {own} and {rank} are one process (pid {mine['pid']}); CUDA IPC maps memory of "
                "another process. Run each role in its own process"
            )
        if record.get("num_stages") != mine.get("num_stages"):
            raise RuntimeError(
                f"{NAME}: AFD ranks {own} and {rank} plan slots for different num_stages ({mine.get('num_stages')} vs "
                f"{record.get('num_stages')}); set the same additional_config['afd']['num_stages'] on both roles"
            )
        if record["row_bytes"] != mine["row_bytes"]:
            raise RuntimeError(
                f"{NAME}: AFD ranks {own} and {rank} size messages differently ({mine['row_bytes']} vs "
                f"{record['row_bytes']} bytes per row); run the same vllm_afd version and model on both roles"
            )


def ranks_sharing_gpu(records: Mapping[int, Mapping[str, Any]], own: int) -> list[int]:
    """The other AFD ranks of the subgroup on this rank's GPU (records by AFD rank, as published at open)."""
    return sorted(rank for rank, record in records.items() if rank != own and record["gpu"] == records[own]["gpu"])


def mps_running() -> bool:
    """Whether an MPS control daemon is reachable: its ``control`` pipe in CUDA_MPS_PIPE_DIRECTORY (default
    /tmp/nvidia-mps), which is where this process's CUDA client would connect."""
    return os.path.exists(os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps", "control"))


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
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows <= 0:
            raise ValueError(f"{NAME}: max_rows must be a positive int, got {max_rows!r}; pass the attention's "
                             "largest step (vLLM's max_num_batched_tokens)")
        if sorted(row_bytes) != sorted((A2F, F2A)) or not all(n > 0 for v in row_bytes.values() for n in v):
            raise ValueError(f"{NAME}: row_bytes {dict(row_bytes)} must give positive bytes per row for "
                             f"'{A2F}' and '{F2A}'; build them with message_row_bytes()")
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages <= 0:
            raise ValueError(f"{NAME}: num_stages must be a positive int, got {num_stages!r}; pass the handshake's "
                             "num_stages (AFDConfig.num_stages)")
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
        store.set(f"{prefix}/who/{own}", json.dumps(record))
        records = _gather(store, prefix, "who", members, deadline)
        check_members(records, own)
        sharing = ranks_sharing_gpu(records, own)
        if sharing and not mps_running():
            logger.warning(
                "%s: AFD rank %d shares its GPU with AFD ranks %s without MPS: the GPU time-slices their processes, "
                "so every exchange waits for a context switch (~0.15 ms each way on an H200) and can stall for a "
                "whole time slice (~2 ms). Start the roles under MPS (nvidia-cuda-mps-control -d) or give each "
                "role its own GPU (docs/failures.md#13-one-gpu-two-roles)", NAME, own, sharing)
        # Peer access is checked by the writer; the verdicts are exchanged, so every rank refuses before it allocates.
        verdict = next((f"AFD rank {own} cannot write into AFD rank {rank}'s GPU memory: {issue}"
                        for rank in (members[1:] if placement.role == "ffn" else members[:1])
                        if (issue := driver.peer_problem(records[rank]["gpu"])) is not None), None)
        store.set(f"{prefix}/access/{own}", json.dumps(verdict))
        if verdict is None:
            verdict = next(filter(None, _gather(store, prefix, "access", members, deadline).values()), None)
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
        if group == 0:
            self._flags = FlagBlock.create(len(plan) * FLAG_STRIDE * 4)
        self._region = driver.alloc(sum(slot.capacity for slot in plan if slot.receiver == group))
        mine = {"handle": driver.ipc_handle(self._region).hex(), "flags": self._flags.name if group == 0 else None}
        store.set(f"{prefix}/mem/{own}", json.dumps(mine))
        memory = _gather(store, prefix, "mem", members, deadline)
        if group != 0:
            self._flags = FlagBlock.attach(memory[members[0]]["flags"])
        self._flags_pointer = driver.host_register(self._flags.address, self._flags.nbytes)
        for receiver in sorted({slot.receiver for slot in plan if slot.sender == group}):
            self._mapped[receiver] = driver.ipc_open(bytes.fromhex(memory[members[receiver]]["handle"]))
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
            _gather(store, prefix, "ready", members, deadline)
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


def _gather(store: Any, prefix: str, kind: str, members: Sequence[int], deadline: float) -> dict[int, Any]:
    """Every member's ``kind`` record of this subgroup, waiting until ``deadline``."""
    keys = {rank: f"{prefix}/{kind}/{rank}" for rank in members}
    timeout = max(deadline - time.monotonic(), 0.01)
    try:
        store.wait(list(keys.values()), datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:  # torch's store timeouts are RuntimeErrors (DistStoreError)
        missing = [rank for rank, key in keys.items() if not store.check([key])]
        raise RuntimeError(
            f"{NAME}: AFD ranks {missing} did not publish their IPC '{kind}' record within {timeout:.0f}s; expected "
            f"every rank of the data subgroup to open {NAME}. Configure both roles with it and check their logs"
        ) from exc
    return {rank: json.loads(store.get(key)) for rank, key in keys.items()}
