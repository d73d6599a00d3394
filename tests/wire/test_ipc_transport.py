"""vllm_afd.wire.transports.ipc on CPU: the slot plan, the refusals, open / abort / close with a fake driver.

The driver (CUDA IPC, host registration, stream memory operations) is ``_ipc_sim.FakeDriver``, which
records calls and runs enqueued ops on a simulated device over real memory; the flag protocol under
every interleaving is test_ipc_protocol.py; the real GPU path is tests/connectors/test_ipc_cuda.py.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed import HashStore

from tests.wire._ipc_sim import EXPERTS, HIDDEN, FakeDriver, SimDevice, make_transport, open_all
from vllm_afd.wire.placement import A2F, F2A, Placement
from vllm_afd.wire.transports.cuda_driver import COPY, WAIT, WRITE, CudaDriver
from vllm_afd.wire.transports.cuda_driver import mps_running
from vllm_afd.wire.transports.ipc import IpcTransport
from vllm_afd.wire.transports.records import check_members, ranks_sharing_gpu
from vllm_afd.wire.transports.shm import SHM_DIR
from vllm_afd.wire.transports.slots import (
    ABORT, EMPTY, FLAG_STRIDE, FULL, SLOT_ALIGN, message_row_bytes, plan_slots,
)


def placements(num_attention: int) -> list[Placement]:
    """FFN rank 0 and its attention ranks (one data subgroup), FFN first."""
    return [Placement("ffn", 0, num_attention, 1)] + [Placement("attention", j, num_attention, 1, dp_size=num_attention)
                                                       for j in range(num_attention)]


def shm_files() -> set[str]:
    return {name for name in os.listdir(SHM_DIR) if name.startswith("afd-ipc-")}


# ---- plan -------------------------------------------------------------------------------------------


def test_message_widths_follow_the_gate_placement():
    assert message_row_bytes(128, torch.bfloat16, None) == {A2F: (256,), F2A: (256,)}
    assert message_row_bytes(128, torch.bfloat16, 8) == {A2F: (256, 32), F2A: (256,)}  # logits sized as fp32


@given(st.dictionaries(st.integers(1, 4), st.integers(1, 300), min_size=1),
       st.lists(st.integers(1, 4000), min_size=1, max_size=2), st.integers(1, 4000))
def test_every_slot_holds_its_peers_largest_step_without_overlap(max_rows, a2f_widths, f2a_width):
    row_bytes = {A2F: tuple(a2f_widths), F2A: (f2a_width,)}

    plan = plan_slots(row_bytes, max_rows)

    assert len(plan) == len(max_rows) * (len(a2f_widths) + 1)
    assert sorted(slot.flag for slot in plan) == [FLAG_STRIDE * i for i in range(len(plan))]
    for slot in plan:
        assert slot.limit == slot.rows * row_bytes[slot.channel][slot.position] and slot.rows == max_rows[slot.peer]
        assert slot.limit <= slot.capacity < slot.limit + SLOT_ALIGN
        assert slot.offset % SLOT_ALIGN == 0 and slot.capacity % SLOT_ALIGN == 0
        assert (slot.receiver, slot.sender) == ((0, slot.peer) if slot.channel == A2F else (slot.peer, 0))
    for receiver in {slot.receiver for slot in plan}:
        spans = sorted((s.offset, s.offset + s.capacity) for s in plan if s.receiver == receiver)
        assert spans[0][0] == 0 and all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def test_the_plan_is_the_same_whatever_order_the_peers_were_learnt_in():
    row_bytes = message_row_bytes(HIDDEN, torch.float32, EXPERTS)

    assert plan_slots(row_bytes, {2: 5, 1: 3}) == plan_slots(row_bytes, {1: 3, 2: 5})


# ---- refusals before any resource ---------------------------------------------------------------------


def record(**overrides):
    return {"host": "node", "pid": 1, "gpu": "GPU-0", "max_rows": 4, "problem": None,
            "row_bytes": {"a2f": [32], "f2a": [32]}, **overrides}


@pytest.mark.parametrize("peer, message", [
    (record(host="other"), "needs every rank of a data subgroup on one host (AFD rank 0 on 'node', AFD rank 1 on "
                           "'other'); CUDA IPC does not cross hosts. Use P2pNcclAFDConnector"),
    (record(pid=7), "AFD ranks 0 and 1 are one process (pid 7); CUDA IPC maps memory of another process"),
    ({"problem": "the CUDA driver lacks cuStreamWaitValue32_v2"},
     "AFD rank 1 cannot use CUDA stream memory operations (the CUDA driver lacks cuStreamWaitValue32_v2); expected "
     "a CUDA 11.7+ driver"),
])
def test_a_subgroup_the_transport_cannot_serve_is_refused_with_the_fix(peer, message):
    with pytest.raises(RuntimeError, match=re.escape(message)):
        check_members({0: record(pid=7), 1: peer}, 0)


def test_a_cpu_device_is_refused_by_the_real_driver_before_any_call():
    with pytest.raises(ValueError, match="P2pIpcAFDConnector: device cpu is not an indexed CUDA device; .* Use "
                                         "P2pGlooAFDConnector on CPU"):
        IpcTransport(torch.device("cpu"), row_bytes=message_row_bytes(8, torch.float32, None), max_rows=4)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_rows": 0}, "max_rows must be a positive int, got 0"),
    ({"max_rows": True}, "max_rows must be a positive int, got True"),
    ({"row_bytes": {A2F: (8,)}}, "must give positive bytes per row for 'a2f' and 'f2a'"),
])
def test_bad_sizes_are_refused_at_construction(kwargs, message):
    values = {"row_bytes": message_row_bytes(8, torch.float32, None), "max_rows": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        IpcTransport(torch.device("cuda", 0), driver=FakeDriver(SimDevice(), pid=1), **values)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a CUDA driver")
def test_the_real_driver_names_a_missing_libcuda():
    problem = CudaDriver(torch.device("cuda", 0)).missing_capability()

    assert problem is not None and problem.startswith("libcuda.so.1 cannot be loaded")


@pytest.mark.parametrize("drivers, message", [
    ({"ffn": {"problem": "no V2 memops"}}, "AFD rank 0 cannot use CUDA stream memory operations (no V2 memops)"),
    ({"attention": {"host": "elsewhere"}}, "CUDA IPC does not cross hosts. Use P2pNcclAFDConnector"),
    ({"attention": {"peer_problem": "GPU 0 has no peer access to GPU 1"}},
     "AFD rank 1 cannot write into AFD rank 0's GPU memory: GPU 0 has no peer access to GPU 1. "
     "Use P2pNcclAFDConnector"),
])
def test_open_refuses_on_every_rank_before_taking_anything(drivers, message):
    sim = SimDevice()
    fakes = [FakeDriver(sim, pid=10 + i, **drivers.get(role, {})) for i, role in enumerate(("ffn", "attention"))]
    files_before = shm_files()

    errors = open_all([make_transport(d) for d in fakes], placements(1), HashStore(), timeout_s=5.0)

    assert any(message in str(e) for e in errors if e is not None), errors
    assert all(e is not None for e in errors)  # the peer refuses too (or times out naming the missing rank)
    assert all(not d.live and "alloc" not in d.calls for d in fakes)
    assert shm_files() == files_before


def test_a_peer_that_never_opens_is_named_and_nothing_leaks():
    driver = FakeDriver(SimDevice(), pid=1)

    (error,) = open_all([make_transport(driver)], placements(1)[:1], HashStore(), timeout_s=0.3)

    assert isinstance(error, RuntimeError)
    assert "AFD ranks [1] did not publish their IPC 'who' record" in str(error) and not driver.live


# ---- open, traffic, abort, close ----------------------------------------------------------------------


@pytest.fixture
def opened():
    """One FFN and two attention ranks (gate on attention: two a2f positions), open on a simulated device."""
    sim = SimDevice()
    drivers = [FakeDriver(sim, pid=100 + i) for i in range(3)]
    transports = [make_transport(d, max_rows=4 + i, hold_period_s=0.001) for i, d in enumerate(drivers)]
    files_before = shm_files()
    assert open_all(transports, placements(2), HashStore()) == [None, None, None]
    yield sim, drivers, transports
    for transport in transports:
        transport.close()
    assert all(not d.live for d in drivers)
    assert shm_files() == files_before


def test_open_maps_every_slot_once_and_leaves_nothing_in_dev_shm(opened):
    sim, drivers, transports = opened
    ffn, first, second = transports

    assert sorted(ffn._routes) == [("recv", A2F, 1), ("recv", A2F, 2), ("send", F2A, 1), ("send", F2A, 2)]
    assert sorted(first._routes) == [("recv", F2A, 0), ("send", A2F, 0)] and len(first._routes[("send", A2F, 0)]) == 2
    # The FFN's a2f slots are the ones the attention ranks write; each is sized by its own peer.
    assert [r.pointer for r in ffn._routes[("recv", A2F, 1)]] == [r.pointer for r in first._routes[("send", A2F, 0)]]
    assert ffn._routes[("recv", A2F, 2)][0].slot.rows == second.max_rows
    assert len(ffn._wait_flags) == 4 and len(first._wait_flags) == 1
    assert [d.calls.count("alloc") for d in drivers] == [1, 1, 1]
    assert sorted(k for k, _ in drivers[0].live) == ["alloc", "host", "ipc", "ipc"]


def test_one_exchange_moves_exact_bytes_and_leaves_every_flag_empty(opened):
    sim, drivers, (ffn, first, _) = opened
    hidden, logits = torch.arange(3 * HIDDEN, dtype=torch.float32).view(3, HIDDEN), torch.ones(3, EXPERTS)
    got_hidden, got_logits, out = torch.zeros(3, HIDDEN), torch.zeros(3, EXPERTS), torch.zeros(3, HIDDEN)
    doubled = torch.zeros(3, HIDDEN)

    ffn.recv(A2F, got_hidden, 1)  # the FFN's stream waits first: nothing has been sent yet
    ffn.recv(A2F, got_logits, 1)
    sim.streams[drivers[0].stream].append(lambda: doubled.copy_(got_hidden * 2))  # its "MoE kernel"
    ffn.send(F2A, doubled, 1)
    first.send(A2F, hidden, 0)
    first.send(A2F, logits, 0)
    first.recv(F2A, out, 0)

    assert sim.drain()
    assert torch.equal(got_hidden, hidden) and torch.equal(got_logits, logits) and torch.equal(out, hidden * 2)
    assert all(ffn._flags.read(i) == EMPTY for i in range(0, 8 * FLAG_STRIDE, FLAG_STRIDE))


def test_a_message_larger_than_its_slot_or_off_device_is_refused_before_anything_is_enqueued(opened):
    _, drivers, (_, first, _) = opened

    with pytest.raises(ValueError, match=r"Too many bytes for the a2f slot: 192 \(\[6, 8\] torch.float32\). The max "
                                         r"is 160 \(5 rows, the attention rank's max_rows\)"):
        first.send(A2F, torch.zeros(6, HIDDEN), 0)  # attention rank 0 published max_rows 5; its slot is 256 B
    with pytest.raises(ValueError, match="got a non-contiguous tensor on cpu; expected a contiguous tensor"):
        first.send(A2F, torch.zeros(HIDDEN, 2).t(), 0)
    with pytest.raises(RuntimeError, match=r"no f2a slot to send to group rank 0 \(slots: \[\('recv', 'f2a', 0\)"):
        first.send(F2A, torch.zeros(1, HIDDEN), 0)
    assert "enqueue" not in drivers[1].calls


def test_abort_releases_every_wait_and_keeps_releasing_until_close(opened):
    sim, drivers, (ffn, first, _) = opened
    out = torch.zeros(2, HIDDEN)
    for _ in range(3):  # three layers' receives queued behind a peer that never answers
        first.recv(F2A, out, 0)
    assert not sim.drain()

    first.abort()

    assert all(first._flags.read(i) == ABORT for i in first._wait_flags)
    assert sim.drain(release=[first.release_waits])  # each released wait resets its flag; the holder re-arms it
    assert first._holder is not None and first._holder.is_alive()
    assert all(ffn._flags.read(i) == EMPTY for i in ffn._wait_flags)  # the FFN's own waits are its business


def test_close_releases_pending_waits_drains_and_frees_once(opened):
    sim, drivers, (ffn, _, _) = opened
    pending = torch.zeros(1, HIDDEN)
    ffn.recv(A2F, pending, 1)

    ffn.close()
    ffn.close()

    assert drivers[0].calls.count("synchronize") == 1 and not drivers[0].live
    assert ffn._holder is not None and not ffn._holder.is_alive()
    with pytest.raises(RuntimeError, match="no a2f slot to recv from group rank 1"):
        ffn.recv(A2F, torch.zeros(1, HIDDEN), 1)
    ffn.abort()  # the failure latch may still fire after close: harmless


def test_ops_are_the_documented_protocol(opened):
    sim, drivers, (ffn, first, _) = opened
    sent, received = torch.ones(1, HIDDEN), torch.zeros(1, HIDDEN)  # alive until the simulated device ran

    first.send(A2F, sent, 0)
    ffn.recv(A2F, received, 1)

    (copy, write), (wait, copy_out, reset) = sim.streams[drivers[1].stream], sim.streams[drivers[0].stream]
    assert (copy.kind, write.kind, write.value) == (COPY, WRITE, FULL)
    assert (wait.kind, wait.value, copy_out.kind, reset.kind, reset.value) == (WAIT, FULL, COPY, WRITE, EMPTY)
    # Each process maps the flag page at its own address; the offsets agree.
    assert wait.dst == reset.dst and wait.dst - ffn._flags.address == write.dst - first._flags.address
    assert copy.dst == copy_out.src
    assert sim.drain() and torch.equal(received, sent)


def test_ranks_on_one_gpu_are_named_and_mps_is_found_by_its_control_pipe(tmp_path, monkeypatch):
    records = {0: {"gpu": "GPU-a"}, 1: {"gpu": "GPU-a"}, 2: {"gpu": "GPU-b"}, 3: {"gpu": "GPU-a"}}
    assert ranks_sharing_gpu(records, 0) == [1, 3] and ranks_sharing_gpu(records, 2) == []

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert not mps_running()
    (tmp_path / "control").write_text("")
    assert mps_running()
