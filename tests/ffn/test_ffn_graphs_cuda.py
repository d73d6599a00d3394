"""FFNGraphCache on a real GPU: capture under vLLM's `graph_capture`, replay, replace, clear
(docs/ffn.md#run-mode-and-graph-key).

Marked ``gpu``; skipped where CUDA is absent (CI).  The FFN's own graphs hold the connector's
send/recv, which needs NCCL and so two GPUs; here the recorded step is plain device work, which is
what the cache itself owns: the key, the shared memory pool, the recorded output, the replacement
of a key when vLLM's memory profiling captures before the real capture.
"""

from __future__ import annotations

import socket

import pytest
import torch

from vllm_afd.ffn.graphs import FFNGraphCache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def vllm_groups():
    """vLLM's world/TP/PP groups for one rank (gloo: no NCCL needed), as `graph_capture` wants them."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.cuda.set_device(0)
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=0, backend="gloo")
        ensure_model_parallel_initialized(1, 1)
        yield torch.device("cuda", 0)
        destroy_model_parallel()
        destroy_distributed_environment()


def test_replay_recomputes_from_the_static_input_and_keys_stay_apart(vllm_groups):
    device = vllm_groups
    cache = FFNGraphCache(device)
    weight = torch.randn(64, 64, device=device)
    rows_4 = torch.zeros(4, 64, device=device)
    rows_8 = torch.zeros(8, 64, device=device)
    key_4, key_8 = ((0, (4,)),), ((0, (8,)),)

    forward_4, forward_8 = (lambda: torch.relu(rows_4 @ weight)), (lambda: torch.relu(rows_8 @ weight) * 2)
    # NOTE: as in serving, a warm-up payload runs the step eagerly before its capture payload
    # (cuBLAS creates its handle on first use, which a capture cannot record).
    forward_4(), forward_8()
    cache.capture(key_4, forward_4)
    cache.capture(key_8, forward_8)
    rows_4.copy_(torch.randn(4, 64, device=device))
    rows_8.copy_(torch.randn(8, 64, device=device))

    out_4 = cache.replay(key_4).clone()
    out_8 = cache.replay(key_8).clone()
    torch.cuda.synchronize()
    assert cache.has(key_4) and cache.has(key_8) and not cache.has(((0, (2,)),))
    torch.testing.assert_close(out_4, torch.relu(rows_4 @ weight))
    torch.testing.assert_close(out_8, torch.relu(rows_8 @ weight) * 2)


def test_a_second_capture_of_a_key_replaces_the_first_and_clear_drops_all(vllm_groups):
    device = vllm_groups
    cache = FFNGraphCache(device)
    rows = torch.ones(2, 16, device=device)
    key = ((0, (1, 1)),)

    cache.capture(key, lambda: rows + 1)  # vLLM's memory profiling captures first
    cache.capture(key, lambda: rows * 3)  # then the real capture of the same key
    rows.fill_(5.0)

    out = cache.replay(key)
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full((2, 16), 15.0, device=device))
    cache.clear()
    assert not cache.has(key)
    with pytest.raises(KeyError):
        cache.replay(key)
