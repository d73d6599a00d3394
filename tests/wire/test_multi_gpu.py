"""An AFD pool's CUDA paths with one GPU per rank, on CPU with recording fakes (protocol.md#multi-gpu-readiness).

What a multi-GPU run depends on and a CPU can prove: the FFN loop thread makes its rank's GPU current
(``bind_thread``); the NCCL transport names its rank's device for every stream it uses, whatever the calling
thread's current device (a thread starts on cuda:0); the IPC transport opens a peer GPU's handle only where
that GPU is visible and reachable (``peer_access_problem``). The GPU halves are in tests/connectors/.
"""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed import HashStore

from tests.wire._ipc_sim import NullControl
from vllm_afd.wire.devices import bind_thread
from vllm_afd.wire.placement import A2F, F2A, Placement
from vllm_afd.wire.transports.cuda_driver import peer_access_problem
from vllm_afd.wire.transports.nccl import NCCL_UNIQUE_ID_BYTES, NcclSend, NcclTransport

GPUS = ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]  # this process's visible devices by index


# ---- the FFN loop thread's device ------------------------------------------------------------------------------

def test_a_cuda_rank_binds_its_own_gpu_and_a_cpu_rank_binds_nothing():
    calls: list[Any] = []

    bind_thread(torch.device("cuda", 3), calls.append)
    bind_thread(torch.device("cpu"), calls.append)

    assert calls == [torch.device("cuda", 3)]


def test_a_cuda_device_without_an_index_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="has no index; expected the rank's cuda:<N> from vLLM's worker"):
        bind_thread(torch.device("cuda"), lambda device: None)


# ---- IPC: opening a handle made on another GPU -----------------------------------------------------------------

@pytest.mark.parametrize("own, peer, access, expected", [
    (1, "GPU-b", set(), None),  # both roles on one GPU: no peer access needed
    (0, "GPU-c", {(0, 2)}, None),  # a peer GPU of this node, reachable
    (0, "GPU-c", set(), "GPU 0 has no peer access to GPU 2 (no NVLink or PCIe P2P between them)"),
    (0, "GPU-z", {(0, 1)}, "the peer's GPU GPU-z is not visible in this process (CUDA_VISIBLE_DEVICES="),
    (5, "GPU-a", set(), "this rank's device cuda:5 is not among this process's 4 visible GPUs"),
])
def test_a_peer_gpu_is_written_only_where_visible_and_reachable(own, peer, access, expected):
    asked: list[tuple[int, int]] = []

    def can_access(a: int, b: int) -> bool:
        asked.append((a, b))
        return (a, b) in access

    problem = peer_access_problem(own, peer, GPUS, can_access)

    if expected is None:
        assert problem is None
    else:
        assert problem is not None and problem.startswith(expected), problem
    assert all(a == own for a, _ in asked)  # only this rank's own GPU is asked about


