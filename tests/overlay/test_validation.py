"""Worker-start rules (docs/config.md#worker-start-checks) on real VllmConfigs built by vLLM's EngineArgs."""

from __future__ import annotations

import pytest

from vllm_afd.config import AFDConfig
from vllm_afd.validation import (
    check_cpu_mla,
    check_features,
    check_worker_stack,
    graph_mode,
    worker_class_for,
)

vllm = pytest.importorskip("vllm")

from tests.connectors._vllm_configs import skip_without_cpu_configs  # noqa: E402
from vllm_afd.releases import installed  # noqa: E402

# vLLM 0.32 removed compile-time sequence parallelism (overlay/vllm_afd/releases.py).
NEEDS_SP_PASS = pytest.mark.skipif(not installed().has_compile_sp_pass,
                                   reason=f"vLLM {installed().version} has no PassConfig.enable_sp")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from afd_harness.tiny_models import build_tiny_model

    return build_tiny_model("qwen3_moe", tmp_path_factory.mktemp("models") / "qwen3_moe")


def make_config(model_dir, afd: dict, **engine_args):
    from vllm.engine.arg_utils import EngineArgs

    skip_without_cpu_configs()

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
    ({"connector": "P2pIpcAFDConnector"}, {},
     "P2pIpcAFDConnector requires CUDA devices; use P2pGlooAFDConnector on CPU"),
    ({"num_attention_ranks": 2}, {},
     r"num_attention_ranks \(2\) must equal attention DP x TP \(1 x 1\)"),
    ({"role": "ffn", "num_attention_ranks": 2, "num_ffn_ranks": 2}, {},
     r"num_ffn_ranks \(2\) must equal ffn DP x TP \(1 x 1\)"),
    ({}, {"enable_lora": True}, "AFD does not support LoRA; disable --enable-lora"),
])
def test_unsupported_setups_are_refused_before_any_resource(model_dir, afd, engine_args, message):
    afd = {"connector": "P2pGlooAFDConnector", **afd}
    config = make_config(model_dir, afd, **engine_args)

    with pytest.raises(ValueError, match=message):
        check_features(config, AFDConfig.from_mapping(afd), "cpu")


# ---- every documented worker-start refusal, one test each (docs/config.md) -------------------------------------
# Each pins what is refused, where it is named (the flag or field) and how to fix it.  The configs are real
# VllmConfigs built by vLLM for the CPU; a field that the CPU cannot build (a graph mode, DBO, PP) is set on
# the config object this test built, which is the object the check reads.


@pytest.fixture
def cpu_config(model_dir):
    def build(afd: dict | None = None, **engine_args):
        afd = {"role": "attention", "connector": "P2pGlooAFDConnector", **(afd or {})}
        return make_config(model_dir, afd, **engine_args), AFDConfig.from_mapping(afd)

    return build


def full_decode_graphs(config):
    from vllm.config import CUDAGraphMode

    config.model_config.enforce_eager = False
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    return config


def test_gloo_with_cuda_graphs_is_refused_naming_the_capturable_connectors(cpu_config):
    config, afd = cpu_config()
    full_decode_graphs(config)

    with pytest.raises(ValueError) as info:
        check_features(config, afd, "cuda")

    assert str(info.value) == (
        "P2pGlooAFDConnector cannot be captured in CUDA graphs; pass --enforce-eager, or use P2pIpcAFDConnector "
        "(roles on one node) or P2pNcclAFDConnector (across hosts).")


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL", "FULL_AND_PIECEWISE"])
@pytest.mark.parametrize("role", ["attention", "ffn"])
def test_a_graph_mode_other_than_full_decode_only_is_refused_on_both_roles(cpu_config, mode, role):
    from vllm.config import CUDAGraphMode

    config, afd = cpu_config({"role": role, "connector": "P2pNcclAFDConnector"})
    config.model_config.enforce_eager = False
    config.compilation_config.cudagraph_mode = CUDAGraphMode[mode]

    with pytest.raises(ValueError) as info:
        check_features(config, afd, "cuda")

    assert str(info.value) == (
        f"AFD only supports CUDA graph mode FULL_DECODE_ONLY for {role}; got '{mode}'. Pass --enforce-eager or "
        '--compilation-config \'{"cudagraph_mode": "FULL_DECODE_ONLY"}\' identically on both roles.')


