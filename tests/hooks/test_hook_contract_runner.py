"""Contract tests of the worker and Model Runner V2 seams on the patched pinned source.

They read the patched files with `ast` (no vLLM import), so they run without vLLM
installed and fail if a refresh moves a hook to a place where it no longer holds its
promise: FULL replay outside any forward context, `before_model_forward` ahead of both
forward branches, capture hooks outside `torch.cuda.graph`, twice per descriptor.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hook_ast import call_sites, find_def, param_names, parse

pytestmark = pytest.mark.wheel

GPU_WORKER = "vllm/v1/worker/gpu_worker.py"
CPU_WORKER = "vllm/v1/worker/cpu_worker.py"
MRV2 = "vllm/v1/worker/gpu/model_runner.py"
CUDAGRAPH = "vllm/v1/worker/gpu/cudagraph_utils.py"
try:  # MRV2's local for the DP sync state: renamed in 0.32 (the hook's parameter keeps `dp_sync`)
    from vllm_afd.releases import installed

    DP_SYNC_LOCAL = {"0.30.0": "dp_sync"}.get(installed().version, "dp_sync_state")
    # The Worker method that builds the runner: 0.32 moved it out of init_device (which calls it).
    GPU_BUILDER = {"0.30.0": "init_device"}.get(installed().version, "_init_workspace_and_model_runner")
    HAS_V1 = installed().has_model_runner_v1
except ImportError:
    DP_SYNC_LOCAL, GPU_BUILDER, HAS_V1 = "dp_sync", "init_device", True
# The runners each worker's factory builds: V1 and V2 (each under an alias) where Model Runner V1 exists;
# 0.34 removed V1, so the GPU factory builds MRV2 only and the CPU one MRV2 or the standalone CPU runner.
GPU_RUNNERS = {"GPUModelRunnerV1", "GPUModelRunnerV2"} if HAS_V1 else {"GPUModelRunner"}
CPU_RUNNERS = {"CPUModelRunner", "CPUModelRunnerV2"} if HAS_V1 else {"CPUModelRunner", "StandaloneCPUModelRunner"}
NEEDS_V1 = pytest.mark.skipif(not HAS_V1, reason="this vLLM removed Model Runner V1 "
                              "(vllm/v1/worker/gpu_model_runner.py, 0.34.0): its series has no v1-runner-* seams")


@pytest.mark.parametrize(
    ("relpath", "worker", "builder", "runner_classes"),
    [
        (GPU_WORKER, "Worker", GPU_BUILDER, GPU_RUNNERS),
        (CPU_WORKER, "CPUWorker", "init_device", CPU_RUNNERS),
    ],
)
def test_init_device_builds_the_runner_only_through_make_model_runner(
    pinned_tree: Path, relpath: str, worker: str, builder: str, runner_classes: set[str]
) -> None:
    module = parse(pinned_tree, relpath)

    factory = find_def(module, f"{worker}._make_model_runner")
    init_device = find_def(module, f"{worker}.{builder}")
    if builder != "init_device":
        assert len(call_sites(find_def(module, f"{worker}.init_device"), builder)) == 1

    assert param_names(factory) == ["self"]
    assert len(call_sites(init_device, "_make_model_runner")) == 1
    built_in_init = {
        name for name in runner_classes if call_sites(init_device, name)
    }
    assert built_in_init == set()
    built_in_factory = {name for name in runner_classes if call_sites(factory, name)}
    assert built_in_factory == runner_classes


def test_gpu_factory_keeps_the_upstream_lazy_imports(pinned_tree: Path) -> None:
    factory = find_def(parse(pinned_tree, GPU_WORKER), "Worker._make_model_runner")

    imported = {
        node.module for node in ast.walk(factory) if isinstance(node, ast.ImportFrom)
    }

    assert imported == {
        "vllm.v1.worker.mm_encoder_model_runner",
        "vllm.v1.worker.gpu.model_runner",
    } | ({"vllm.v1.worker.gpu_model_runner"} if HAS_V1 else set())


def test_gpu_factory_runs_after_the_workspace_manager_exists(pinned_tree: Path) -> None:
    init_device = find_def(parse(pinned_tree, GPU_WORKER), f"Worker.{GPU_BUILDER}")

    workspace = call_sites(init_device, "init_workspace_manager")
    factory = call_sites(init_device, "_make_model_runner")

    assert len(workspace) == 1
    assert workspace[0].line < factory[0].line


def test_before_model_forward_signature(pinned_tree: Path) -> None:
    hook = find_def(parse(pinned_tree, MRV2), "GPUModelRunner.before_model_forward")

    assert param_names(hook) == ["self", "batch_desc", "input_batch", "dp_sync", "ubatch_state"]
    assert ast.unparse(hook.returns) == "None"
    assert ast.get_docstring(hook)
    assert len(hook.body) == 1, "the default must do nothing but document itself"


def test_full_replay_runs_outside_any_forward_context(pinned_tree: Path) -> None:
    execute = find_def(parse(pinned_tree, MRV2), "GPUModelRunner.execute_model")

    replays = call_sites(execute, "run_fullgraph")

    assert len(replays) == 1
    assert not any("set_forward_context" in w for w in replays[0].withs)


def test_before_model_forward_precedes_both_forward_branches(pinned_tree: Path) -> None:
    execute = find_def(parse(pinned_tree, MRV2), "GPUModelRunner.execute_model")

    hooks = call_sites(execute, "before_model_forward")
    eplb = call_sites(execute, "prepare_forward")
    record_batch = call_sites(execute, "record_batch")
    replay = call_sites(execute, "run_fullgraph")
    contexts = call_sites(execute, "set_forward_context")

    assert len(hooks) == 1
    hook = hooks[0]
    assert hook.withs == () and hook.ifs == (), "the hook must run unconditionally, outside any with"
    assert [ast.unparse(a) for a in hook.call.args] == [
        "batch_desc", "input_batch", DP_SYNC_LOCAL, "ubatch_state"
    ]
    assert eplb[-1].line < hook.line < record_batch[0].line
    assert hook.line < replay[0].line
    assert hook.line < min(site.line for site in contexts)


def test_cudagraph_manager_is_built_through_the_runner_property(pinned_tree: Path) -> None:
    module = parse(pinned_tree, MRV2)
    initialize = find_def(module, "GPUModelRunner.initialize_kv_cache")
    prop = find_def(module, "GPUModelRunner.cudagraph_manager_cls")

    assert [ast.unparse(d) for d in prop.decorator_list] == ["property"]
    assert ast.unparse(prop.body[-1]) == "return ModelCudaGraphManager"
    assert call_sites(initialize, "ModelCudaGraphManager") == []
    assert len(call_sites(initialize, "cudagraph_manager_cls")) == 1


UBATCH = "vllm/v1/worker/gpu/ubatch_utils.py"
ATTN_UTILS = "vllm/v1/worker/gpu/attn_utils.py"


def test_mrv2_builds_its_micro_batch_runner_and_builders_through_the_runner(pinned_tree: Path) -> None:
    """`mrv2-add-num-ubatches`: the metadata builders are sized by `self.num_ubatches` (default: vLLM's
    DBO count, 1 without DBO) and the UBatchRunner comes from `build_ubatch_runner` (default: the pinned
    `maybe_build_ubatch_runner` call, with its DP > 1 rule); `UBatchRunner` takes an optional count."""
    module = parse(pinned_tree, MRV2)
    initialize = find_def(module, "GPUModelRunner.initialize_kv_cache")
    prop = find_def(module, "GPUModelRunner.num_ubatches")
    build = find_def(module, "GPUModelRunner.build_ubatch_runner")

    assert [ast.unparse(d) for d in prop.decorator_list] == ["property"]
    assert ast.unparse(prop.body[-1]) == "return get_num_ubatches(self.parallel_config)"
    assert param_names(build) == ["self"]
    assert len(call_sites(build, "maybe_build_ubatch_runner")) == 1
    assert call_sites(initialize, "maybe_build_ubatch_runner") == []
    assert len(call_sites(initialize, "build_ubatch_runner")) == 1
    backend = call_sites(initialize, "init_attn_backend")
    assert [ast.unparse(site.call.keywords[-1]) for site in backend] == ["num_metadata_builders=self.num_ubatches"]

    init_attn = ast.unparse(find_def(parse(pinned_tree, ATTN_UTILS), "init_attn_backend"))
    assert "num_metadata_builders or get_num_ubatches(vllm_config.parallel_config)" in init_attn
    runner_init = find_def(parse(pinned_tree, UBATCH), "UBatchRunner.__init__")
    assert param_names(runner_init)[-1] == "num_ubatches"
    assert "self.num_ubatches = num_ubatches or self.parallel_config.num_ubatches" in ast.unparse(runner_init)


def test_mrv2_micro_batch_contexts_carry_dp_metadata_only_where_set_forward_context_builds_it(
        pinned_tree: Path) -> None:
    """`mrv2-ubatch-fix-dp1-contexts`: DPMetadata.make asserts DP > 1 or sequence-parallel MoE, so the
    micro-batch contexts build it under set_forward_context's own condition (unchanged at DP > 1)."""
    source = ast.unparse(find_def(parse(pinned_tree, UBATCH), "UBatchRunner._make_forward_contexts"))

    assert ("dp_metadata=DPMetadata.make(self.parallel_config, num_tokens, num_tokens_across_dp) if dp_size > 1 "
            "or self.parallel_config.use_sequence_parallel_moe else None") in source


