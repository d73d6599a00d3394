"""The FFN pool on CPU: two FFN ranks behind two attention ranks (2A2F), end to end through `vllm serve`.

FFN tensor parallelism: attention TP 2 on FFN TP 2, the symmetric layout of the layout rule
(docs/topology.md#layout-rule): every FFN TP peer receives the same tokens.

FFN data parallelism with vLLM's own expert parallelism (docs/ffn.md#ffn-data-parallelism, docs/topology.md):
the FFN server runs `--data-parallel-size 2 --enable-expert-parallel`, each FFN DP rank holds half the
experts and vLLM's all-gather / reduce-scatter (patches `cpu-communicator-add-gatherv`,
`cpu-moe-honour-expert-map`) run among them with DP metadata built from the attention's counts.

Every server runs in float32: expert parallelism sums the experts' outputs in another order than one rank
does, and in bfloat16 a near tie can flip a greedy token (seen on the 4th prompt); in float32 the orders
agree to ~1e-7 and the tokens are plain vLLM's. The baseline is a plain float32 server of the same model.
"""

from __future__ import annotations

import pytest

from afd_harness.afd import AFDDeployment
from afd_harness.metrics import scrape_ranks, wait_for
from afd_harness.server import complete, complete_batch

pytestmark = pytest.mark.e2e

PROMPTS = ["Hello, my name is", "The capital of France is", "In a shocking finding,",
           "1 2 3 4 5", "The experts said"]
MAX_TOKENS = 12
FLOAT32 = ["--dtype", "float32"]


@pytest.fixture(scope="module")
def plain_float32(tiny_model_dir, vllm_server_factory):
    """Plain vLLM's float32 tokens: (the prompts batched, the first two one by one)."""
    plain = vllm_server_factory(tiny_model_dir("qwen3_moe"), launcher="cli", extra_args=FLOAT32)
    try:
        return ([g.token_ids for g in complete_batch(plain.base_url, PROMPTS, MAX_TOKENS)],
                [complete(plain.base_url, p, MAX_TOKENS).token_ids for p in PROMPTS[:2]])
    finally:
        plain.stop()


def serve_and_compare(afd: AFDDeployment, plain: tuple) -> dict:
    """The deployment's tokens against plain vLLM's, then its FFN's /metrics page (both FFN ranks crossed)."""
    with afd:
        batched = [g.token_ids for g in complete_batch(afd.attention.base_url, PROMPTS, MAX_TOKENS)]
        one_by_one = [complete(afd.attention.base_url, p, MAX_TOKENS).token_ids for p in PROMPTS[:2]]
        computed = [("afd_ffn_compute_seconds_count", "ffn", rank) for rank in "01"]
        moved = wait_for(lambda: all(scrape_ranks(afd.ffn.base_url).get(key, 0) > 0 for key in computed))
        page = scrape_ranks(afd.ffn.base_url)
        ffn_log = afd.ffn.log_path.read_text()
    assert (batched, one_by_one) == plain
    assert moved, page
    assert all(page[("afd_peer_up", "ffn", rank)] == 1.0 for rank in "01"), page
    assert "Traceback" not in ffn_log, ffn_log[-4000:]
    return page


def test_two_attention_dp_ranks_on_two_ffn_dp_ranks_with_expert_parallelism(tiny_model_dir, vllm_python, tmp_path,
                                                                           plain_float32):
    # NOTE: reform_timeout_s 0: an FFN DP rank cannot re-form alone yet (docs/decisions.md, FFN DP entry).
    afd = AFDDeployment(tiny_model_dir("qwen3_moe"), python=vllm_python, log_dir=tmp_path,
                        afd_fields={"num_attention_ranks": 2, "num_ffn_ranks": 2, "reform_timeout_s": 0,
                                    "step_timeout_s": 60},
                        attention_args=["--data-parallel-size", "2", *FLOAT32],
                        ffn_args=["--data-parallel-size", "2", "--enable-expert-parallel", *FLOAT32],
                        attention_cpus="1|1", ffn_cpus="0|0")
    serve_and_compare(afd, plain_float32)


def test_attention_tp2_on_ffn_tp2(tiny_model_dir, vllm_python, tmp_path, plain_float32):
    afd = AFDDeployment(tiny_model_dir("qwen3_moe"), python=vllm_python, log_dir=tmp_path,
                        afd_fields={"num_attention_ranks": 2, "num_ffn_ranks": 2, "step_timeout_s": 60},
                        attention_args=["--tensor-parallel-size", "2", *FLOAT32],
                        ffn_args=["--tensor-parallel-size", "2", *FLOAT32],
                        attention_cpus="1|1", ffn_cpus="0|0")
    serve_and_compare(afd, plain_float32)
