"""Healing with an FFN pool on CPU (docs/connection.md#re-forming, docs/failures.md, decision 48).

The smallest pool that proves it: two FFN DP ranks with vLLM's expert parallelism (`--data-parallel-size 2
--enable-expert-parallel`) behind an attention of two ranks, every server in float32 (tests/e2e/test_afd_pool.py
says why), tokens compared with a plain float32 vLLM.

1. The attention is killed mid-stream and restarted: both FFN DP ranks leave the step together, re-form together
   and pair with the new attention, the FFN server never restarts; with attention DP 2 (the layout of
   tests/e2e/test_afd_pool.py) and with attention TP 2.
2. The FFN server is killed mid-stream (vLLM cannot replace one of its DP ranks: decision 48) and restarted: the
   same attention answers 503 meanwhile and serves plain vLLM's tokens again by itself.  Under attention TP 2:
   an attention whose DP ranks share one `vllm serve` does not heal (vLLM's fault tolerance refuses its internal
   DP load balancer, `validation.healing_blocker`).
"""

from __future__ import annotations

import re
import threading

import pytest
import requests

from afd_harness.afd import AFDDeployment
from afd_harness.metrics import scrape_ranks, wait_for
from afd_harness.server import GreedyTokens, greedy_tokens

pytestmark = pytest.mark.e2e

PROMPTS = ["Hello, my name is", "The capital of France is", "In a shocking finding,"]  # the streams' prompts
STREAM_TOKENS = 400
FLOAT32 = ["--dtype", "float32"]


def ffn_dp_pool(model_dir, python: str, log_dir, attention_parallel: list[str]) -> AFDDeployment:
    """Two attention ranks (`attention_parallel`: DP 2 or TP 2) on FFN DP 2 + EP, float32, re-forming on."""
    return AFDDeployment(model_dir, python=python, log_dir=log_dir,
                         afd_fields={"num_attention_ranks": 2, "num_ffn_ranks": 2, "step_timeout_s": 60,
                                     "reform_timeout_s": 300},
                         attention_args=[*attention_parallel, *FLOAT32],
                         ffn_args=["--data-parallel-size", "2", "--enable-expert-parallel", *FLOAT32],
                         attention_cpus="1|1", ffn_cpus="0|0")


@pytest.fixture(scope="module")
def pool(tiny_model_dir, vllm_python, tmp_path_factory, plain_float32):
    afd = ffn_dp_pool(tiny_model_dir("qwen3_moe"), vllm_python, tmp_path_factory.mktemp("pool"),
                      ["--tensor-parallel-size", "2"])
    with afd:
        assert greedy_tokens(afd.attention.base_url, plain_float32.prompts, plain_float32.max_tokens) == plain_float32
        yield afd