def test_full_decode_only_graphs_pass_with_a_capturable_connector(cpu_config):
    config, afd = cpu_config({"connector": "P2pIpcAFDConnector"})
    full_decode_graphs(config)

    check_features(config, afd, "cuda")

    assert graph_mode(config) == "FULL_DECODE_ONLY"


@pytest.mark.parametrize("field, value", [("enable_dbo", True), ("ubatch_size", 2)])
def test_dual_batch_overlap_and_microbatching_are_refused(cpu_config, field, value):
    config, afd = cpu_config()
    setattr(config.parallel_config, field, value)

    with pytest.raises(ValueError) as info:
        check_features(config, afd, "cpu")

    assert str(info.value) == (
        "AFD does not support vLLM's dual-batch overlap / microbatching (--enable-dbo, --ubatch-size); remove "
        'them. AFD\'s own micro-batches are additional_config["afd"]["num_stages"] (docs/pingpong.md).')


@pytest.mark.parametrize("num_stages", [2, 3])
def test_stages_run_on_both_attention_runners(cpu_config, num_stages):
    config, afd = cpu_config({"num_stages": num_stages})

    check_features(config, afd, "cpu")
    check_features(config, afd, "cuda")


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_stages_run_at_attention_data_parallelism(cpu_config, platform):
    """vLLM's DP vote agrees on the stage count (seams mrv2-add-ubatch-vote, v1-runner-add-ubatch-vote)."""
    config, afd = cpu_config({"num_stages": 2, "num_attention_ranks": 2})
    config.parallel_config.data_parallel_size = 2

    check_features(config, afd, platform)


@pytest.mark.parametrize("field", ["pipeline_parallel_size", "prefill_context_parallel_size",
                                   "decode_context_parallel_size"])
def test_pipeline_and_context_parallelism_are_refused_naming_the_field(cpu_config, field):
    config, afd = cpu_config()
    setattr(config.parallel_config, field, 2)

    with pytest.raises(ValueError) as info:
        check_features(config, afd, "cpu")

    assert str(info.value) == (
        f"AFD requires pipeline/prefill-context/decode-context parallel size 1, got {field}=2; set it to 1 on "
        "both roles.")


def _sequence_parallel_moe(parallel):
    # vLLM derives it: an all2all backend that scatters tokens, expert parallelism, TP > 1 and DP > 1.
    parallel.all2all_backend = "allgather_reducescatter"
    parallel.enable_expert_parallel = True
    parallel.tensor_parallel_size = parallel.data_parallel_size = 2


@pytest.mark.parametrize("change, feature, flag", [
    (lambda c: setattr(c.parallel_config, "enable_eplb", True), "expert-parallel load balancing (EPLB)",
     "--enable-eplb"),
    (lambda c: setattr(c.parallel_config, "enable_elastic_ep", True), "elastic expert parallelism",
     "--enable-elastic-ep"),
    (lambda c: _sequence_parallel_moe(c.parallel_config), "sequence-parallel MoE", "sequence parallelism for MoE"),
    pytest.param(lambda c: setattr(c.compilation_config.pass_config, "enable_sp", True),
                 "compile-time sequence parallelism", "pass_config.enable_sp", marks=NEEDS_SP_PASS),
    (lambda c: setattr(c, "speculative_config", object()), "speculative decoding", "--speculative-config"),
], ids=["eplb", "elastic-ep", "sequence-parallel-moe", "compile-sp", "speculative-decoding"])
def test_unsupported_features_are_refused_naming_the_flag(cpu_config, change, feature, flag):
    # num_attention_ranks follows the DP x TP that the sequence-parallel case sets.
    config, afd = cpu_config({"num_attention_ranks": 1})
    change(config)
    parallel = config.parallel_config
    afd = AFDConfig.from_mapping({**afd.to_mapping(),
                                  "num_attention_ranks": parallel.data_parallel_size * parallel.tensor_parallel_size})

    with pytest.raises(ValueError) as info:
        check_features(config, afd, "cpu")

    assert str(info.value) == f"AFD does not support {feature}; disable {flag}."