V1_RUNNER = "vllm/v1/worker/gpu_model_runner.py"


@NEEDS_V1
def test_v1_runner_reads_its_micro_batch_count_only_through_the_property(pinned_tree: Path) -> None:
    """`v1-runner-add-num-ubatches`: every reader of the count asks `self.num_ubatches`, whose default is
    parallel_config's count when DBO/ubatching is on and 1 otherwise (so the patched runner is the pinned one)."""
    module = parse(pinned_tree, V1_RUNNER)
    prop = find_def(module, "GPUModelRunner.num_ubatches")

    assert [ast.unparse(d) for d in prop.decorator_list] == ["property"]
    assert ast.unparse(prop.body[-1]) == "return pc.num_ubatches if pc.use_ubatching else 1"
    for reader in ("_allow_microbatching", "execute_model", "_dummy_run", "initialize_metadata_builders"):
        source = ast.unparse(find_def(module, f"GPUModelRunner.{reader}"))
        assert "self.num_ubatches" in source, reader
        assert "parallel_config.num_ubatches" not in source, reader
    veto = ast.unparse(find_def(module, "GPUModelRunner._allow_microbatching"))
    assert "use_ubatching" not in veto  # the prefix-cache veto runs for a runner's own micro-batches too


@NEEDS_V1
def test_v1_dp_vote_asks_the_runner_for_its_micro_batch_count(pinned_tree: Path) -> None:
    """`v1-runner-add-ubatch-vote`: the runner's `num_ubatches_for` (default: DBO's thresholds, its count) is what
    `coordinate_batch_across_dp` asks; without it the vote keeps the pinned threshold call and count."""
    runner = parse(pinned_tree, V1_RUNNER)
    method = find_def(runner, "GPUModelRunner.num_ubatches_for")
    assert param_names(method) == ["self", "num_tokens", "uniform_decode"]
    assert "check_ubatch_thresholds(self.parallel_config, num_tokens, uniform_decode)" in ast.unparse(method)
    determine = call_sites(find_def(runner, "GPUModelRunner._determine_batch_execution_and_padding"),
                           "coordinate_batch_across_dp")
    assert [ast.unparse(k) for k in determine[0].call.keywords][-1] == "num_ubatches_for=self.num_ubatches_for"

    dp_utils = parse(pinned_tree, "vllm/v1/worker/dp_utils.py")
    coordinate = ast.unparse(find_def(dp_utils, "coordinate_batch_across_dp"))
    assert "num_ubatches = num_ubatches_for(num_tokens_unpadded, uniform_decode)" in coordinate
    assert "should_attempt_ubatching = check_ubatch_thresholds(parallel_config, num_tokens_unpadded" in coordinate
    sync = ast.unparse(find_def(dp_utils, "_synchronize_dp_ranks"))
    assert "_post_process_ubatch(tensor, num_ubatches or parallel_config.num_ubatches)" in sync


