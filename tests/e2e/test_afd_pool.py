"""The FFN pool on CPU, end to end through `vllm serve`: several FFN ranks behind several attention ranks.

FFN tensor parallelism: attention TP 2 on FFN TP 2, the symmetric layout of the layout rule
(docs/topology.md#layout-rule): every FFN TP peer receives the same tokens.

FFN data parallelism with vLLM's own expert parallelism (docs/ffn.md#ffn-data-parallelism, docs/topology.md):
the FFN server runs `--data-parallel-size 2 --enable-expert-parallel`, each FFN DP rank holds half the
experts and vLLM's all-gather / reduce-scatter (patches `cpu-communicator-add-gatherv`,
`cpu-moe-honour-expert-map`) run among them with DP metadata built from the attention's counts.  Here 3A2F,
the cheapest uneven layout (docs/topology.md#row-counts): FFN DP rank 0 serves attention ranks 0 and 1, FFN DP
rank 1 serves attention rank 2, so the FFN DP counts (`ffn_dp_counts`) differ between the two ranks in every
step and vLLM's gatherv sizes differ per rank.  2A2F (one attention DP rank per FFN DP rank, no stages: the
control that tells a pool fault from a stage fault) runs in tests/e2e/test_afd_pool_healing.py, whose first
case checks its tokens and both FFN ranks' metrics before it kills and restarts the attention.

3A2F also runs `num_stages` 2, the one place micro-batch stages meet FFN DP > 1: every FFN DP rank then
runs each (layer, stage) MoE collective with that stage's counts (`Stage.dp_counts`).  Folded in rather than
a deployment of its own, since a deployment's start dominates the cost and the same requests exercise both
shapes: its batch is the prompts twice, 10 requests that vLLM's DP load balancer spreads 4 + 3 + 3, so all
three attention DP ranks want to split their steps and vLLM's DP vote splits them (min_tokens_per_stage 1),
while the one-by-one requests leave two ranks idle and keep steps whole; the attention's log proves a split
ran.

Every server runs in float32: expert parallelism sums the experts' outputs in another order than one rank
does, and in bfloat16 a near tie can flip a greedy token (seen on the 4th prompt); in float32 the orders
agree to ~1e-7 and the tokens are plain vLLM's. The baseline is the session's one plain float32 server of the
same model (conftest `plain_float32`), shared by every pool module: in float32 no greedy token of these
prompts depends on what else is in the batch (the DP layouts batch differently from plain vLLM already), so
the doubled batch is compared with the plain batch twice.
"""

from __future__ import annotations

import pytest

from afd_harness.afd import AFDDeployment
from afd_harness.metrics import scrape_ranks, wait_for
from afd_harness.server import GreedyTokens, greedy_tokens

pytestmark = pytest.mark.e2e

FLOAT32 = ["--dtype", "float32"]
STAGES_RAN = "running steps as 2 micro-batch stages"


def serve_and_compare(afd: AFDDeployment, plain: GreedyTokens, copies: int = 1) -> dict:
    """The deployment's tokens against plain vLLM's, then its FFN's /metrics page (both FFN ranks crossed).

    `copies` > 1 sends the prompts that many times in one batch (each answer is still plain's)."""
    with afd:
        served = greedy_tokens(afd.attention.base_url, plain.prompts * copies, plain.max_tokens)
        computed = [("afd_ffn_compute_seconds_count", "ffn", rank) for rank in "01"]
        moved = wait_for(lambda: all(scrape_ranks(afd.ffn.base_url).get(key, 0) > 0 for key in computed))
        page = scrape_ranks(afd.ffn.base_url)
        ffn_log = afd.ffn.log_path.read_text()
    assert served.batched == plain.batched * copies and served.one_by_one == plain.one_by_one, served
    assert moved, page
    assert all(page[("afd_peer_up", "ffn", rank)] == 1.0 for rank in "01"), page
    assert "Traceback" not in ffn_log, ffn_log[-4000:]
    return page


def test_three_attention_dp_ranks_on_two_ffn_dp_ranks_in_two_stages(tiny_model_dir, vllm_python, tmp_path,
                                                                    plain_float32):
    afd = AFDDeployment(tiny_model_dir("qwen3_moe"), python=vllm_python, log_dir=tmp_path,
                        afd_fields={"num_attention_ranks": 3, "num_ffn_ranks": 2, "reform_timeout_s": 0,
                                    "step_timeout_s": 60, "num_stages": 2, "min_tokens_per_stage": 1},
                        # NOTE: one API server, not one per DP rank (vLLM's default): two processes fewer to start;
                        # vLLM's DP load balancer spreads the requests alike, and nothing here reads the attention's
                        # /metrics page.
                        attention_args=["--data-parallel-size", "3", "--api-server-count", "1", *FLOAT32],
                        ffn_args=["--data-parallel-size", "2", "--enable-expert-parallel", *FLOAT32],
                        attention_cpus="1|1|1", ffn_cpus="0|0")
    serve_and_compare(afd, plain_float32, copies=2)
    log = afd.attention.log_path.read_text()
    assert STAGES_RAN in log, log[-4000:]


def test_attention_tp2_on_ffn_tp2(tiny_model_dir, vllm_python, tmp_path, plain_float32):
    afd = AFDDeployment(tiny_model_dir("qwen3_moe"), python=vllm_python, log_dir=tmp_path,
                        afd_fields={"num_attention_ranks": 2, "num_ffn_ranks": 2, "step_timeout_s": 60},
                        attention_args=["--tensor-parallel-size", "2", *FLOAT32],
                        ffn_args=["--tensor-parallel-size", "2", *FLOAT32],
                        attention_cpus="1|1", ffn_cpus="0|0")
    serve_and_compare(afd, plain_float32)
