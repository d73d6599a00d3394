"""The device clock and the no-sync paths on a real GPU (docs/timeline.md).

Marked ``gpu``; skipped where CUDA is absent (CI); run by the device run's ``gputests`` phase.
``torch.cuda.set_sync_debug_mode("error")`` turns every host synchronisation torch makes into an
error, so the paths AFD promises to be sync-free are checked by torch itself.
"""

from __future__ import annotations

import pytest
import torch

from vllm_afd.wire.clocks import DeviceClock

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def read_when_done(clock: DeviceClock, ticket) -> list[int]:
    torch.cuda.synchronize()
    stamps = clock.read(ticket)
    assert stamps is not None
    return stamps


def test_eager_stamps_follow_the_stream_without_a_host_sync():
    clock = DeviceClock(8, torch.device("cuda"))
    clock.stamp(0)  # compiles the kernel (outside the sync check)
    x = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()

    torch.cuda.set_sync_debug_mode("error")
    try:
        clock.stamp(0)
        y = x @ x  # work between the stamps: the second stamp is later by its duration
        clock.stamp(1)
        ticket = clock.seal(2)
        assert clock.read(ticket) is None or True  # never waits, whatever the device's progress
    finally:
        torch.cuda.set_sync_debug_mode("default")
    first, second = read_when_done(clock, ticket)
    assert 0 < first < second
    assert y.shape == (2048, 2048)


@torch.inference_mode()
def test_pooled_host_buffers_serve_steps_of_any_length():
    """A split step stamps more slots than a whole one; inference-mode views have no `_base` to pool by."""
    clock = DeviceClock(8, torch.device("cuda"))
    lengths = [2, 8, 3, 8]

    for num_slots in lengths:
        for slot in range(num_slots):
            clock.stamp(slot)
        assert len(read_when_done(clock, clock.seal(num_slots))) == num_slots


def test_a_captured_graph_stamps_its_slots_at_every_replay():
    clock = DeviceClock(4, torch.device("cuda"))
    x = torch.randn(1024, 1024, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles the kernel) off the capture
        clock.stamp(0)
        x @ x
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        clock.stamp(0)
        y = x @ x
        clock.stamp(1)

    replays = []
    for _ in range(2):
        graph.replay()
        replays.append(read_when_done(clock, clock.seal(2)))
    (a0, a1), (b0, b1) = replays
    assert 0 < a0 < a1 < b0 < b1  # each replay wrote fresh, ordered stamps into the same slots
    assert y.shape == (1024, 1024)


def test_the_gloo_transport_receives_into_a_gpu_tensor_without_a_host_sync():
    """Pinned staging + a non-blocking copy: the receive does not wait for the GPU (the send must)."""
    import threading

    from tests.wire._gloo_pair import open_gloo_pair

    ffn, attention = open_gloo_pair(torch.device("cuda"))
    try:
        sent = torch.arange(64, dtype=torch.float32, device="cuda").reshape(4, 16)
        received = torch.empty_like(sent)
        sender = threading.Thread(target=attention.send, args=("a2f", sent, 0))
        sender.start()
        torch.cuda.set_sync_debug_mode("error")
        try:
            ffn.recv("a2f", received, 1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        sender.join(30)
        torch.cuda.synchronize()
        assert torch.equal(received, sent)
        assert (ffn.host_syncs, attention.host_syncs) == (0, 1)
    finally:
        ffn.close()
        attention.close()
