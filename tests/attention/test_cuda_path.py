"""The CUDA path's pure parts, on CPU: payload row counts, graph keys, FFN run modes, and the
classes the CUDA runner hands to vLLM (docs/attention.md#publish-rule, docs/ffn.md#run-mode-and-graph-key)."""

from __future__ import annotations

import pytest

from vllm_afd.attention.step import stage_counts, step_counts
from vllm_afd.ffn.graphs import graph_key, run_mode
from vllm_afd.wire.messages import ControlPayload


def test_single_dp_rank_publishes_the_padded_batch():
    assert step_counts(1, 0, 64, None) == [64]


def test_dp_ranks_publish_vllms_synced_vector_and_check_their_own_entry():
    assert step_counts(2, 1, 64, [64, 64]) == [64, 64]
    with pytest.raises(RuntimeError, match="expected entry 1 to equal this rank's padded batch"):
        step_counts(2, 1, 32, [64, 64])
    with pytest.raises(RuntimeError, match="AFD expected vLLM DPMetadata for attention DP > 1"):
        step_counts(2, 0, 64, None)


def test_capture_publishes_the_descriptor_size_for_every_dp_rank():
    # Reference test: DP2 capture publishes [64, 64].
    assert stage_counts([64], 2) == {0: [64, 64]}
    assert stage_counts([1], 1) == {0: [1]}


def payload(counts_by_stage, **flags):
    return ControlPayload(counts_by_stage, **flags)


def test_graph_key_keeps_attention_rank_counts_so_layouts_do_not_alias():
    four_four = graph_key(payload({0: [4, 4]}))
    seven_one = graph_key(payload({0: [7, 1]}))

    assert four_four == ((0, (4, 4)),)
    assert four_four != seven_one  # same FFN total (8), different peer shapes (#261)
    assert graph_key(payload({1: [2], 0: [3]})) == ((0, (3,)), (1, (2,)))


@pytest.mark.parametrize("flags, use_graphs, has_graph, mode", [
    ({"is_warmup": True}, True, False, "WARMUP"),
    ({"is_graph_capturing": True}, True, True, "CAPTURE"),
    ({"is_graph_replaying": True}, True, True, "REPLAY"),
    ({"is_graph_replaying": True}, True, False, "EAGER"),   # unknown key
    ({"is_graph_replaying": True}, False, True, "EAGER"),   # FFN graphs off
    ({}, True, True, "EAGER"),  # eager prefill of a captured shape: never replay (#261)
])
def test_ffn_replays_only_with_the_flag_graphs_on_and_a_known_key(flags, use_graphs,
                                                                   has_graph, mode):
    assert run_mode(payload({0: [1]}, **flags), use_cuda_graph=use_graphs,
                    has_graph=has_graph) == mode


def test_cuda_runner_classes_subclass_vllms_own():
    pytest.importorskip("vllm")
    from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from vllm_afd.attention.capture import AFDModelCudaGraphManager, bind_cudagraph_manager
    from vllm_afd.attention.runner import AFDAttentionModelRunner

    runner = object()  # only stored on the class: vLLM builds the instance
    bound = bind_cudagraph_manager(runner)

    assert issubclass(AFDAttentionModelRunner, GPUModelRunner)
    assert issubclass(bound, AFDModelCudaGraphManager) and issubclass(bound, ModelCudaGraphManager)
    assert bound.afd_runner is runner and AFDModelCudaGraphManager.afd_runner is None
    # The hooks the runner overrides exist on vLLM's classes (patched build).
    assert "before_model_forward" in vars(GPUModelRunner)
    assert "cudagraph_manager_cls" in vars(GPUModelRunner)
