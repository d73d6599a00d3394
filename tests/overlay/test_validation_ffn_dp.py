"""FFN data parallelism and expert parallelism at worker start (docs/config.md#ffn-data-parallelism).

Real VllmConfigs built by vLLM's EngineArgs for the CPU; a field the CPU cannot build (TP 2, a graph mode, a
backend) is set on the config object this test built, which is the object the check reads.  The installed
vLLM's patches are an argument of the two checks, so each rule is pinned with and without the pin fixes;
`check_features` asks the installed stamp (last tests).
"""

from __future__ import annotations

import pytest

from vllm_afd.config import AFDConfig
from vllm_afd.validation import (
    CPU_EP_PATCH,
    CPU_GATHERV_PATCH,
    check_cpu_expert_parallel,
    check_features,
    check_ffn_data_parallel,
)

vllm = pytest.importorskip("vllm")

from tests.connectors._vllm_configs import skip_without_cpu_configs  # noqa: E402
from vllm_afd.pin import BUILD_HINT, installed_patches  # noqa: E402

BOTH_FIXES = frozenset({CPU_GATHERV_PATCH, CPU_EP_PATCH})
WHERE = "AFD FFN with --data-parallel-size 2"


@pytest.fixture
def ffn_config(model_dir):
    """An FFN's config at DP 2 (num_ffn_ranks 2) that FFN DP accepts; keyword args change the AFD config."""
    from vllm.engine.arg_utils import EngineArgs

    skip_without_cpu_configs()

    def build(data_parallel_size: int = 2, enable_expert_parallel: bool = True, **afd_overrides):
        afd = {"role": "ffn", "connector": "P2pGlooAFDConnector", "num_attention_ranks": 2,
               "num_ffn_ranks": data_parallel_size, "reform_timeout_s": 0, **afd_overrides}
        args = EngineArgs(model=str(model_dir), enforce_eager=True, max_model_len=256, skip_tokenizer_init=True,
                          additional_config={"afd": afd}, data_parallel_size=data_parallel_size,
                          enable_expert_parallel=enable_expert_parallel)
        return args.create_engine_config(), AFDConfig.from_mapping(afd)

    return build


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
@pytest.mark.parametrize("expert_parallel", [True, False])
def test_ffn_dp_2_at_tp_1_eager_without_re_forming_runs(ffn_config, platform, expert_parallel):
    config, afd = ffn_config(enable_expert_parallel=expert_parallel)

    check_ffn_data_parallel(config, afd, platform, BOTH_FIXES)
    check_cpu_expert_parallel(config, platform, BOTH_FIXES)


def test_ffn_dp_with_ffn_tp_is_refused_naming_both_ways_out(ffn_config):
    config, afd = ffn_config(num_attention_ranks=4, num_ffn_ranks=4)
    config.parallel_config.tensor_parallel_size = 2

    with pytest.raises(ValueError) as info:
        check_ffn_data_parallel(config, afd, "cpu", BOTH_FIXES)

    assert str(info.value) == (
        f"{WHERE}: FFN TP is 2; FFN data parallelism runs at FFN TP 1 only for now. Pass --tensor-parallel-size 1 "
        "and set num_ffn_ranks to the FFN's DP size, or scale the FFN with --tensor-parallel-size at "
        "--data-parallel-size 1.")


@pytest.mark.parametrize("backend", ["deepep_low_latency", "deepep_high_throughput", "nixl_ep"])
def test_ffn_dp_on_cuda_needs_the_allgather_reducescatter_backend(ffn_config, backend):
    config, afd = ffn_config()
    config.parallel_config.all2all_backend = backend

    with pytest.raises(ValueError) as info:
        check_ffn_data_parallel(config, afd, "cuda", BOTH_FIXES)
    check_ffn_data_parallel(config, afd, "cpu", BOTH_FIXES)  # the CPU communicator uses it whatever is asked

    assert str(info.value) == (
        f"{WHERE}: all2all backend {backend!r}; expected 'allgather_reducescatter', the one AFD's FFN data "
        "parallelism has run with. Pass --all2all-backend allgather_reducescatter.")


def test_ffn_dp_with_cuda_graphs_is_refused_until_it_ran_on_several_gpus(ffn_config):
    from vllm.config import CUDAGraphMode

    config, afd = ffn_config(connector="P2pNcclAFDConnector")
    config.model_config.enforce_eager = False
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY

    with pytest.raises(ValueError) as info:
        check_ffn_data_parallel(config, afd, "cuda", BOTH_FIXES)

    assert str(info.value) == (
        f"{WHERE}: CUDA graphs (FULL_DECODE_ONLY) are not supported yet; every FFN DP rank would capture the MoE "
        "collectives of every step shape, which has not run on several GPUs. Pass --enforce-eager on both roles.")