@NEEDS_V1
def test_v1_runner_asks_whether_to_micro_batch_at_dp_1_and_its_default_keeps_every_step_whole(
        pinned_tree: Path) -> None:
    """`v1-runner-add-ubatch-without-dp`: at DP 1, where V1 runs no DP vote, `_determine_batch_execution_and_padding`
    asks `should_ubatch_without_dp` (vetoed steps too) and splits only if it says so and vLLM's veto allows; the
    default answers False, which is what the pinned runner decides at DP 1.  The DP > 1 vote is untouched."""
    runner = parse(pinned_tree, V1_RUNNER)
    hook = find_def(runner, "GPUModelRunner.should_ubatch_without_dp")
    assert param_names(hook) == ["self", "num_tokens", "uniform_decode", "allow_microbatching"]
    assert ast.unparse(hook.returns) == "bool"
    assert ast.get_docstring(hook) and [ast.unparse(s) for s in hook.body[1:]] == ["return False"]

    determine = find_def(runner, "GPUModelRunner._determine_batch_execution_and_padding")
    asks = call_sites(determine, "should_ubatch_without_dp")
    assert len(asks) == 1 and len(asks[0].ifs) == 1
    assert [ast.unparse(a) for a in asks[0].call.args] == ["num_tokens", "uniform_decode", "allow_microbatching"]
    branch = next(n for n in ast.walk(determine) if isinstance(n, ast.If) and n.lineno == asks[0].ifs[0])
    assert ast.unparse(branch.test) == "self.vllm_config.parallel_config.data_parallel_size == 1"
    assert ast.unparse(branch.body) == ("should_ubatch = self.should_ubatch_without_dp(num_tokens, uniform_decode, "
                                        "allow_microbatching) and allow_microbatching")
    vote = call_sites(determine, "coordinate_batch_across_dp")
    assert len(vote) == 1 and asks[0].line < vote[0].line