def test_a_missing_peer_gpu_names_the_visible_devices_fix(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")

    problem = peer_access_problem(0, "GPU-c", GPUS[:2], lambda a, b: True)

    assert "(CUDA_VISIBLE_DEVICES=0,1); list both roles' GPUs in every role's CUDA_VISIBLE_DEVICES" in problem


# ---- NCCL: every stream is the rank's GPU's -------------------------------------------------------------------

class FakeGpu:
    """A rank's GPU as NcclTransport sees it (``RankGpu``): streams tagged with their device, calls recorded."""

    def __init__(self, device: torch.device, host_gpu: str) -> None:
        self.device = device
        self.host_gpu = host_gpu
        self.log: list[tuple[str, Any]] = []

    def identity(self) -> str:
        return f"node/{self.host_gpu}"

    def current_stream(self) -> Any:
        return FakeStream(self.device, "current", self.log)

    def new_stream(self) -> Any:
        return FakeStream(self.device, "comm", self.log)

    def new_event(self) -> Any:
        return SimpleNamespace(record=lambda stream: self.log.append(("event on", stream.name)))

    def use(self, stream: Any) -> Any:
        self.log.append(("use", stream.name))
        return contextlib.nullcontext()

    def keep_alive(self, tensor: Any, stream: Any) -> None:
        self.log.append(("keep alive on", stream.name))


class FakeStream:
    def __init__(self, device: torch.device, name: str, log: list) -> None:
        self.device, self.name, self._log = device, name, log

    def wait_stream(self, other: "FakeStream") -> None:
        self._log.append((f"{self.name} waits for", other.name))

    def wait_event(self, event: Any) -> None:
        self._log.append((f"{self.name} waits for", "event"))


class FakeComm:
    """A communicator of one channel on one device: what was sent or received, and on which stream."""

    disabled = False

    def __init__(self, device: torch.device, log: list) -> None:
        self.device, self.log = device, log

    def send(self, tensor: Any, dst: int, stream: Any = None) -> None:
        self.log.append(("send", dst, stream))

    def recv(self, tensor: Any, src: int, stream: Any = None) -> None:
        self.log.append(("recv", src, stream))

    def destroy(self) -> None:
        pass


def open_pair(gpus: dict[str, str]) -> tuple[dict[str, NcclTransport], dict[str, FakeGpu], list, list]:
    """An FFN on cuda:1 and an attention on cuda:0 (1A1F), opened on one in-memory store; their errors."""
    store, comm_log, errors = HashStore(), [], []
    devices = {"ffn": torch.device("cuda", 1), "attention": torch.device("cuda", 0)}
    fakes = {role: FakeGpu(devices[role], gpus[role]) for role in devices}
    transports = {
        role: NcclTransport(devices[role], lambda uid, rank, size, device: FakeComm(device, comm_log),
                            lambda: bytes(NCCL_UNIQUE_ID_BYTES), gpu=fakes[role], control=NullControl())
        for role in devices
    }

    def run(role: str) -> None:
        try:
            transports[role].open(store, Placement(role, 0, 1, 1), 5.0)
        except Exception as exc:  # noqa: BLE001 - returned to the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(role,)) for role in devices]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    return transports, fakes, comm_log, errors


def test_every_nccl_call_names_the_rank_gpus_stream_never_the_threads_current_one():
    transports, fakes, comm_log, errors = open_pair({"ffn": "GPU-b", "attention": "GPU-a"})
    ffn, cuda_1 = transports["ffn"], torch.device("cuda", 1)
    rows = SimpleNamespace(device=cuda_1)  # a tensor on the FFN's GPU

    ffn.recv(A2F, rows, 1)
    handle = ffn.isend(F2A, rows, 1)
    ffn.send(F2A, rows, 1)
    handle.wait()

    assert errors == []
    recv, isend, send = comm_log[-3:]
    assert [(op, peer) for op, peer, _ in (recv, isend, send)] == [("recv", 1), ("send", 1), ("send", 1)]
    assert [(stream.device, stream.name) for _, _, stream in (recv, isend, send)] == [
        (cuda_1, "current"), (cuda_1, "comm"), (cuda_1, "current")]
    assert isinstance(handle, NcclSend)
    assert fakes["ffn"].log == [("comm waits for", "current"), ("use", "comm"), ("keep alive on", "comm"),
                                ("event on", "comm"), ("current waits for", "event")]


def test_a_tensor_on_another_gpu_is_refused_before_nccl_sees_it():
    transports, _, comm_log, _ = open_pair({"ffn": "GPU-b", "attention": "GPU-a"})
    before = len(comm_log)

    with pytest.raises(ValueError, match="must be on GPU cuda:1 for P2pNcclAFDConnector .got a tensor on cuda:0"):
        transports["ffn"].send(F2A, SimpleNamespace(device=torch.device("cuda", 0)), 1)
    assert len(comm_log) == before


def test_two_ranks_on_one_gpu_are_refused_before_any_communicator():
    _, _, comm_log, errors = open_pair({"ffn": "GPU-a", "attention": "GPU-a"})

    assert len(errors) == 2 and comm_log == []
    assert all("P2pNcclAFDConnector needs a distinct GPU per rank" in str(e) and "node/GPU-a" in str(e)
               for e in errors)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rank_gpu_names_its_device_for_every_stream_on_a_real_gpu():
    """The real ``RankGpu`` under torch's CUDA API, from a fresh thread (communicators are recording fakes)."""
    from vllm_afd.wire.transports.nccl import RankGpu

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    gpu, seen = RankGpu(device), {}

    def on_a_fresh_thread() -> None:
        rows = torch.arange(6, dtype=torch.float32, device=device).reshape(2, 3)
        comm = FakeComm(device, [])
        stream = gpu.new_stream()
        stream.wait_stream(gpu.current_stream())
        with gpu.use(stream):
            comm.send(rows, 1, stream=stream)
            gpu.keep_alive(rows, stream)
            done = gpu.new_event()
            done.record(stream)
        NcclSend(done, gpu).wait()
        torch.cuda.synchronize(device)
        seen.update(thread_device=torch.cuda.current_device(), current=gpu.current_stream().device,
                    comm=stream.device, identity=gpu.identity())

    thread = threading.Thread(target=on_a_fresh_thread)
    thread.start()
    thread.join(60)

    assert seen["current"] == seen["comm"] == device
    assert seen["thread_device"] == 0  # a fresh thread starts on cuda:0, whatever the rank's GPU
    assert seen["identity"].endswith(str(torch.cuda.get_device_properties(device).uuid))