def stream(base_url: str, model: str, ended: list, chunks: list, index: int) -> None:
    """A long greedy stream counting its chunks; records how it ended: "ended" (all its tokens) or "broken"."""
    body = {"model": model, "prompt": PROMPTS[index], "max_tokens": STREAM_TOKENS, "ignore_eos": True,
            "stream": True, "temperature": 0}
    try:
        with requests.post(f"{base_url}/v1/completions", json=body, stream=True, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith(b"data: {") and b'"error"' not in line:
                    chunks[index] += 1
        ended[index] = "ended" if chunks[index] >= STREAM_TOKENS else "broken"
    except requests.RequestException:
        ended[index] = "broken"


def kill_mid_stream(afd: AFDDeployment, server) -> list:
    """Kill ``server`` while three streams decode (gated on their first chunks); how each stream ended."""
    ended, chunks = [None] * 3, [0] * 3
    threads = [threading.Thread(target=stream, args=(afd.attention.base_url, str(afd.model), ended, chunks, i),
                                daemon=True) for i in range(3)]
    for thread in threads:
        thread.start()
    assert wait_for(lambda: min(chunks) > 0, timeout_s=120.0), (ended, chunks)
    server.kill()
    for thread in threads:
        thread.join(60)
    return ended


def restart_attention_under_the_pool(afd: AFDDeployment, plain_float32: GreedyTokens) -> None:
    """Kill the attention mid-stream, restart it: both FFN DP ranks re-form, the FFN server never restarts."""
    ffn_pid = afd.ffn.process.pid

    ended = kill_mid_stream(afd, afd.attention)
    waiting = wait_for(lambda: all(f"AFD ffn rank {rank}: lost the attention" in afd.ffn.log_path.read_text()
                                   for rank in (0, 1)), timeout_s=120.0)
    afd.attention.start()
    tokens = greedy_tokens(afd.attention.base_url, plain_float32.prompts, plain_float32.max_tokens)
    log = afd.ffn.log_path.read_text()

    assert "broken" in ended, ended
    assert waiting, afd.ffn.log_tail()
    assert afd.ffn.process.pid == ffn_pid and afd.ffn.process.poll() is None
    assert tokens == plain_float32
    for rank in (0, 1):
        paired = re.search(rf"AFD ffn rank {rank}: paired again with attention ranks \[{rank}\]", log)
        assert paired, afd.ffn.log_tail()
    assert "AFD FFN worker loop failed" not in log, afd.ffn.log_tail()


def test_attention_dp2_killed_mid_stream_then_restarted_pairs_with_the_whole_running_pool(
        tiny_model_dir, vllm_python, tmp_path, plain_float32):
    """2A2F (attention DP 2 on FFN DP 2 + EP), the stage-free control of tests/e2e/test_afd_pool.py: plain tokens
    and both FFN ranks' compute on /metrics first, then the re-forming; first in the file, so its deployment is
    gone before the module's `pool` starts."""
    afd = ffn_dp_pool(tiny_model_dir("qwen3_moe"), vllm_python, tmp_path, ["--data-parallel-size", "2"])
    with afd:
        served = greedy_tokens(afd.attention.base_url, plain_float32.prompts, plain_float32.max_tokens)
        computed = [("afd_ffn_compute_seconds_count", "ffn", rank) for rank in "01"]
        moved = wait_for(lambda: all(scrape_ranks(afd.ffn.base_url).get(key, 0) > 0 for key in computed))
        page = scrape_ranks(afd.ffn.base_url)
        assert served == plain_float32
        assert moved and all(page[("afd_peer_up", "ffn", rank)] == 1.0 for rank in "01"), page
        restart_attention_under_the_pool(afd, plain_float32)


def test_attention_killed_mid_stream_then_restarted_pairs_with_the_whole_running_pool(pool, plain_float32):
    restart_attention_under_the_pool(pool, plain_float32)


def test_ffn_pool_killed_mid_stream_then_restarted_under_the_same_attention(pool, plain_float32):
    base_url, attention_pid = pool.attention.base_url, pool.attention.process.pid

    ended = kill_mid_stream(pool, pool.ffn)
    refused: list = []

    def answers_503() -> bool:
        response = requests.post(f"{base_url}/v1/completions", timeout=30,
                                 json={"model": str(pool.model), "prompt": PROMPTS[0], "max_tokens": 4})
        refused[:] = [response.status_code, response.text]
        return response.status_code == 503

    outage = wait_for(answers_503, timeout_s=60.0)
    pool.ffn.start()  # the FFN's supervisor restarts the whole FFN server; nobody touches the attention
    serving = wait_for(lambda: requests.post(
        f"{base_url}/v1/completions", timeout=30,
        json={"model": str(pool.model), "prompt": PROMPTS[0], "max_tokens": 1}).status_code == 200, timeout_s=180.0)
    tokens = greedy_tokens(base_url, plain_float32.prompts, plain_float32.max_tokens) if serving else None
    log = pool.attention.log_path.read_text()

    assert "broken" in ended, ended
    assert outage, refused
    assert "AFD attention server unavailable: its FFN peer was lost" in refused[1], refused
    assert serving, pool.attention.log_tail()
    assert pool.attention.process.pid == attention_pid and pool.attention.process.poll() is None
    assert tokens == plain_float32
    for rank in (0, 1):
        assert re.search(rf"AFD attention rank {rank}: paired again with FFN ranks \[{rank}\]", log), \
            pool.attention.log_tail()

