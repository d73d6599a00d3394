"""AFD micro-batch stages on CPU end to end (docs/pingpong.md, issue 13): greedy tokens equal plain vLLM.

One deployment per stage count (2 and 3) on the tiny Qwen3-MoE, each answering every request shape
of `stage_outputs` (two server starts each); the plain tokens come from the session's plain server
(`plain_outputs`, conftest.py). Shapes: batch 1 (always one stage), odd batches (3 and 5 prompts:
the prefill step splits inside a prompt, decode steps split 1+2, 2+3, 1+1+1, 1+1+3), and a mixed
step (prefills of new requests joining a running decode). The attention's log proves the stages ran.
"""

from __future__ import annotations

import json
import threading

import pytest
import requests

from afd_harness.afd import AFDDeployment
from afd_harness.server import complete, complete_batch

pytestmark = pytest.mark.e2e

PROMPTS = ["Hello, my name is", "The capital of France is", "In a shocking finding,",
           "1 2 3 4 5", "The experts said"]
MAX_TOKENS = 10
STAGES_RAN = "running steps as {} micro-batch stages"


def stage_outputs(base_url: str) -> dict[str, list]:
    """Token ids of each request shape; the mixed shape sends a batch while a long request decodes."""
    one = complete(base_url, PROMPTS[0], MAX_TOKENS)
    five = complete_batch(base_url, PROMPTS, MAX_TOKENS)
    three = complete_batch(base_url, PROMPTS[2:], MAX_TOKENS)
    streamed: list = []
    first_token = threading.Event()

    def long_request() -> None:
        body = {"prompt": PROMPTS[1], "max_tokens": 3 * MAX_TOKENS, "temperature": 0.0, "stream": True}
        text = []
        with requests.post(f"{base_url}/v1/completions", json=body, stream=True, timeout=300) as response:
            response.raise_for_status()
            for line in response.iter_lines(decode_unicode=True):
                if line and line.startswith("data: ") and line != "data: [DONE]":
                    text.append(json.loads(line[6:])["choices"][0]["text"])
                    first_token.set()
        first_token.set()
        streamed.append("".join(text))

    runner = threading.Thread(target=long_request)
    runner.start()
    first_token.wait(120)  # bounded; a request that never streams fails the comparison below
    joined = complete_batch(base_url, PROMPTS[2:], MAX_TOKENS)  # prefills beside the running decode
    runner.join(120)
    return {"one": [one.token_ids], "five": [g.token_ids for g in five], "three": [g.token_ids for g in three],
            "mixed": [streamed[0] if streamed else None, [g.token_ids for g in joined]]}


PLAIN_REQUESTS = (stage_outputs,)  # answered by the session's plain server (conftest.py)


@pytest.fixture(scope="module")
def plain(plain_outputs):
    return plain_outputs("qwen3_moe", stage_outputs)


@pytest.mark.parametrize("num_stages", [2, 3])
def test_staged_tokens_equal_plain_vllm_for_every_request_shape(plain, num_stages, tiny_model_dir, vllm_python,
                                                                tmp_path):
    from afd_harness.tiny_models import serve_env

    model = tiny_model_dir("qwen3_moe")
    with AFDDeployment(model, python=vllm_python, log_dir=tmp_path, env=serve_env(model),
                       afd_fields={"num_stages": num_stages}) as afd:
        outputs = stage_outputs(afd.attention.base_url)
        log = afd.attention.log_path.read_text()

    assert plain["mixed"][0], "the long request streamed nothing on plain vLLM"
    assert outputs == plain
    assert STAGES_RAN.format(num_stages) in log, f"the attention never split a step ({afd.attention.log_path})"
