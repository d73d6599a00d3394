"""The CUDA driver calls of the IPC transport (``ipc.py``), behind one small object.

Everything the IPC transport asks of CUDA goes through ``CudaDriver``: who this rank is (host,
process, GPU), what the device can do, device memory shared through CUDA IPC, host memory mapped
for the device, and three stream operations (``Op``): an asynchronous copy, a 32-bit write and a
32-bit wait, enqueued on the caller's stream. The transport's pure parts (slot plan, flag protocol,
refusals) are therefore tested on CPU with a recording fake in place of this class
(tests/wire/test_ipc_transport.py). ``libcuda.so.1`` is loaded at the first driver call, never
at import or construction, so CPU-only processes import this module freely.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

__all__ = ["COPY", "CudaDriver", "IPC_HANDLE_BYTES", "Op", "WAIT", "WRITE", "mps_running", "peer_access_problem",
           "warn_without_mps"]

logger = logging.getLogger(__name__)

# The three stream operations, in the order a transport enqueues them.
COPY, WRITE, WAIT = "copy", "write", "wait"

# cuda.h values: flags and attributes the transport relies on.
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
CU_MEMHOSTREGISTER_PORTABLE = 0x01
CU_MEMHOSTREGISTER_DEVICEMAP = 0x02
CU_STREAM_WAIT_VALUE_GEQ = 0x0  # (int32_t)(*addr - value) >= 0
CU_STREAM_WRITE_VALUE_DEFAULT = 0x0  # with a system-scope memory fence before the write
CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED = 99
CU_STREAM_CAPTURE_MODE_RELAXED = 2
IPC_HANDLE_BYTES = 64
# NOTE: the V2 stream memory operations (CUDA 11.7+ drivers) need no kernel module parameter, unlike
# the V1 ones, whose attribute CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1 can read 0 where V2
# works; so support is "the driver exports the V2 entry points"
# (docs/decisions.md#21-stream-memory-operations-detected-by-their-v2-entry-points).
STREAM_MEM_OPS = ("cuStreamWaitValue32_v2", "cuStreamWriteValue32_v2")


def mps_running() -> bool:
    """Whether an MPS control daemon is reachable: its ``control`` pipe in CUDA_MPS_PIPE_DIRECTORY (default
    /tmp/nvidia-mps), which is where this process's CUDA client would connect."""
    return os.path.exists(os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps", "control"))


def warn_without_mps(own: int, sharing: list[int]) -> None:
    """Warn when AFD rank ``own`` shares its GPU with the AFD ranks ``sharing`` and no MPS daemon runs."""
    if sharing and not mps_running():
        logger.warning(
            "P2pIpcAFDConnector: AFD rank %d shares its GPU with AFD ranks %s without MPS: the GPU time-slices their "
            "processes, so every exchange waits for a context switch (~0.15 ms each way on an H200) and can stall "
            "for a whole time slice (~2 ms). Start the roles under MPS (nvidia-cuda-mps-control -d) or give each "
            "role its own GPU (docs/failures.md#13-one-gpu-two-roles)", own, sharing)


def peer_access_problem(own_index: int, peer_gpu: str, visible: list[str],
                        can_access_peer: Callable[[int, int], bool]) -> str | None:
    """Why the rank on ``cuda:<own_index>`` cannot write into GPU ``peer_gpu``'s memory, or None.

    ``visible``: the UUIDs of this process's devices by index (CUDA_VISIBLE_DEVICES' order). A handle made
    on another GPU is opened (cuIpcOpenMemHandle, peer access enabled lazily) only where that GPU is
    visible here and the two have peer access; the same GPU needs neither.
    """
    if not 0 <= own_index < len(visible):
        return (f"this rank's device cuda:{own_index} is not among this process's {len(visible)} visible GPUs; "
                "expected vLLM to give each rank a visible device")
    if peer_gpu == visible[own_index]:
        return None
    if peer_gpu not in visible:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        return (f"the peer's GPU {peer_gpu} is not visible in this process (CUDA_VISIBLE_DEVICES={shown}); "
                "list both roles' GPUs in every role's CUDA_VISIBLE_DEVICES, the role's own GPUs first "
                "(docs/protocol.md#multi-gpu-readiness)")
    index = visible.index(peer_gpu)
    if not can_access_peer(own_index, index):
        return f"GPU {own_index} has no peer access to GPU {index} (no NVLink or PCIe P2P between them)"
    return None


class Op(NamedTuple):
    """One stream operation: copy ``nbytes`` from ``src`` to ``dst``, or write/wait ``value`` at ``dst``."""

    kind: str
    dst: int
    src: int = 0
    nbytes: int = 0
    value: int = 0


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_BYTES)]  # c_char would stop at a NUL byte


