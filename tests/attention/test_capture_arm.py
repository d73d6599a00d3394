"""attention/capture.py:CaptureArm: graph warm-up and capture forwards and micro-batch stages get a sidecar
of their stage, KV side contexts none (docs/decisions.md#22-capture-forwards-get-their-sidecar-from-an-arm;
docs/attention.md#forward-context-sidecar).

The capture hook arms the one context its forward builds next, the micro-batch runner the k it builds next; an
armed context takes the arm whatever it carries.  Unarmed, a batch descriptor marks an executed step.  Up to vLLM
0.32 a FULL capture forward's context had no descriptor; since 0.33 it has one, so the arm, not the descriptor,
must tell a capture forward from a side context.  The last tests build the contexts with vLLM's own capture code.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_afd.attention.capture import CaptureArm

# Context kinds: executed steps carry a batch descriptor; split steps' stages (k of them built together) and KV
# side contexts do not; capture forwards do since vLLM 0.33 (CAPTURE_33) and did not before (CAPTURE).
STEP, CAPTURE, CAPTURE_33, SPLIT2, SPLIT3, KV = "step", "capture", "capture-0.33", "split2", "split3", "kv"
WITH, WITHOUT = SimpleNamespace(batch_descriptor="desc"), SimpleNamespace(batch_descriptor=None)


@given(st.lists(st.sampled_from([STEP, CAPTURE, CAPTURE_33, SPLIT2, SPLIT3, KV]), max_size=30))
def test_exactly_the_model_forwards_take_a_sidecar_of_their_stage(kinds):
    """Any sequence vLLM may produce: each capture forward follows its hook, each split step's stage contexts
    follow its runner's prepare; side contexts come anywhere."""
    arm = CaptureArm()
    got, expected = [], []

    for kind in kinds:
        if kind in (SPLIT2, SPLIT3):
            k = 2 if kind == SPLIT2 else 3
            arm.arm(k)  # AFDUBatchRunner.prepare, then vLLM builds the k contexts
            got += [arm.stage_of(WITHOUT) for _ in range(k)]
            expected += list(range(k))
            continue
        if kind in (CAPTURE, CAPTURE_33):
            arm.arm()  # before_capture_forward published for this forward
        got.append(arm.stage_of(WITH if kind in (STEP, CAPTURE_33) else WITHOUT))
        expected.append(None if kind == KV else 0)

    assert got == expected


def test_an_arm_is_spent_by_its_contexts_and_a_new_arm_replaces_a_stale_one():
    arm = CaptureArm()

    arm.arm()
    assert arm.stage_of(WITH) == 0  # a capture forward with a descriptor (vLLM 0.33+) spends the arm
    assert arm.stage_of(WITHOUT) is None  # so a later KV context gets none
    assert arm.stage_of(WITH) == 0
    arm.arm(3)
    assert arm.stage_of(WITHOUT) == 0
    arm.arm(2)  # a prepare that failed half-way leaves nothing behind
    assert [arm.stage_of(WITHOUT) for _ in range(3)] == [0, 1, None]


# ---- the contexts as vLLM builds them ---------------------------------------------------------------------


def vllm_capture(manager, monkeypatch, descs, after_each_forward):
    """Run vLLM's own `ModelCudaGraphManager.capture` (its `create_forward_fn` and `forward_fn`, which build the
    contexts through `set_forward_context`) for `descs`, with the base class's device loop replaced by its
    order of calls without `torch.cuda.graph`: per descriptor a warm-up, then a recorded forward, each after
    the capture hook (patch `cudagraph-add-before-capture-forward`), and `after_each_forward` after each."""
    import torch
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu import cudagraph_utils

    def device_free_loop(self, create_forward_fn, progress_bar_desc=""):
        for desc in descs:
            forward_fn = create_forward_fn(desc, warmup=True)
            self.before_capture_forward(desc, warmup=True)
            forward_fn(CUDAGraphMode.NONE)
            after_each_forward()
            if desc.cg_mode == CUDAGraphMode.PIECEWISE:  # non-breakable PIECEWISE re-uses the warm-up's inputs
                self.before_capture_forward(desc, warmup=False)
                forward_fn(CUDAGraphMode.PIECEWISE)
                after_each_forward()
            else:
                forward_fn = create_forward_fn(desc, warmup=False)
                self.before_capture_forward(desc, warmup=False)
                forward_fn(CUDAGraphMode.NONE)  # inside torch.cuda.graph on a device
                after_each_forward()

    manager._capture_descs = {desc.cg_mode: [desc] for desc in descs}  # what vLLM's _init_candidates fills
    monkeypatch.setattr(cudagraph_utils.CudaGraphManager, "capture", device_free_loop)
    monkeypatch.setattr(cudagraph_utils, "prepare_inputs_to_capture", lambda *a, **kw: ({}, {}))
    buffers = SimpleNamespace(input_ids=torch.zeros(16, dtype=torch.int64), positions=torch.zeros(16),
                              is_padding=torch.zeros(16, dtype=torch.bool))
    model_state = SimpleNamespace(prepare_dummy_inputs=lambda num_reqs, num_tokens: {})
    manager.capture(manager.model, model_state, buffers, None, None, [], None)


