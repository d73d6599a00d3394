"""Integrity mode end to end on CPU (docs/protocol.md#integrity-mode): both roles with ``"integrity": true``
seal and check every data message, and the greedy tokens still equal plain vLLM's."""

from __future__ import annotations

import pytest

from afd_harness.afd import AFDDeployment
from afd_harness.server import complete_batch

pytestmark = pytest.mark.e2e

PROMPTS = ["Hello, my name is", "The capital of France is", "1 2 3 4 5"]
MAX_TOKENS = 8


def batched_tokens(base_url: str) -> list[list[int]]:
    return [g.token_ids for g in complete_batch(base_url, PROMPTS, MAX_TOKENS)]


PLAIN_REQUESTS = (batched_tokens,)  # answered by the session's plain server (conftest.py)


def test_sealed_exchanges_give_plain_vllms_tokens(tiny_model_dir, vllm_python, tmp_path, plain_outputs):
    from afd_harness.tiny_models import serve_env

    model = tiny_model_dir("qwen3_moe")
    afd = AFDDeployment(model, python=vllm_python, log_dir=tmp_path, env=serve_env(model),
                        afd_fields={"integrity": True})

    with afd:
        tokens = batched_tokens(afd.attention.base_url)
        logs = [server.log_path.read_text() for server in afd.servers]

    assert tokens == plain_outputs("qwen3_moe", batched_tokens)
    assert not any("integrity seal" in log for log in logs)