@pytest.mark.parametrize("seconds", [600.0, 0.5, 0.0])
def test_ffn_dp_re_forms_as_a_pool_at_any_reform_timeout(ffn_config, seconds):
    """Decision 48: the FFN DP ranks leave a failed step and re-form together (ffn/pool.py)."""
    config, afd = ffn_config(reform_timeout_s=seconds)

    check_ffn_data_parallel(config, afd, "cpu", BOTH_FIXES)


def test_ffn_dp_on_cpu_without_the_gatherv_patch_is_refused(ffn_config):
    config, afd = ffn_config()

    with pytest.raises(RuntimeError) as info:
        check_ffn_data_parallel(config, afd, "cpu", frozenset({CPU_EP_PATCH}))
    check_ffn_data_parallel(config, afd, "cuda", frozenset())  # NCCL's communicator has all_gatherv

    assert str(info.value) == (
        f"{WHERE} on CPU: the installed vLLM lacks the patch cpu-communicator-add-gatherv (its CpuCommunicator has "
        "no all_gatherv / reduce_scatterv, which vLLM's MoE dispatch calls at DP > 1). Install the patched vLLM "
        f"of this overlay's series. {BUILD_HINT}")


def test_ffn_dp_1_meets_none_of_the_dp_rules(ffn_config):
    config, afd = ffn_config(data_parallel_size=1, reform_timeout_s=600)

    check_ffn_data_parallel(config, afd, "cpu", frozenset())


@pytest.mark.parametrize("data_parallel_size", [1, 2])
def test_cpu_expert_parallelism_without_the_expert_map_fix_is_refused_even_at_dp_1(ffn_config, data_parallel_size):
    """Without the fix vLLM's CPU experts ignore the expert map: wrong outputs, no error (TP 2 + EP measured)."""
    config, _ = ffn_config(data_parallel_size=data_parallel_size)

    with pytest.raises(RuntimeError) as info:
        check_cpu_expert_parallel(config, "cpu", frozenset({CPU_GATHERV_PATCH}))
    check_cpu_expert_parallel(config, "cuda", frozenset())

    assert str(info.value) == (
        "AFD FFN with --enable-expert-parallel on CPU: the installed vLLM lacks the patch cpu-moe-honour-expert-map, "
        "without which vLLM's CPU experts ignore the expert map and compute wrong outputs silently. Remove "
        f"--enable-expert-parallel, or install the patched vLLM of this overlay's series. {BUILD_HINT}")


def test_cpu_expert_parallelism_with_a_quantized_model_is_refused(ffn_config):
    config, _ = ffn_config()
    config.model_config.quantization = "fp8"

    with pytest.raises(ValueError) as info:
        check_cpu_expert_parallel(config, "cpu", BOTH_FIXES)

    assert str(info.value) == (
        "AFD FFN with --enable-expert-parallel on CPU: quantization 'fp8'; expected an unquantized model "
        "(cpu-moe-honour-expert-map covers vLLM's unquantized CPU experts only). Remove --enable-expert-parallel, "
        "or serve an unquantized checkpoint.")


# ---- check_features: the FFN's rules, the installed stamp's patches -------------------------------------------


def test_check_features_asks_the_installed_vllm_for_the_cpu_pin_fixes(ffn_config):
    config, afd = ffn_config()
    missing = sorted(BOTH_FIXES - installed_patches())

    if not missing:
        check_features(config, afd, "cpu")
        return
    with pytest.raises(RuntimeError, match=f"the installed vLLM lacks the patch {missing[0]}"):
        check_features(config, afd, "cpu")


def test_the_attention_meets_none_of_the_ffn_rules(cpu_attention_config):
    """The attention builds no fused-MoE layer (docs/models.md): its DP, EP and re-forming are unaffected."""
    config, afd = cpu_attention_config

    check_features(config, afd, "cpu")


@pytest.fixture
def cpu_attention_config(model_dir):
    from vllm.engine.arg_utils import EngineArgs

    skip_without_cpu_configs()

    afd = {"role": "attention", "connector": "P2pGlooAFDConnector", "num_attention_ranks": 2}
    args = EngineArgs(model=str(model_dir), enforce_eager=True, max_model_len=256, skip_tokenizer_init=True,
                      additional_config={"afd": afd}, data_parallel_size=2, enable_expert_parallel=True)
    return args.create_engine_config(), AFDConfig.from_mapping(afd)
