"""The CUDA attention's micro-batch stages on CPU (docs/pingpong.md § 4.1, § 9): which steps split, which
capture sizes get a split graph, what each stage publishes, and which contexts run which stage.

vLLM's own graph manager logic runs (`_init_candidates` with its twin rule, `dispatch`) around AFD's `dispatch`
override and `AFDUBatchRunner.num_ubatches_for` (which vLLM's twin rule asks, seam
`cudagraph-ask-runner-for-ubatch-twin`), and vLLM's own DP vote (`sync_cudagraph_and_dp_padding`) around the same
method; the runners and the manager are built without a device (`object.__new__`), their collaborators are recorders.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("vllm")
from vllm.config import CUDAGraphMode  # noqa: E402
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor  # noqa: E402

from vllm_afd.attention.capture import AFDModelCudaGraphManager, CaptureArm  # noqa: E402
from vllm_afd.attention.cuda_stages import AFDUBatchRunner  # noqa: E402
from vllm_afd.attention.stages import stage_sizes, stages_for_step  # noqa: E402
from vllm_afd.attention.step import AttentionStep  # noqa: E402

CAPTURE_SIZES = [1, 2, 4, 8, 16]
SIDE = SimpleNamespace(batch_descriptor=None)  # a forward context without a batch descriptor


class Publishes:
    """The connector as the runner and manager use it: publish() recorded."""

    def __init__(self, dp_size: int = 1) -> None:
        self.placement = SimpleNamespace(dp_size=dp_size)
        self.published: list[tuple[dict, dict]] = []

    def publish(self, counts, **flags) -> None:
        self.published.append((counts, flags))


def make_ubatch_runner(num_stages: int, min_tokens_per_stage: int) -> AFDUBatchRunner:
    """AFD's micro-batch runner without its CUDA streams: the count and the planner's threshold."""
    ubatch_runner = object.__new__(AFDUBatchRunner)
    ubatch_runner.num_ubatches, ubatch_runner.afd_min_tokens_per_stage = num_stages, min_tokens_per_stage
    return ubatch_runner


def make_manager(num_stages: int, *, arm: CaptureArm | None = None, connector: Publishes | None = None,
                 min_tokens_per_stage: int = 1, dp_size: int = 1, cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY):
    """vLLM's candidates (FULL_DECODE_ONLY, or none) built by vLLM's `_init_candidates`, whose twin rule asks AFD's
    micro-batch runner for the count."""
    manager = object.__new__(AFDModelCudaGraphManager)
    connector = connector or Publishes()
    runner = SimpleNamespace(afd_capture_arm=arm or CaptureArm(), afd_connector=connector,
                             afd_step=AttentionStep(connector, connector.placement.dp_size),
                             afd_min_tokens_per_stage=min_tokens_per_stage, dp_size=dp_size)
    manager.afd_runner = runner  # the instance's view of the bound class attribute
    # What `__init__` would have set, for every release: 0.34 keys decode graphs by (requests, query length)
    # (`decode_max_reqs`, `_decode_descs`) and reads decode and prefill sizes of their own.
    manager.vllm_config = SimpleNamespace(speculative_config=None, uniform_decode_query_len=1,
                                          cache_config=SimpleNamespace(use_kda_recoverssm=False))
    manager.compilation_config = SimpleNamespace(cudagraph_capture_sizes=CAPTURE_SIZES,
                                                 max_cudagraph_capture_size=max(CAPTURE_SIZES),
                                                 decode_cudagraph_capture_request_sizes=CAPTURE_SIZES,
                                                 prefill_cudagraph_capture_token_sizes=CAPTURE_SIZES,
                                                 max_decode_cudagraph_capture_tokens=None)
    manager.cudagraph_mode = cudagraph_mode
    manager.max_num_reqs = 16
    manager.decode_max_reqs = {1: manager.max_num_reqs}
    manager.decode_request_sizes = None
    manager._decode_descs = {}
    manager.decode_query_len = 1
    manager.varlen_decode = False
    manager.lora_capture_cases = [0]
    manager._lora_dispatch_map, manager._max_lora_case = {}, 0
    manager._candidates, manager._capture_descs = {}, {}
    manager.ubatch_runner = None if num_stages == 1 else make_ubatch_runner(num_stages, min_tokens_per_stage)
    manager._init_candidates()
    manager._graphs_captured = True
    return manager


@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("min_tokens_per_stage", [1, 4])
def test_every_capture_size_the_planner_splits_gets_one_split_twin(num_stages, min_tokens_per_stage):
    manager = make_manager(num_stages, min_tokens_per_stage=min_tokens_per_stage)

    descs = manager._capture_descs[CUDAGraphMode.FULL]

    single = sorted(d.num_tokens for d in descs if d.num_ubatches == 1)
    split = sorted(d.num_tokens for d in descs if d.num_ubatches > 1)
    assert single == CAPTURE_SIZES
    assert split == [n for n in CAPTURE_SIZES if n >= num_stages * min_tokens_per_stage]
    assert {d.num_ubatches for d in descs if d.num_ubatches > 1} == {num_stages}
    assert all(d.uniform_token_count == 1 and d.num_reqs == d.num_tokens for d in descs)


def test_one_stage_captures_exactly_vllms_graphs():
    assert [d.num_ubatches for d in make_manager(1)._capture_descs[CUDAGraphMode.FULL]] == [1] * len(CAPTURE_SIZES)


def pinned_maybe_ubatch_twin(manager, desc: BatchExecutionDescriptor) -> BatchExecutionDescriptor | None:
    """`CudaGraphManager._maybe_ubatch_twin` as vLLM 0.30.0 and 0.32.0 release it: DBO's count and thresholds."""
    from dataclasses import replace

    from vllm.v1.worker.ubatch_utils import check_ubatch_thresholds, get_num_ubatches

    if manager.ubatch_runner is None or desc.cg_mode != CUDAGraphMode.FULL or desc.num_reqs is None:
        return None
    uniform_token_count, remainder = divmod(desc.num_tokens, desc.num_reqs)
    if remainder or desc.uniform_token_count not in (None, uniform_token_count):
        return None
    parallel_config = manager.vllm_config.parallel_config
    num_ubatches = get_num_ubatches(parallel_config)
    if desc.num_tokens < num_ubatches:
        return None
    if not check_ubatch_thresholds(parallel_config, desc.num_tokens, uniform_decode=True):
        return None
    return replace(desc, num_ubatches=num_ubatches, uniform_token_count=uniform_token_count)