_u64, _ptr, _size = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t
_SIGNATURES: dict[str, list[Any]] = {
    "cuInit": [ctypes.c_uint],
    "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
    "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
    "cuMemAlloc_v2": [ctypes.POINTER(_u64), _size],
    "cuMemFree_v2": [_u64],
    "cuIpcGetMemHandle": [ctypes.POINTER(_IpcHandle), _u64],
    "cuIpcOpenMemHandle_v2": [ctypes.POINTER(_u64), _IpcHandle, ctypes.c_uint],
    "cuIpcCloseMemHandle": [_u64],
    "cuMemGetAddressRange_v2": [ctypes.POINTER(_u64), ctypes.POINTER(_size), _u64],
    "cuMemHostRegister_v2": [_ptr, _size, ctypes.c_uint],
    "cuMemHostUnregister": [_ptr],
    "cuMemHostGetDevicePointer_v2": [ctypes.POINTER(_u64), _ptr, ctypes.c_uint],
    "cuMemcpyAsync": [_u64, _u64, _size, _ptr],
    "cuStreamWriteValue32_v2": [_ptr, _u64, ctypes.c_uint32, ctypes.c_uint],
    "cuStreamWaitValue32_v2": [_ptr, _u64, ctypes.c_uint32, ctypes.c_uint],
    "cuThreadExchangeStreamCaptureMode": [ctypes.POINTER(ctypes.c_int)],
}


