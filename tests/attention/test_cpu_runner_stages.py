"""The CPU attention runner's stage decision (docs/pingpong.md#33-per-stage-attention-metadata-v1-cpu-runner):
vLLM's own V1 DP vote (`coordinate_batch_across_dp`, seam `v1-runner-add-ubatch-vote`) around
`AFDCPUAttentionModelRunner.num_ubatches_for`, over a simulated all-reduce, and at DP 1 vLLM's own
`_determine_batch_execution_and_padding` around `should_ubatch_without_dp` (seam `v1-runner-add-ubatch-without-dp`);
the runner is built without a model (`object.__new__`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("vllm")
from vllm_afd.releases import installed  # noqa: E402

if not installed().has_model_runner_v1:  # attention/cpu_runner.py refuses to import there (docs/releases.md)
    pytest.skip(f"vLLM {installed().version} has no V1 CPU runner, so AFD has no CPU attention runner on it",
                allow_module_level=True)
from vllm_afd.attention.cpu_runner import AFDCPUAttentionModelRunner  # noqa: E402
from vllm_afd.attention.stages import stages_for_step  # noqa: E402


def make_runner(num_stages: int, min_tokens_per_stage: int, *, in_execute: bool = True) -> AFDCPUAttentionModelRunner:
    runner = object.__new__(AFDCPUAttentionModelRunner)
    runner.afd_num_stages, runner.afd_min_tokens_per_stage = num_stages, min_tokens_per_stage
    runner._afd_in_execute = in_execute
    return runner


def dp_vote(monkeypatch, ranks: list[dict], num_stages: int, min_tokens_per_stage: int):
    """V1's `coordinate_batch_across_dp` on every rank as `_determine_batch_execution_and_padding` calls it
    (eager: CPU), the all-reduce simulated in two passes (collect each rank's contribution, then the sum)."""
    from vllm.v1.worker import dp_utils

    monkeypatch.setattr(dp_utils, "get_dp_group",
                        lambda: SimpleNamespace(device="cpu", device_group=None, cpu_group=None))
    contributions: list = []
    reduce = {"op": lambda tensor: contributions.append(tensor.clone())}
    monkeypatch.setattr(dp_utils, "dist", SimpleNamespace(all_reduce=lambda tensor, group=None: reduce["op"](tensor)))

    def call(rank: int, step: dict):
        runner = make_runner(num_stages, min_tokens_per_stage, in_execute=step.get("in_execute", True))
        parallel_config = SimpleNamespace(data_parallel_size=len(ranks), data_parallel_rank=rank, use_ubatching=False,
                                          num_ubatches=1, disable_nccl_for_dp_synchronization=True)
        return dp_utils.coordinate_batch_across_dp(
            num_tokens_unpadded=step["num_tokens"], parallel_config=parallel_config,
            allow_microbatching=step.get("allowed", True), num_tokens_padded=step["num_tokens"],
            uniform_decode=True, cudagraph_mode=0, num_ubatches_for=runner.num_ubatches_for)

    for rank, step in enumerate(ranks):
        call(rank, step)
    total = sum(contributions)
    reduce["op"] = lambda tensor: tensor.copy_(total)
    return [call(rank, step) for rank, step in enumerate(ranks)]


@given(counts=st.lists(st.integers(1, 40), min_size=2, max_size=4), num_stages=st.sampled_from([2, 3]),
       min_tokens_per_stage=st.integers(1, 4))
def test_dp_ranks_split_together_and_pad_alike_or_all_run_whole(counts, num_stages, min_tokens_per_stage):
    """Split only if every rank's planner splits its own step; a split step is padded to the most tokens on any
    rank, so every rank's stages have the same rows (the payload's rule, stage_counts)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        results = dp_vote(monkeypatch, [{"num_tokens": n} for n in counts], num_stages, min_tokens_per_stage)

    wanted = all(stages_for_step(num_stages, n, min_tokens_per_stage=min_tokens_per_stage) > 1 for n in counts)
    empty_last = (max(counts) // num_stages) * (num_stages - 1) >= min(counts)  # vLLM's empty micro-batch rule
    assert {should_ubatch for should_ubatch, _, _ in results} == {wanted and not empty_last}
    if wanted and not empty_last:
        assert all(padded.tolist() == [max(counts)] * len(counts) for _, padded, _ in results)


def test_an_idle_ranks_dummy_step_keeps_every_rank_whole(monkeypatch):
    results = dp_vote(monkeypatch, [{"num_tokens": 32}, {"num_tokens": 1, "in_execute": False}], 2, 1)

    assert [should_ubatch for should_ubatch, _, _ in results] == [False, False]


def test_vllms_prefix_cache_veto_on_one_rank_keeps_every_rank_whole(monkeypatch):
    results = dp_vote(monkeypatch, [{"num_tokens": 32}, {"num_tokens": 32, "allowed": False}], 2, 1)

    assert [should_ubatch for should_ubatch, _, _ in results] == [False, False]


def test_the_runner_splits_execute_model_steps_only():
    assert make_runner(2, 4).num_ubatches_for(8, False) == 2
    assert make_runner(2, 4).num_ubatches_for(7, True) == 1
    assert make_runner(3, 1, in_execute=False).num_ubatches_for(64, True) == 1


@given(counts=st.lists(st.integers(1, 64), min_size=2, max_size=4), threshold=st.integers(1, 48),
       num_ubatches=st.sampled_from([2, 3]), uniform=st.booleans())
def test_the_seams_default_votes_as_the_pinned_release(counts, threshold, num_ubatches, uniform):
    """vLLM's own `GPUModelRunner.num_ubatches_for` (DBO's thresholds, its count) decides exactly what the pinned
    vote decided without it: patched == pristine for DBO."""
    from vllm.v1.worker import dp_utils
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def vote(with_default: bool) -> list:
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.setattr(dp_utils, "get_dp_group",
                                lambda: SimpleNamespace(device="cpu", device_group=None, cpu_group=None))
            contributions: list = []
            reduce = {"op": lambda tensor: contributions.append(tensor.clone())}
            monkeypatch.setattr(dp_utils, "dist",
                                SimpleNamespace(all_reduce=lambda tensor, group=None: reduce["op"](tensor)))

            def call(rank: int, n: int):
                parallel_config = SimpleNamespace(
                    data_parallel_size=len(counts), data_parallel_rank=rank, use_ubatching=True,
                    num_ubatches=num_ubatches, disable_nccl_for_dp_synchronization=True,
                    dbo_decode_token_threshold=threshold, dbo_prefill_token_threshold=threshold)
                runner = object.__new__(GPUModelRunner)
                runner.parallel_config = parallel_config
                return dp_utils.coordinate_batch_across_dp(
                    num_tokens_unpadded=n, parallel_config=parallel_config, allow_microbatching=True,
                    num_tokens_padded=n, uniform_decode=uniform, cudagraph_mode=0,
                    num_ubatches_for=runner.num_ubatches_for if with_default else None)

            for rank, n in enumerate(counts):
                call(rank, n)
            total = sum(contributions)
            reduce["op"] = lambda tensor: tensor.copy_(total)
            return [(u, None if p is None else p.tolist(), m) for u, p, m in
                    (call(rank, n) for rank, n in enumerate(counts))]

    assert vote(True) == vote(False)


# ---- DP 1: no vote; vLLM asks should_ubatch_without_dp (seam v1-runner-add-ubatch-without-dp) -------------------


def determine_at_dp_1(runner, num_tokens: int, allowed: bool) -> bool:
    """V1's own `_determine_batch_execution_and_padding` at DP 1 (eager, no LoRA, no sequence parallelism), as
    `execute_model` calls it for a decode of `num_tokens` requests; returns its `should_ubatch`."""
    import numpy as np
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    parallel_config = SimpleNamespace(data_parallel_size=1, tensor_parallel_size=1)
    runner.parallel_config, runner.uniform_decode_query_len = parallel_config, 1
    runner.model_config = SimpleNamespace(is_encoder_decoder=False)
    runner.input_batch = SimpleNamespace(lora_id_to_lora_request={})
    runner.compilation_config = SimpleNamespace(pass_config=SimpleNamespace(enable_sp=False))
    runner.vllm_config = SimpleNamespace(parallel_config=parallel_config,
                                         observability_config=SimpleNamespace(cudagraph_metrics=False))
    runner.cudagraph_dispatcher = SimpleNamespace(
        dispatch=lambda num_tokens, **_: (CUDAGraphMode.NONE, BatchDescriptor(num_tokens=num_tokens)))
    _, _, should_ubatch, num_tokens_across_dp, _ = runner._determine_batch_execution_and_padding(
        num_tokens=num_tokens, num_reqs=num_tokens, num_scheduled_tokens_np=np.ones(num_tokens, dtype=np.int32),
        max_num_scheduled_tokens=1, use_cascade_attn=False, allow_microbatching=allowed)
    assert num_tokens_across_dp is None
    return should_ubatch


@given(num_tokens=st.integers(1, 40), num_stages=st.sampled_from([1, 2, 3]), min_tokens_per_stage=st.integers(1, 4),
       allowed=st.booleans(), in_execute=st.booleans())
def test_at_dp_1_an_executed_step_splits_as_the_planner_says_under_vllms_veto(
        num_tokens, num_stages, min_tokens_per_stage, allowed, in_execute):
    runner = make_runner(num_stages, min_tokens_per_stage, in_execute=in_execute)

    should_ubatch = determine_at_dp_1(runner, num_tokens, allowed)

    planned = stages_for_step(num_stages, num_tokens, min_tokens_per_stage=min_tokens_per_stage, allowed=allowed)
    assert should_ubatch is (in_execute and planned > 1)


@given(num_tokens=st.integers(1, 40), allowed=st.booleans())
def test_the_dp_1_seams_default_keeps_every_step_whole_as_the_pinned_release(num_tokens, allowed):
    """vLLM's own `GPUModelRunner.should_ubatch_without_dp` answers False: at DP 1 the patched V1 runner never
    micro-batches, as the pinned one, which decides micro-batching only in the DP vote."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert determine_at_dp_1(object.__new__(GPUModelRunner), num_tokens, allowed) is False
