"""Connector paths that need a GPU (docs/connection.md): gloo staging of CUDA tensors, NCCL's one-GPU refusal.

Marked ``gpu``; skipped where CUDA is absent (CI). Both ranks share cuda:0, as when both roles run on
one GPU: gloo must work there, NCCL must refuse with the fix.
"""

from __future__ import annotations

import pytest
import torch
from tests.connectors._harness import expect_ok, free_port
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