class CudaDriver:
    """The real driver of one rank's GPU, through ctypes (see the module docstring)."""

    name = "P2pIpcAFDConnector"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._lib: Any = None

    # ---- who and what (no resources) ------------------------------------------------------------

    def check_device(self) -> None:
        if self.device.type != "cuda" or self.device.index is None:
            raise ValueError(
                f"{self.name}: device {self.device} is not an indexed CUDA device; CUDA IPC and stream memory "
                "operations move GPU memory. Use P2pGlooAFDConnector on CPU"
            )

    def bind(self) -> None:
        """Make the rank's GPU (its primary context) current on the calling thread."""
        torch.cuda.set_device(self.device)

    def identity(self) -> dict[str, Any]:
        return {"host": socket.gethostname(), "pid": os.getpid(),
                "gpu": str(torch.cuda.get_device_properties(self.device).uuid)}

    def missing_capability(self) -> str | None:
        """Why this rank cannot run the transport, or None."""
        try:
            lib = self._load()
        except OSError as exc:
            return f"libcuda.so.1 cannot be loaded ({exc})"
        missing = [name for name in STREAM_MEM_OPS if not hasattr(lib, name)]
        if missing:
            return f"the CUDA driver lacks {', '.join(missing)} (stream memory operations V2 need a CUDA 11.7+ driver)"
        if not self._attribute(CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED):
            return "the device cannot map registered host memory (CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED = 0)"
        return None

    def peer_problem(self, peer_gpu: str) -> str | None:
        """Why this rank cannot write into memory of the GPU ``peer_gpu`` (a UUID), or None."""
        visible = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
        return peer_access_problem(self.device.index, peer_gpu, visible, torch.cuda.can_device_access_peer)

    # ---- resources ------------------------------------------------------------------------------

    def alloc(self, nbytes: int) -> int:
        pointer = _u64()
        self._call("cuMemAlloc_v2", ctypes.byref(pointer), nbytes)
        return pointer.value

    def free(self, pointer: int) -> None:
        self._call("cuMemFree_v2", pointer)

    def ipc_handle(self, pointer: int) -> bytes:
        handle = _IpcHandle()
        self._call("cuIpcGetMemHandle", ctypes.byref(handle), pointer)
        return bytes(handle.reserved)

    def ipc_open(self, handle: bytes) -> int:
        pointer = _u64()
        self._call("cuIpcOpenMemHandle_v2", ctypes.byref(pointer), _IpcHandle.from_buffer_copy(handle),
                   CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        return pointer.value

    def mapped_size(self, pointer: int) -> int:
        """Bytes from ``pointer`` to the end of the allocation holding it, as the driver knows it (the
        allocation's true size, whatever the store said about it)."""
        base, size = _u64(), _size()
        self._call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), pointer)
        return base.value + size.value - pointer

    def ipc_close(self, pointer: int) -> None:
        self._call("cuIpcCloseMemHandle", pointer)

    def host_register(self, address: int, nbytes: int) -> int:
        """Pin and map host memory for the device; returns its device pointer."""
        self._call("cuMemHostRegister_v2", address, nbytes, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP)
        pointer = _u64()
        self._call("cuMemHostGetDevicePointer_v2", ctypes.byref(pointer), address, 0)
        return pointer.value

    def host_unregister(self, address: int) -> None:
        self._call("cuMemHostUnregister", address)

    # ---- stream work ----------------------------------------------------------------------------

    def current_stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def enqueue(self, ops: Iterable[Op], stream: int) -> None:
        """Enqueue ``ops`` in order on ``stream``: copies, writes and cyclic >= waits (capturable)."""
        handle = ctypes.c_void_p(stream)
        for op in ops:
            if op.kind == COPY:
                self._call("cuMemcpyAsync", op.dst, op.src, op.nbytes, handle)
            elif op.kind == WRITE:
                self._call("cuStreamWriteValue32_v2", handle, op.dst, op.value, CU_STREAM_WRITE_VALUE_DEFAULT)
            else:
                self._call("cuStreamWaitValue32_v2", handle, op.dst, op.value, CU_STREAM_WAIT_VALUE_GEQ)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def relax_capture_mode(self) -> None:
        """Let the calling thread query events while another thread captures a CUDA graph.

        A capture in global mode (torch's and vLLM's default) forbids the calls it deems unsafe on every
        thread, an event query among them, and one such call invalidates the capture: the watchdog thread's
        poll of a step's event (wire/progress.py) ended an FFN's capture (docs/failures.md#25).  The mode is
        the calling thread's own, so this thread's calls are then checked against no other thread's capture.
        """
        mode = ctypes.c_int(CU_STREAM_CAPTURE_MODE_RELAXED)
        self._call("cuThreadExchangeStreamCaptureMode", ctypes.byref(mode))

    # ---- ctypes ---------------------------------------------------------------------------------

    def _load(self) -> Any:
        if self._lib is None:
            lib = ctypes.CDLL("libcuda.so.1")
            for name, argtypes in _SIGNATURES.items():
                if hasattr(lib, name):  # the V2 entry points are checked by missing_capability()
                    function = getattr(lib, name)
                    function.restype, function.argtypes = ctypes.c_int, argtypes
            if lib.cuInit(0) != 0:
                raise OSError("cuInit failed")
            self._lib = lib
        return self._lib

    def _attribute(self, attribute: int) -> int:
        device, value = ctypes.c_int(), ctypes.c_int()
        self._call("cuDeviceGet", ctypes.byref(device), self.device.index)
        self._call("cuDeviceGetAttribute", ctypes.byref(value), attribute, device.value)
        return value.value

    def _call(self, name: str, *args: Any) -> None:
        result = getattr(self._load(), name)(*args)
        if result != 0:
            text = ctypes.c_char_p()
            self._lib.cuGetErrorString(result, ctypes.byref(text))
            reason = text.value.decode() if text.value else "unknown error"
            raise RuntimeError(f"{self.name}: {name} failed with CUDA error {result} ({reason}) on {self.device}")