@pytest.fixture(scope="module")
def vllm_config():
    pytest.importorskip("vllm")
    from vllm.config import CompilationConfig, ParallelConfig, VllmConfig

    try:
        return VllmConfig()
    except RuntimeError:  # vLLM 0.34's CUDA wheel on a CPU-only host: no platform can build one
        return SimpleNamespace(parallel_config=ParallelConfig(), compilation_config=CompilationConfig())


def test_contexts_built_by_vllm_take_the_stage_of_what_they_run(vllm_config, monkeypatch):
    """vLLM's capture code builds each warm-up and recorded forward's context (with a batch descriptor or
    without, as the release does), vLLM's `set_forward_context` the KV connector's side contexts and an
    executed step's; the runner's classification gives the forwards stage 0 and every side context none.
    (A stale arm would hand the side context after a descriptor-carrying capture forward stage 0.)"""
    import torch
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor, get_forward_context, set_forward_context
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor, CudaGraphManager

    from vllm_afd.attention.capture import bind_cudagraph_manager

    arm, seen = CaptureArm(), []
    runner = SimpleNamespace(afd_capture_arm=arm, afd_step=SimpleNamespace(publish_capture=lambda *a, **kw: None))
    manager = object.__new__(bind_cudagraph_manager(runner))
    attributes = dict(vllm_config=vllm_config, cudagraph_mode=CUDAGraphMode.FULL, use_breakable_cg=False,
                      max_num_reqs=16, is_first_pp_rank=True, is_last_pp_rank=True, hidden_states=None,
                      aux_hidden_states=[], intermediate_tensors=None, ubatch_runner=None)
    if not isinstance(getattr(CudaGraphManager, "dp_size", None), property):  # 0.30 keeps it as an attribute
        attributes["dp_size"] = 1
    vars(manager).update(attributes)

    def side_context() -> None:  # vLLM's KV connector, outside a forward (MRV2 kv_connector.py)
        with set_forward_context(None, vllm_config):
            seen.append(("kv", arm.stage_of(get_forward_context())))

    def model(**inputs):
        context = get_forward_context()
        seen.append(("forward", arm.stage_of(context), context.batch_descriptor is not None))
        return torch.zeros(4, 2)

    manager.model = model
    descs = [BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=4, num_reqs=4),
             BatchExecutionDescriptor(cg_mode=CUDAGraphMode.PIECEWISE, num_tokens=4, num_reqs=None)]
    vllm_capture(manager, monkeypatch, descs, after_each_forward=side_context)
    with set_forward_context({}, vllm_config, num_tokens=4, batch_descriptor=BatchDescriptor(num_tokens=4)):
        seen.append(("step", arm.stage_of(get_forward_context())))  # as MRV2's execute_model builds it
    side_context()

    forwards = [entry for entry in seen if entry[0] == "forward"]
    assert [stage for _, stage, _ in forwards] == [0, 0, 0, 0]
    assert [entry[1] for entry in seen if entry[0] == "kv"] == [None] * 5
    assert ("step", 0) in seen
    # On every release some capture forward carries a descriptor: the PIECEWISE one (FULL ones too since 0.33).
    assert forwards[3][2] is True