@given(cg_mode=st.sampled_from([CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE]), num_tokens=st.integers(1, 64),
       num_reqs=st.none() | st.integers(1, 64), uniform=st.sampled_from([None, 1, 2, 3]),
       num_ubatches=st.sampled_from([2, 3]), threshold=st.integers(1, 64), dbo=st.booleans())
def test_the_twin_seams_default_captures_the_pinned_releases_twins(cg_mode, num_tokens, num_reqs, uniform,
                                                                   num_ubatches, threshold, dbo):
    """vLLM's own `UBatchRunner.num_ubatches_for` (DBO's thresholds, its count), asked by the patched twin rule,
    gives the twins the pinned rule gave: patched == pristine for DBO (which builds no micro-batch runner without
    DBO)."""
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
    from vllm.v1.worker.gpu.ubatch_utils import UBatchRunner

    parallel_config = SimpleNamespace(use_ubatching=True, num_ubatches=num_ubatches,
                                      dbo_decode_token_threshold=threshold, dbo_prefill_token_threshold=threshold)
    manager = object.__new__(CudaGraphManager)
    manager.vllm_config = SimpleNamespace(parallel_config=parallel_config)
    manager.ubatch_runner = None
    if dbo:  # vLLM's default build: UBatchRunner(...) with parallel_config's count
        manager.ubatch_runner = object.__new__(UBatchRunner)
        manager.ubatch_runner.parallel_config, manager.ubatch_runner.num_ubatches = parallel_config, num_ubatches
    desc = BatchExecutionDescriptor(cg_mode=cg_mode, num_tokens=num_tokens, num_reqs=num_reqs,
                                    uniform_token_count=uniform)

    assert manager._maybe_ubatch_twin(desc) == pinned_maybe_ubatch_twin(manager, desc)


@given(num_stages=st.sampled_from([1, 2, 3]), num_tokens=st.integers(1, max(CAPTURE_SIZES)),
       uniform=st.sampled_from([1, None, 3]), min_tokens_per_stage=st.integers(1, 5))