def deepseek_config(tmp_path, monkeypatch, *, kv_lora_rank: int, qk_rope_head_dim: int, mla_disable: bool = False):
    """A real VllmConfig of a config-only tiny DeepSeek-V2 (MLA unless VLLM_MLA_DISABLE=1)."""
    import transformers
    from afd_harness.tiny_models import TINY_ARCHS
    from vllm.config import ModelConfig, VllmConfig

    skip_without_cpu_configs()
    monkeypatch.setenv("VLLM_MLA_DISABLE", "1" if mla_disable else "0")
    recipe = {**TINY_ARCHS["deepseek_v2"].config, "kv_lora_rank": kv_lora_rank, "qk_rope_head_dim": qk_rope_head_dim}
    hf_config = transformers.DeepseekV2Config(**recipe, vocab_size=512)
    hf_config.architectures = ["DeepseekV2ForCausalLM"]
    hf_config.save_pretrained(tmp_path)
    model_config = ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True)
    return VllmConfig(model_config=model_config, additional_config={"afd": {"connector": "P2pGlooAFDConnector"}})


def test_cpu_mla_with_a_latent_the_cpu_backend_cannot_serve_is_refused(tmp_path, monkeypatch):
    config = deepseek_config(tmp_path, monkeypatch, kv_lora_rank=64, qk_rope_head_dim=32)
    afd = AFDConfig.from_mapping({"connector": "P2pGlooAFDConnector"})

    with pytest.raises(ValueError) as info:
        check_features(config, afd, "cpu")

    assert config.model_config.use_mla
    assert str(info.value) == (
        "vLLM's CPU MLA backend needs kv_lora_rank=512 and qk_rope_head_dim=64 (model: 64, 32); set "
        "VLLM_MLA_DISABLE=1.")


@pytest.mark.parametrize("kv_lora_rank, qk_rope_head_dim, mla_disable, role", [
    (512, 64, False, "attention"),  # the latent the CPU MLA backend serves
    (64, 32, True, "attention"),  # the fix the message names
    (64, 32, False, "ffn"),  # the FFN runs no attention
])
def test_cpu_mla_is_refused_only_where_it_cannot_run(tmp_path, monkeypatch, kv_lora_rank, qk_rope_head_dim,
                                                     mla_disable, role):
    config = deepseek_config(tmp_path, monkeypatch, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                             mla_disable=mla_disable)

    check_cpu_mla(config, role, "cpu")


@pytest.mark.skipif(not installed().has_model_runner_v1, reason="no Model Runner V1 to refuse (vLLM 0.34+)")
def test_the_cuda_attention_worker_refuses_the_v1_model_runner(cpu_config, monkeypatch):
    from vllm_afd.workers.cuda import AFDAttentionWorker

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    config, _ = cpu_config()
    config.parallel_config.worker_cls = "vllm_afd.workers.cuda.AFDAttentionWorker"
    worker = AFDAttentionWorker(vllm_config=config, local_rank=0, rank=0,
                                distributed_init_method="tcp://127.0.0.1:1", is_driver_worker=True)

    with pytest.raises(ValueError) as info:
        worker.init_device()

    assert not worker.use_v2_model_runner
    assert str(info.value) == "AFD on CUDA requires Model Runner V2; unset VLLM_USE_V2_MODEL_RUNNER=0."
