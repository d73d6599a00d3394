"""Connector paths that need a GPU (docs/connection.md): gloo staging of CUDA tensors, NCCL's one-GPU refusal,
NCCL between two GPUs.

Marked ``gpu``; skipped where CUDA is absent (CI). In the first two both ranks share cuda:0, as when both
roles run on one GPU: gloo must work there, NCCL must refuse with the fix. The last needs two GPUs: the
NCCL communicators built from the unique id exchanged as raw bytes (docs/connection.md#store-values).
"""

from __future__ import annotations

import pytest
import torch
from tests.connectors._harness import expect_ok, free_port
from tests.connectors._nccl_scenarios import exchange_on_two_gpus
from tests.connectors._scenarios import exchange, nccl_on_one_gpu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_gloo_stages_cuda_tensors_through_host_memory(pool):
    port = free_port()
    arg_lists = [(role, 0, 1, 1, port, "bfloat16", 3, True, 1, False, 1, "cuda:0") for role in ("ffn", "attention")]

    ffn, _ = expect_ok(pool.run(exchange, arg_lists, timeout_s=120.0))

    assert [p["step_seq"] for p in ffn["payloads"]] == [0, 1, 2]


def test_nccl_refuses_two_ranks_on_one_gpu_naming_the_fix(pool):
    port = free_port()

    messages = expect_ok(pool.run(nccl_on_one_gpu, [("ffn", 0, port), ("attention", 0, port)], timeout_s=120.0))

    for message in messages:
        assert message.startswith("P2pNcclAFDConnector needs a distinct GPU per rank; use P2pGlooAFDConnector to "
                                  "run both roles on one GPU (AFD ranks ")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs: NCCL refuses two ranks on one")
def test_nccl_exchanges_exact_values_between_two_gpus(pool):
    port = free_port()

    _, attention = expect_ok(pool.run(exchange_on_two_gpus, [("ffn", port), ("attention", port)], timeout_s=180.0))

    assert attention["exact"] == [True, True, True]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs: NCCL refuses two ranks on one")
def test_nccl_on_cuda_1_from_a_thread_that_never_set_a_device(pool):
    """As the FFN loop's thread (it starts on cuda:0): every NCCL call must still run on the rank's cuda:1."""
    port = free_port()

    _, attention = expect_ok(pool.run(exchange_on_two_gpus, [("ffn", port, 3, True), ("attention", port, 3, True)],
                                      timeout_s=180.0))

    assert attention["exact"] == [True, True, True]
