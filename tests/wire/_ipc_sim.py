"""A simulated GPU for the IPC transport's CPU tests: per-rank streams of driver ops over real memory.

``FakeDriver`` stands in for ``CudaDriver`` (wire/transports/cuda_driver.py) and records every call;
its "device" allocations are ctypes buffers, so the transport's copies, flag writes and waits run on
real addresses: CPU tensors' data, those buffers, and the flag page in /dev/shm that ``abort()``
writes from the host. ``SimDevice`` executes the enqueued ops stream by stream, a wait only once
its flag satisfies the cyclic >= of ``cuStreamWaitValue32``.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vllm_afd.wire.placement import Placement
from vllm_afd.wire.transport import Transport
from vllm_afd.wire.transports.cuda_driver import COPY, WAIT, WRITE, Op
from vllm_afd.wire.transports.ipc import IpcTransport, message_row_bytes

HIDDEN = 8
EXPERTS = 4


def geq(value: int, target: int) -> bool:
    """``(int32_t)(value - target) >= 0``: the wait condition of cuStreamWaitValue32 (GEQ)."""
    return ((value - target) & 0xFFFFFFFF) < 0x80000000


class SimDevice:
    """Streams of ops; an op is a copy (memmove), a 32-bit write or a 32-bit cyclic >= wait."""

    def __init__(self) -> None:
        self.streams: dict[int, deque[Op | Callable[[], None]]] = {}
        self.buffers: dict[int, Any] = {}  # device allocations by address, kept alive here
        self._ids = itertools.count(1)

    def new_stream(self) -> int:
        stream = next(self._ids)
        self.streams[stream] = deque()
        return stream

    def ready(self, stream: int) -> bool:
        queue = self.streams[stream]
        if not queue:
            return False
        head = queue[0]
        return not (isinstance(head, Op) and head.kind == WAIT) or geq(ctypes.c_uint32.from_address(head.dst).value,
                                                                       head.value)

    def step(self, stream: int) -> None:
        op = self.streams[stream].popleft()
        if not isinstance(op, Op):
            op()  # a check the test enqueued in stream order (the "kernels" of the model)
        elif op.kind == COPY:
            ctypes.memmove(op.dst, op.src, op.nbytes)
        elif op.kind == WRITE:
            ctypes.c_uint32.from_address(op.dst).value = op.value

    def drain(self, release: Sequence[Callable[[], None]] = ()) -> bool:
        """Run every stream as far as it goes; ``release`` runs whenever all are blocked (an abort holder).

        Returns True when every stream is empty.
        """
        while True:
            ready = [s for s in self.streams if self.ready(s)]
            if not ready:
                if not release or not any(self.streams.values()):
                    return not any(self.streams.values())
                for callback in release:
                    callback()
                ready = [s for s in self.streams if self.ready(s)]
                if not ready:
                    return False
            for stream in ready:
                self.step(stream)


class ThreadedSimDevice(SimDevice):
    """A SimDevice that runs on its own thread, as a GPU runs behind its host: hosts enqueue and move on."""

    def __init__(self) -> None:
        super().__init__()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sim-device", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            ready = [s for s in list(self.streams) if self.ready(s)]
            for stream in ready:
                self.step(stream)
            if not ready:
                self._stop.wait(0.0005)

    def wait_empty(self, stream: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.streams[stream]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"simulated device: stream {stream} did not drain within {timeout_s}s")
            time.sleep(0.0005)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)


class FakeDriver:
    """Recording stand-in for CudaDriver on a SimDevice; ``live`` holds what is still allocated."""

    def __init__(self, sim: SimDevice, *, pid: int, host: str = "node", gpu: str = "GPU-0",
                 problem: str | None = None, peer_problem: str | None = None) -> None:
        self.sim, self.stream = sim, sim.new_stream()
        self._identity = {"host": host, "pid": pid, "gpu": gpu}
        self._problem, self._peer_problem = problem, peer_problem
        self.calls: list[str] = []
        self.live: set[tuple[str, int]] = set()

    def check_device(self) -> None:
        pass

    def bind(self) -> None:
        self.calls.append("bind")

    def identity(self) -> dict[str, Any]:
        return dict(self._identity)

    def missing_capability(self) -> str | None:
        return self._problem

    def peer_problem(self, peer_gpu: str) -> str | None:
        return self._peer_problem

    def alloc(self, nbytes: int) -> int:
        buffer = ctypes.create_string_buffer(nbytes)
        address = ctypes.addressof(buffer)
        self.sim.buffers[address] = buffer
        self._take("alloc", address)
        return address

    def free(self, pointer: int) -> None:
        self._give("alloc", pointer)

    def ipc_handle(self, pointer: int) -> bytes:
        return pointer.to_bytes(8, "little") + bytes(56)

    def ipc_open(self, handle: bytes) -> int:
        pointer = int.from_bytes(handle[:8], "little")
        assert pointer in self.sim.buffers, "an IPC handle of no allocation"
        self._take("ipc", pointer)
        return pointer

    def mapped_size(self, pointer: int) -> int:
        return ctypes.sizeof(self.sim.buffers[pointer])

    def ipc_close(self, pointer: int) -> None:
        self._give("ipc", pointer)

    def host_register(self, address: int, nbytes: int) -> int:
        self._take("host", address)
        return address  # unified addressing: the device sees the page at its host address

    def host_unregister(self, address: int) -> None:
        self._give("host", address)

    def current_stream(self) -> int:
        return self.stream

    def enqueue(self, ops: Sequence[Op], stream: int) -> None:
        self.calls.append("enqueue")
        self.sim.streams[stream].extend(ops)

    def synchronize(self) -> None:
        self.calls.append("synchronize")
        if isinstance(self.sim, ThreadedSimDevice):
            self.sim.wait_empty(self.stream, 10.0)

    def _take(self, kind: str, pointer: int) -> None:
        self.calls.append(kind)
        self.live.add((kind, pointer))

    def _give(self, kind: str, pointer: int) -> None:
        self.calls.append(f"release {kind}")
        self.live.remove((kind, pointer))


class NullControl(Transport):
    """The control channel is gloo's business; these tests exercise the data slots only."""

    def open(self, store: Any, placement: Placement, timeout_s: float) -> None:
        pass

    def send(self, channel: str, tensor: torch.Tensor, dst: int) -> None:
        raise AssertionError("no control traffic in these tests")

    recv = isend = send

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


def make_transport(driver: FakeDriver, *, gate: bool = True, max_rows: int = 4, **overrides: Any) -> IpcTransport:
    row_bytes = message_row_bytes(HIDDEN, torch.float32, EXPERTS if gate else None)
    return IpcTransport(torch.device("cpu"), row_bytes=row_bytes, max_rows=max_rows, driver=driver,
                        control=NullControl(), **overrides)


def open_all(transports: Sequence[IpcTransport], placements: Sequence[Placement], store: Any,
             timeout_s: float = 10.0) -> list[BaseException | None]:
    """Open every transport on its own thread (open waits for the others); returns each one's error."""
    errors: list[BaseException | None] = [None] * len(transports)

    def run(index: int) -> None:
        try:
            transports[index].open(store, placements[index], timeout_s)
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            errors[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(transports))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 10)
    return errors