def test_a_uniform_decode_splits_as_the_planner_says_and_finds_its_graph(num_stages, num_tokens, uniform,
                                                                         min_tokens_per_stage):
    manager = make_manager(num_stages, min_tokens_per_stage=min_tokens_per_stage)

    desc = manager.dispatch(num_tokens, num_tokens, uniform, 0)

    expected = (stages_for_step(num_stages, num_tokens, min_tokens_per_stage=min_tokens_per_stage)
                if uniform == 1 else 1)
    assert desc.num_ubatches == expected
    if uniform == 1:  # FULL_DECODE_ONLY: every decode size has its graph, split or not
        assert desc.cg_mode == CUDAGraphMode.FULL and desc.num_tokens >= num_tokens


def test_a_caller_that_asks_for_micro_batches_keeps_its_count():
    assert make_manager(2).dispatch(4, 4, 1, 0, num_ubatches=1).num_ubatches == 2
    assert make_manager(2).dispatch(4, 4, 1, 0, num_ubatches=3).num_ubatches == 3


def test_at_attention_dp_above_one_the_manager_leaves_the_split_to_vllms_dp_vote():
    """An idle rank's dummy step has no attention to split: only the vote may split (and then passes its count)."""
    manager = make_manager(2, dp_size=2)

    assert manager.dispatch(8, 8, 1, 0).num_ubatches == 1
    assert manager.dispatch(8, 8, 1, 0, num_ubatches=2).num_ubatches == 2


# ---- vLLM's DP vote (seam mrv2-add-ubatch-vote) -----------------------------------------------------------


def dp_group(reduce: dict) -> SimpleNamespace:
    """The DP group as the vote reaches it: 0.30 and 0.32 all-reduce over its `cpu_group` with
    `dist.all_reduce`, 0.34 calls its `cpu_all_reduce_`; both go to the simulated all-reduce."""
    return SimpleNamespace(cpu_group=None, cpu_all_reduce_=lambda tensor: reduce["op"](tensor), dead_dp_ranks=set())


def dp_vote(monkeypatch, ranks: list[dict], num_stages: int, min_tokens_per_stage: int, cudagraph_mode):
    """vLLM's `sync_cudagraph_and_dp_padding` on every DP rank, as execute_model calls it (through
    `dispatch_cg_and_sync_dp`), over a simulated all-reduce: a first pass collects each rank's
    contribution, the second sums them, as gloo would.  Returns each rank's (descriptor, sync)."""
    from vllm.v1.worker.gpu import dp_utils

    contributions: list = []
    reduce = {"op": lambda tensor, group=None: contributions.append(tensor.clone())}
    monkeypatch.setattr(dp_utils, "get_dp_group", lambda: dp_group(reduce))
    monkeypatch.setattr(dp_utils, "dist", SimpleNamespace(all_reduce=lambda tensor, group=None: reduce["op"](tensor)))
    # vLLM's DBO is off under AFD; so is fault tolerance on a DP group (validation.healing_blocker)
    parallel_config = SimpleNamespace(use_ubatching=False, num_ubatches=1, enable_fault_tolerance=False)

    def call(rank: int, step: dict):
        manager = make_manager(num_stages, min_tokens_per_stage=min_tokens_per_stage, dp_size=len(ranks),
                               cudagraph_mode=cudagraph_mode)
        return dp_utils.dispatch_cg_and_sync_dp(
            manager, step["num_reqs"], step["num_tokens"], step["uniform"], len(ranks), rank,
            max_query_len=step["max_query_len"], parallel_config=parallel_config,
            allow_ubatching=num_stages > 1 and not step.get("skip_attn", False),
            uniform_decode=step["uniform"] == 1,
            num_ubatches_for=None if manager.ubatch_runner is None else manager.ubatch_runner.num_ubatches_for)

    for rank, step in enumerate(ranks):
        call(rank, step)
    total = sum(contributions)
    reduce["op"] = lambda tensor, group=None: tensor.copy_(total)
    return [call(rank, step) for rank, step in enumerate(ranks)]


def decode(num_reqs: int, **extra) -> dict:
    return {"num_reqs": num_reqs, "num_tokens": num_reqs, "uniform": 1, "max_query_len": 1, **extra}


@given(counts=st.lists(st.integers(1, max(CAPTURE_SIZES)), min_size=2, max_size=4),
       num_stages=st.sampled_from([2, 3]), min_tokens_per_stage=st.integers(1, 4),
       mode=st.sampled_from([CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.NONE]))