@NEEDS_V1
def test_v1_model_forward_stays_vllms_documented_override_point(pinned_tree: Path) -> None:
    """AFD's CPU runner overrides `GPUModelRunner._model_forward` to run the stages, with no seam (decision 45):
    vLLM documents it as the method subclasses override for model execution, and `execute_model` runs the model
    through it.  A rename or a new parameter upstream fails here, not silently in the stages."""
    runner = parse(pinned_tree, V1_RUNNER)
    forward = find_def(runner, "GPUModelRunner._model_forward")

    assert param_names(forward) == ["self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds"]
    assert forward.args.kwarg is not None and forward.args.kwarg.arg == "model_kwargs"
    assert "This method can be overridden by subclasses for model execution." in ast.get_docstring(forward)
    assert call_sites(find_def(runner, "GPUModelRunner.execute_model"), "_model_forward")


def test_mrv2_dp_vote_asks_the_micro_batch_runner_for_its_count(pinned_tree: Path) -> None:
    """`mrv2-add-ubatch-vote`: execute_model passes its UBatchRunner's `num_ubatches_for` (default: DBO's
    thresholds, its count) to the DP sync, which asks it with the fewest tokens on any rank; without it the
    sync keeps the pinned `check_ubatch_thresholds` + `get_num_ubatches` pair."""
    method = find_def(parse(pinned_tree, UBATCH), "UBatchRunner.num_ubatches_for")
    assert param_names(method) == ["self", "num_tokens", "uniform_decode"]
    assert "check_ubatch_thresholds(self.parallel_config, num_tokens, uniform_decode)" in ast.unparse(method)
    execute = call_sites(find_def(parse(pinned_tree, MRV2), "GPUModelRunner.execute_model"), "dispatch_cg_and_sync_dp")
    assert [ast.unparse(k) for k in execute[0].call.keywords][-1] == (
        "num_ubatches_for=None if self.ubatch_runner is None else self.ubatch_runner.num_ubatches_for")

    dp_utils = parse(pinned_tree, "vllm/v1/worker/gpu/dp_utils.py")
    dispatch = find_def(dp_utils, "dispatch_cg_and_sync_dp")
    assert param_names(dispatch)[-1] == "num_ubatches_for"
    sync = ast.unparse(find_def(dp_utils, "sync_cudagraph_and_dp_padding"))
    assert "num_ubatches = num_ubatches_for(min_num_tokens, bool(uniform_decode_across_dp))" in sync
    assert "num_ubatches = get_num_ubatches(parallel_config)" in sync  # the default arm: the pinned pair


