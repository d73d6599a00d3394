"""Worker-start rules (docs/config.md#worker-start-checks) on real VllmConfigs built by vLLM's EngineArgs."""

from __future__ import annotations

import pytest

from vllm_afd.config import AFDConfig
from vllm_afd.validation import (
    check_features,
    check_worker_stack,
    graph_mode,
    worker_class_for,
)

vllm = pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from afd_harness.tiny_models import build_tiny_model

    return build_tiny_model("qwen3_moe", tmp_path_factory.mktemp("models") / "qwen3_moe")


def make_config(model_dir, afd: dict, **engine_args):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(model_dir), enforce_eager=True, max_model_len=256,
                      additional_config={"afd": afd}, **engine_args)
    return args.create_engine_config()


def test_worker_class_per_platform_and_role():
    assert worker_class_for("cpu", "ffn") == "vllm_afd.workers.cpu.AFDCPUFFNWorker"
    assert worker_class_for("cuda", "attention") == "vllm_afd.workers.cuda.AFDAttentionWorker"
    with pytest.raises(ValueError, match="does not support the current platform: 'xpu'"):
        worker_class_for("xpu", "ffn")


@pytest.mark.parametrize("worker_cls, error, message", [
    (object, ValueError, "must be a qualname string"),
    ("auto", RuntimeError, "remained 'auto' after AFD config normalization"),
    ("vllm.v1.worker.cpu_worker.CPUWorker", ValueError,
     "got=vllm.v1.worker.cpu_worker.CPUWorker expected=vllm_afd.workers.cpu.AFDCPUFFNWorker; "
     "remove --worker-cls or pass --worker-cls vllm_afd.workers.cpu.AFDCPUFFNWorker"),
])
def test_wrong_worker_stack_is_refused_with_the_fix(worker_cls, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_worker_stack(worker_cls, "cpu", "ffn")


def test_the_config_hook_picked_the_role_worker(model_dir):
    config = make_config(model_dir, {"role": "ffn", "connector": "P2pGlooAFDConnector"})

    check_worker_stack(config.parallel_config.worker_cls, "cpu", "ffn")
    assert config.cache_config.enable_prefix_caching is False  # KV-less FFN engine
    assert graph_mode(config) == "eager"


def test_a_valid_cpu_config_passes(model_dir):
    afd = {"role": "attention", "connector": "P2pGlooAFDConnector"}
    config = make_config(model_dir, afd)

    check_features(config, AFDConfig.from_mapping(afd), "cpu")


@pytest.mark.parametrize("afd, engine_args, message", [
    ({"connector": "P2pNcclAFDConnector"}, {}, "P2pNcclAFDConnector requires CUDA devices"),
    ({"connector": "P2pIpcAFDConnector"}, {}, "P2pIpcAFDConnector requires CUDA devices; use P2pGlooAFDConnector on CPU"),
    ({"num_attention_ranks": 2}, {},
     r"num_attention_ranks \(2\) must equal attention DP x TP \(1 x 1\)"),
    ({"role": "ffn", "num_attention_ranks": 2, "num_ffn_ranks": 2}, {},
     r"num_ffn_ranks \(2\) must equal ffn DP x TP \(1 x 1\)"),
    ({}, {"enable_lora": True}, "AFD does not support LoRA; disable --enable-lora"),
    ({"role": "ffn", "num_attention_ranks": 2, "num_ffn_ranks": 2}, {"data_parallel_size": 2},
     r"FFN role with data parallelism \(--data-parallel-size 2\) is not supported yet"),
])
def test_unsupported_setups_are_refused_before_any_resource(model_dir, afd, engine_args, message):
    afd = {"connector": "P2pGlooAFDConnector", **afd}
    config = make_config(model_dir, afd, **engine_args)

    with pytest.raises(ValueError, match=message):
        check_features(config, AFDConfig.from_mapping(afd), "cpu")