def test_dp_ranks_agree_on_one_stage_count_split_alike_and_pad_alike(counts, num_stages, min_tokens_per_stage, mode):
    """Whatever each rank scheduled, every rank gets the same descriptor: the planner's count for the fewest
    tokens on any rank, one padded token count, so each stage's rows are equal on all ranks (the payload's
    rule, stage_counts)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        results = dp_vote(monkeypatch, [decode(n) for n in counts], num_stages, min_tokens_per_stage, mode)

    descs = [desc for desc, _ in results]
    assert len({(d.num_ubatches, d.cg_mode) for d in descs}) == 1
    expected = stages_for_step(num_stages, min(counts), min_tokens_per_stage=min_tokens_per_stage)
    assert descs[0].num_ubatches == expected
    if expected > 1:  # a whole eager step is not DP-padded (vLLM's rule); a split one is
        assert len({d.num_tokens for d in descs}) == 1 and descs[0].num_tokens >= max(counts)
        assert all(sync.num_tokens_across_dp.tolist() == [descs[0].num_tokens] * len(counts) for _, sync in results)


def test_a_rank_whose_dummy_step_skips_attention_keeps_every_rank_whole(monkeypatch):
    results = dp_vote(monkeypatch, [decode(16), decode(1, skip_attn=True)], 2, 1, CUDAGraphMode.FULL_DECODE_ONLY)

    assert [desc.num_ubatches for desc, _ in results] == [1, 1]


def test_a_prefill_on_any_rank_keeps_every_rank_whole(monkeypatch):
    prefill = {"num_reqs": 2, "num_tokens": 40, "uniform": None, "max_query_len": 32}

    results = dp_vote(monkeypatch, [decode(16), prefill], 2, 1, CUDAGraphMode.FULL_DECODE_ONLY)

    assert [desc.num_ubatches for desc, _ in results] == [1, 1]


def capture_desc(num_tokens: int, num_ubatches: int) -> BatchExecutionDescriptor:
    return BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=num_tokens, num_reqs=num_tokens,
                                    uniform_token_count=1, num_ubatches=num_ubatches)


@pytest.mark.parametrize("warmup", [True, False])
def test_a_split_capture_publishes_every_stage_and_leaves_the_arm_to_the_micro_batch_runner(warmup):
    connector, arm = Publishes(dp_size=2), CaptureArm()
    manager = make_manager(3, arm=arm, connector=connector)

    manager.before_capture_forward(capture_desc(8, 3), warmup)

    assert connector.published == [({0: [2, 2], 1: [2, 2], 2: [4, 4]},
                                     {"is_warmup": warmup, "is_graph_capturing": not warmup})]
    assert arm.stage_of(SIDE) is None


def test_a_one_stage_capture_publishes_stage_zero_and_arms_its_forward():
    connector, arm = Publishes(), CaptureArm()
    manager = make_manager(2, arm=arm, connector=connector)

    manager.before_capture_forward(capture_desc(2, 1), False)

    assert connector.published == [({0: [2]}, {"is_warmup": False, "is_graph_capturing": True})]
    assert arm.stage_of(SIDE) == 0 and arm.stage_of(SIDE) is None


@given(num_tokens=st.integers(1, 64), num_stages=st.integers(1, 3))
def test_stage_sizes_are_vllms_split_of_the_padded_step(num_tokens, num_stages):
    """The rows each stage publishes equal the token slices vLLM's micro-batch runner makes."""
    from vllm.v1.worker.ubatch_utils import maybe_create_ubatch_slices
    import numpy as np

    if num_tokens < num_stages:
        with pytest.raises(ValueError, match="cannot fill"):
            stage_sizes(num_tokens, num_stages)
        return
    if num_stages == 1:
        assert stage_sizes(num_tokens, 1) == [num_tokens]
        return
    _, slices = maybe_create_ubatch_slices(True, np.ones(num_tokens, dtype=np.int32), num_tokens, num_tokens,
                                           num_stages)

    assert stage_sizes(num_tokens, num_stages) == [s.num_tokens for s in slices]


# ---- the runner's pieces ------------------------------------------------------------------------------


