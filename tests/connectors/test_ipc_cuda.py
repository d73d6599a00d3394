"""P2pIpcAFDConnector on a real GPU: two processes on cuda:0 through real AFDConnectors (docs/protocol.md#transports).

Marked ``gpu``; skipped where CUDA is absent (CI). What the CPU tests cannot show: the driver's
stream memory operations and a host store releasing a device wait, exact values eager and inside
CUDA graphs captured and replayed on both sides, and a peer killed mid-step ending in the sticky
error instead of a hang. The gputests phase of scripts/device/gpu_e2e.py runs this file.
"""

from __future__ import annotations

import pytest
import torch
from tests.connectors._harness import expect_ok, free_port
from tests.connectors._ipc_scenarios import driver_on_this_gpu, eager_then_graphs, peer_dies_mid_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_the_driver_supports_the_transport_and_a_host_store_releases_a_device_wait(pool):
    (result,) = expect_ok(pool.run(driver_on_this_gpu, [()], timeout_s=120.0))

    assert result["problem"] is None and result["same_gpu_peer"] is None
    assert result["before"] == (7, 0)  # the wait held the stream
    assert result["after"] == 9  # ABORT, stored from the host, let it go


@pytest.mark.parametrize("gate", [False, True], ids=["gate-on-ffn", "gate-on-attention"])
def test_exact_values_eager_and_in_cuda_graphs_replayed_on_both_sides(pool, gate):
    port = free_port()

    _, attention = expect_ok(pool.run(eager_then_graphs, [(role, port, gate) for role in ("ffn", "attention")],
                                      timeout_s=240.0))

    assert attention["eager"] == [True, True, True]
    assert attention["replays"] == [True, True, True]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs of one node")
def test_exact_values_between_peer_gpus_eager_and_in_cuda_graphs(pool):
    """The FFN on cuda:1, the attention on cuda:0: each opens a handle made on the other GPU."""
    port = free_port()

    _, attention = expect_ok(pool.run(eager_then_graphs, [(role, port, True, 3, 1) for role in ("ffn", "attention")],
                                      timeout_s=240.0))

    assert attention["eager"] == [True, True, True]
    assert attention["replays"] == [True, True, True]


def test_a_peer_killed_mid_step_ends_in_the_sticky_error_within_the_peer_timeout(pool):
    port = free_port()

    ffn, attention = pool.run(peer_dies_mid_step, [("ffn", port), ("attention", port)], timeout_s=120.0)

    assert ffn == ("exit", 3)
    status, result = attention
    assert status == "ok", result
    assert result["error"] is not None and result["error"].startswith("AFDPeerLostError: AFD peer lost")
    assert result["elapsed_s"] < 10.0  # released by the abort, not by a timeout of the test
    assert result["sticky"] == "AFDPeerLostError"