def test_mrv2_capture_twins_ask_the_micro_batch_runner_for_their_count(pinned_tree: Path) -> None:
    """`cudagraph-ask-runner-for-ubatch-twin`: which FULL capture sizes get a micro-batched twin is the DP dispatch's
    rule, `UBatchRunner.num_ubatches_for` (default: DBO's thresholds and count), asked with the capture size as a
    uniform decode; no twin below 2 micro-batches or with fewer tokens than micro-batches."""
    twin = find_def(parse(pinned_tree, CUDAGRAPH), "CudaGraphManager._maybe_ubatch_twin")
    source = ast.unparse(twin)

    asks = call_sites(twin, "num_ubatches_for")
    assert len(asks) == 1 and ast.unparse(asks[0].call.func) == "self.ubatch_runner.num_ubatches_for"
    assert [ast.unparse(a) for a in asks[0].call.args] == ["desc.num_tokens", "True"]
    assert "if num_ubatches < 2 or desc.num_tokens < num_ubatches:" in source
    assert "check_ubatch_thresholds" not in source and "get_num_ubatches" not in source
    assert "parallel_config" not in source
    candidates = find_def(parse(pinned_tree, CUDAGRAPH), "CudaGraphManager._init_candidates")
    assert len(call_sites(candidates, "_maybe_ubatch_twin")) == 2  # decode and mixed FULL sizes, as pinned


def test_before_capture_forward_signature(pinned_tree: Path) -> None:
    hook = find_def(parse(pinned_tree, CUDAGRAPH), "CudaGraphManager.before_capture_forward")

    assert param_names(hook) == ["self", "desc", "warmup"]
    assert ast.unparse(hook.args.args[2].annotation) == "bool"
    assert len(hook.body) == 1, "the default must do nothing but document itself"


def test_capture_hooks_sit_outside_the_graph_body(pinned_tree: Path) -> None:
    capture = find_def(parse(pinned_tree, CUDAGRAPH), "CudaGraphManager.capture")

    hooks = call_sites(capture, "before_capture_forward")

    assert len(hooks) == 3
    assert all(not any("torch.cuda.graph" in w for w in h.withs) for h in hooks)


def test_capture_hook_fires_twice_on_every_descriptor_path(pinned_tree: Path) -> None:
    """Warm-up plus capture, for FULL, breakable and non-breakable PIECEWISE alike."""
    capture = find_def(parse(pinned_tree, CUDAGRAPH), "CudaGraphManager.capture")
    loop = next(
        node for node in ast.walk(capture)
        if isinstance(node, ast.For) and ast.unparse(node.target) == "desc"
    )
    branch = next(node for node in loop.body if isinstance(node, ast.If))

    common = [s for s in call_sites(ast.Module(loop.body[: loop.body.index(branch)], []),
                                    "before_capture_forward")]
    non_breakable = call_sites(ast.Module(branch.body, []), "before_capture_forward")
    breakable_or_full = call_sites(ast.Module(branch.orelse, []), "before_capture_forward")

    assert [s.keyword("warmup") for s in common] == [True]
    assert [s.keyword("warmup") for s in non_breakable] == [False]
    assert [s.keyword("warmup") for s in breakable_or_full] == [False]
    assert breakable_or_full[0].ifs == (), "must precede the PIECEWISE/FULL split"
    warmup_forward = call_sites(ast.Module(loop.body, []), "forward_fn")[0]
    assert common[0].line < warmup_forward.line
    recreate = call_sites(ast.Module(branch.orelse, []), "create_forward_fn")
    assert recreate[0].line < breakable_or_full[0].line


def test_capture_hook_is_not_called_at_replay(pinned_tree: Path) -> None:
    module = parse(pinned_tree, CUDAGRAPH)

    for qualname in ("CudaGraphManager.run_fullgraph", "ModelCudaGraphManager.run_fullgraph",
                     "CudaGraphManager.run_pw_graph"):
        assert call_sites(find_def(module, qualname), "before_capture_forward") == []


def test_release_graphs_lets_capture_model_record_every_graph_again(pinned_tree: Path) -> None:
    """After a re-formation the CUDA runner calls release_graphs() then capture_model() (attention/runner.py):
    release must empty what capture() asserts on and keep the descriptors needs_capture() reads."""
    module = parse(pinned_tree, CUDAGRAPH)
    release = ast.unparse(ast.Module(find_def(module, "CudaGraphManager.release_graphs").body[1:], []))  # no docstring
    capture = ast.unparse(find_def(module, "CudaGraphManager.capture"))

    assert "self.graphs.clear()" in release and "self._graphs_captured = False" in release
    assert "_capture_descs" not in release
    assert "assert desc not in self.graphs" in capture
    assert ast.unparse(find_def(module, "CudaGraphManager.needs_capture").body[-1]) == (
        "return len(self._capture_descs) > 0")
    model_capture = find_def(parse(pinned_tree, MRV2), "GPUModelRunner.capture_model")
    assert len(call_sites(model_capture, "needs_capture")) == 1