def test_the_micro_batch_runner_arms_one_stage_per_context_it_builds(monkeypatch):
    from vllm.v1.worker.gpu.ubatch_utils import UBatchRunner

    from vllm_afd.attention.cuda_stages import AFDUBatchRunner

    arm = CaptureArm()
    seen = []
    # vLLM's prepare builds the k stage contexts (no batch descriptor) in stage order.
    monkeypatch.setattr(UBatchRunner, "prepare", lambda self, *a, **kw: [arm.stage_of(SIDE) for _ in range(3)])
    runner = object.__new__(AFDUBatchRunner)
    runner.num_ubatches, runner.afd_arm = 3, arm

    seen.append(runner.prepare("input_batch", "block_tables", "slot_mappings"))
    seen.append(arm.stage_of(SIDE))  # a KV-connector side context afterwards

    assert seen == [[0, 1, 2], None]


def test_a_split_step_publishes_every_stage_rows_and_a_whole_step_its_padded_batch():
    from vllm.v1.worker.ubatch_utils import UBatchSlice

    from vllm_afd.attention.runner import AFDAttentionModelRunner

    runner = object.__new__(AFDAttentionModelRunner)
    runner.afd_connector = Publishes()
    runner.afd_step = AttentionStep(runner.afd_connector)
    desc = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=8, num_reqs=8, num_ubatches=2)
    state = SimpleNamespace(slices=[UBatchSlice(slice(0, 4), slice(0, 4)), UBatchSlice(slice(4, 8), slice(4, 8))])

    runner.before_model_forward(desc, None, None, state)
    runner.before_model_forward(BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=5, num_reqs=5),
                                None, None, None)

    assert [counts for counts, _ in runner.afd_connector.published] == [{0: [4], 1: [4]}, {0: [5]}]
    assert runner.afd_connector.published[0][1]["is_graph_replaying"] is True


def test_the_cuda_stage_baton_is_vllms_handoff_and_does_nothing_outside_micro_batch_threads():
    import inspect

    from vllm_afd.attention.cuda_stages import DBO_BATON
    from vllm_afd.attention.runner import AFDAttentionModelRunner

    DBO_BATON.yield_stage()  # no micro-batch thread: returns at once

    assert AFDAttentionModelRunner.afd_stage_baton is DBO_BATON
    assert "dbo_yield()" in inspect.getsource(type(DBO_BATON).yield_stage)


@given(counts=st.lists(st.integers(1, max(CAPTURE_SIZES)), min_size=2, max_size=3), threshold=st.integers(1, 16),
       mode=st.sampled_from([CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.NONE]))
def test_the_seams_default_votes_as_the_pinned_release(counts, threshold, mode):
    """vLLM's own `UBatchRunner.num_ubatches_for` (DBO's thresholds, its count) decides exactly what the pinned
    sync decided without it (`num_ubatches_for=None`): patched == pristine for DBO at DP > 1."""
    from vllm.v1.worker.gpu import dp_utils
    from vllm.v1.worker.gpu.ubatch_utils import UBatchRunner

    parallel_config = SimpleNamespace(use_ubatching=True, num_ubatches=2, dbo_decode_token_threshold=threshold,
                                      dbo_prefill_token_threshold=threshold, enable_fault_tolerance=False)
    ubatch_runner = object.__new__(UBatchRunner)
    ubatch_runner.parallel_config, ubatch_runner.num_ubatches = parallel_config, 2

    def vote(num_ubatches_for) -> list:
        with pytest.MonkeyPatch.context() as monkeypatch:
            contributions: list = []
            reduce = {"op": lambda tensor: contributions.append(tensor.clone())}
            monkeypatch.setattr(dp_utils, "get_dp_group", lambda: dp_group(reduce))
            monkeypatch.setattr(dp_utils, "dist",
                                SimpleNamespace(all_reduce=lambda tensor, group=None: reduce["op"](tensor)))

            def call(rank: int, n: int):
                manager = make_manager(2, dp_size=len(counts), cudagraph_mode=mode)  # the same manager both ways
                desc, sync = dp_utils.dispatch_cg_and_sync_dp(
                    manager, n, n, 1, len(counts), rank, max_query_len=1, parallel_config=parallel_config,
                    allow_ubatching=True, uniform_decode=True, num_ubatches_for=num_ubatches_for)
                return desc, None if sync is None else sync.num_tokens_across_dp.tolist()

            for rank, n in enumerate(counts):
                call(rank, n)
            total = sum(contributions)
            reduce["op"] = lambda tensor: tensor.copy_(total)
            return [call(rank, n) for rank, n in enumerate(counts)]

    assert vote(ubatch_runner.num_ubatches_for) == vote(None)
