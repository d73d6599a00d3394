"""Worker-start checks (docs/config.md#worker-start-checks): run in the role worker's `init_device`,
before the runner or any connector resource exists.

Config-shaped problems raise `ValueError`, runtime-shaped ones `RuntimeError`; every
message names the field, the value and the fix.  The checks read plain vLLM config
fields only (no probing): a renamed field fails loudly here, not silently later.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_afd.config import AFDConfig
from vllm_afd.pin import BUILD_HINT, installed_patches
from vllm_afd.releases import compile_sequence_parallelism
from vllm_afd.role import Role

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Worker classes per (platform, role); the config hook and the stack check share them.
WORKER_CLASSES: dict[tuple[str, Role], str] = {
    ("cuda", Role.ATTENTION): "vllm_afd.workers.cuda.AFDAttentionWorker",
    ("cuda", Role.FFN): "vllm_afd.workers.cuda.AFDFFNWorker",
    ("cpu", Role.ATTENTION): "vllm_afd.workers.cpu.AFDCPUAttentionWorker",
    ("cpu", Role.FFN): "vllm_afd.workers.cpu.AFDCPUFFNWorker",
}
# The platform default worker each AFD worker replaces when `worker_cls` is "auto".
PLATFORM_DEFAULT_WORKERS: dict[str, str] = {
    "cuda": "vllm.v1.worker.gpu_worker.Worker",
    "cpu": "vllm.v1.worker.cpu_worker.CPUWorker",
}
GRAPH_MODES = ("eager", "FULL_DECODE_ONLY")
# Connectors that move GPU memory only; and the one whose host round trips a CUDA graph cannot record.
CUDA_CONNECTORS = ("P2pNcclAFDConnector", "P2pIpcAFDConnector")
EAGER_ONLY_CONNECTORS = ("P2pGlooAFDConnector",)
# Pin fixes of the series that FFN DP and EP on CPU need (docs/hooks.md); checked against the installed stamp.
CPU_GATHERV_PATCH = "cpu-communicator-add-gatherv"
CPU_EP_PATCH = "cpu-moe-honour-expert-map"


def worker_class_for(platform: str, role: str) -> str:
    """Qualified name of the AFD worker for `platform` ("cuda"/"cpu") and `role`."""
    try:
        return WORKER_CLASSES[(platform, role)]
    except KeyError:
        raise ValueError(
            f"AFD automatic worker selection does not support the current platform: "
            f"{platform!r}; AFD supports CUDA and CPU."
        ) from None


def graph_mode(vllm_config: VllmConfig) -> str:
    """The AFD graph mode of a config: "eager" or the CUDA-graph mode's name."""
    from vllm.config import CUDAGraphMode

    mode = vllm_config.compilation_config.cudagraph_mode
    if vllm_config.model_config.enforce_eager or mode in (None, CUDAGraphMode.NONE):
        return "eager"
    return mode.name


def healing_blocker(vllm_config: VllmConfig, afd: AFDConfig) -> str | None:
    """Why an attention server cannot heal a lost FFN by itself (docs/connection.md#healing-attention),
    or None: it can, and its config hook turns on vLLM's fault tolerance for it."""
    parallel = vllm_config.parallel_config
    if afd.reform_timeout_s == 0:
        return "reform_timeout_s is 0"
    if parallel.data_parallel_size > 1:
        return (f"attention DP {parallel.data_parallel_size} runs in one vllm serve, whose internal DP load "
                "balancer vLLM's fault tolerance refuses; start one vllm serve per DP rank to heal")
    if getattr(parallel, "_api_process_count", 1) > 1:
        return "vLLM's fault tolerance needs --api-server-count 1"
    return None


def check_worker_stack(worker_cls: object, platform: str, role: str) -> None:
    """The worker class the engine chose must be this role's AFD worker."""
    if not isinstance(worker_cls, str):
        raise ValueError(
            f"parallel_config.worker_cls must be a qualname string, got {worker_cls!r}; "
            "pass --worker-cls as a dotted class name or leave it 'auto'."
        )
    if worker_cls == "auto":
        raise RuntimeError(
            "parallel_config.worker_cls remained 'auto' after AFD config normalization; "
            "install the AFD overlay (pip install vllm-afd) so its plugin loads before "
            "VllmConfig is created, and install the patched vLLM build."
        )
    expected = worker_class_for(platform, role)
    if worker_cls != expected:
        raise ValueError(
            f"invalid worker class for AFD runtime stack: got={worker_cls} "
            f"expected={expected}; remove --worker-cls or pass --worker-cls {expected}."
        )


def _require_size_one(field: str, value: int) -> None:
    if value != 1:
        raise ValueError(
            f"AFD requires pipeline/prefill-context/decode-context parallel size 1, got "
            f"{field}={value}; set it to 1 on both roles."
        )


def _reject(feature: str, flag: str) -> None:
    raise ValueError(f"AFD does not support {feature}; disable {flag}.")


def check_features(vllm_config: VllmConfig, afd: AFDConfig, platform: str) -> None:
    """The feature rules of docs/config.md#worker-start-checks (both roles unless noted)."""
    parallel = vllm_config.parallel_config
    role = afd.role

    if afd.connector in CUDA_CONNECTORS and platform != "cuda":
        raise ValueError(
            f"{afd.connector} requires CUDA devices; use P2pGlooAFDConnector on CPU."
        )
    mode = graph_mode(vllm_config)
    if mode != "eager" and afd.connector in EAGER_ONLY_CONNECTORS:
        raise ValueError(
            f"{afd.connector} cannot be captured in CUDA graphs; pass --enforce-eager, or use "
            "P2pIpcAFDConnector (roles on one node) or P2pNcclAFDConnector (across hosts)."
        )
    if mode not in GRAPH_MODES:
        raise ValueError(
            f"AFD only supports CUDA graph mode FULL_DECODE_ONLY for {role}; got {mode!r}. "
            "Pass --enforce-eager or --compilation-config "
            '\'{"cudagraph_mode": "FULL_DECODE_ONLY"}\' identically on both roles.'
        )
    if parallel.enable_dbo or parallel.ubatch_size > 1:
        raise ValueError(
            "AFD does not support vLLM's dual-batch overlap / microbatching (--enable-dbo, --ubatch-size); "
            "remove them. AFD's own micro-batches are additional_config[\"afd\"][\"num_stages\"] "
            "(docs/pingpong.md)."
        )
    _require_size_one("pipeline_parallel_size", parallel.pipeline_parallel_size)
    _require_size_one("prefill_context_parallel_size", parallel.prefill_context_parallel_size)
    _require_size_one("decode_context_parallel_size", parallel.decode_context_parallel_size)

    num_role_ranks = parallel.data_parallel_size * parallel.tensor_parallel_size
    expected = afd.num_attention_ranks if role == Role.ATTENTION else afd.num_ffn_ranks
    field = "num_attention_ranks" if role == Role.ATTENTION else "num_ffn_ranks"
    if num_role_ranks != expected:
        raise ValueError(
            f"{field} ({expected}) must equal {role} DP x TP "
            f"({parallel.data_parallel_size} x {parallel.tensor_parallel_size}); "
            f"set {field} to {num_role_ranks} or change --data-parallel-size / "
            "--tensor-parallel-size."
        )

    if role == Role.FFN:
        patches = installed_patches()
        check_ffn_data_parallel(vllm_config, afd, platform, patches)
        check_cpu_expert_parallel(vllm_config, platform, patches)
    if parallel.enable_eplb:
        _reject("expert-parallel load balancing (EPLB)", "--enable-eplb")
    if parallel.enable_elastic_ep:
        _reject("elastic expert parallelism", "--enable-elastic-ep")
    if parallel.use_sequence_parallel_moe:
        # NOTE: SP MoE reshapes hidden states around the `mlp` call inside the native decoder forward
        # (DeepSeek) or the MoE block (Qwen3); the split point assumes full rows.
        _reject("sequence-parallel MoE", "sequence parallelism for MoE")
    if compile_sequence_parallelism(vllm_config.compilation_config):
        _reject("compile-time sequence parallelism", "pass_config.enable_sp")
    if vllm_config.speculative_config is not None:
        _reject("speculative decoding", "--speculative-config")
    if vllm_config.lora_config is not None:
        _reject("LoRA", "--enable-lora")

    check_cpu_mla(vllm_config, role, platform)


def check_ffn_data_parallel(vllm_config: VllmConfig, afd: AFDConfig, platform: str,
                            patches: frozenset[str]) -> None:
    """FFN DP > 1 (docs/config.md#ffn-data-parallelism): what runs today; `patches` = the installed vLLM's."""
    parallel = vllm_config.parallel_config
    dp = parallel.data_parallel_size
    if dp == 1:
        return
    where = f"AFD FFN with --data-parallel-size {dp}"
    if parallel.tensor_parallel_size > 1:
        # NOTE: with EP, DP x TP is vLLM's sequence-parallel MoE (refused); without, the DP x TP flattening of
        # the experts has not run behind AFD.
        raise ValueError(
            f"{where}: FFN TP is {parallel.tensor_parallel_size}; FFN data parallelism runs at FFN TP 1 only "
            "for now. Pass --tensor-parallel-size 1 and set num_ffn_ranks to the FFN's DP size, or scale the "
            "FFN with --tensor-parallel-size at --data-parallel-size 1."
        )
    if platform != "cpu" and parallel.all2all_backend != "allgather_reducescatter":
        # NOTE: the CPU communicator uses allgather_reducescatter whatever is asked; the batched backends
        # (DeepEP, NIXL, Mori, FlashInfer) have their own formats and capacity limits, none of them run here.
        raise ValueError(
            f"{where}: all2all backend {parallel.all2all_backend!r}; expected 'allgather_reducescatter', the "
            "one AFD's FFN data parallelism has run with. Pass --all2all-backend allgather_reducescatter."
        )
    if graph_mode(vllm_config) != "eager":
        raise ValueError(
            f"{where}: CUDA graphs ({graph_mode(vllm_config)}) are not supported yet; every FFN DP rank would "
            "capture the MoE collectives of every step shape, which has not run on several GPUs. Pass "
            "--enforce-eager on both roles."
        )
    if platform == "cpu" and CPU_GATHERV_PATCH not in patches:
        raise RuntimeError(
            f"{where} on CPU: the installed vLLM lacks the patch {CPU_GATHERV_PATCH} (its CpuCommunicator "
            "has no all_gatherv / reduce_scatterv, which vLLM's MoE dispatch calls at DP > 1). Install the "
            f"patched vLLM of this overlay's series. {BUILD_HINT}"
        )


def check_cpu_expert_parallel(vllm_config: VllmConfig, platform: str, patches: frozenset[str]) -> None:
    """FFN with --enable-expert-parallel on CPU: vLLM's CPU experts must honour the expert map."""
    parallel = vllm_config.parallel_config
    if platform != "cpu" or not parallel.enable_expert_parallel:
        return
    # NOTE: the plugin's stamp check guarantees only the release's required patches, not the whole series, so the
    # stamp's patch list is asked. Without the fix every EP rank applies its local experts to global expert ids:
    # wrong outputs, no error, even at DP 1 with TP 2.
    if CPU_EP_PATCH not in patches:
        raise RuntimeError(
            "AFD FFN with --enable-expert-parallel on CPU: the installed vLLM lacks the patch "
            f"{CPU_EP_PATCH}, without which vLLM's CPU experts ignore the expert map and compute wrong outputs "
            f"silently. Remove --enable-expert-parallel, or install the patched vLLM of this overlay's series. "
            f"{BUILD_HINT}"
        )
    quantization = vllm_config.model_config.quantization
    if quantization is not None:
        raise ValueError(
            f"AFD FFN with --enable-expert-parallel on CPU: quantization {quantization!r}; expected an "
            f"unquantized model ({CPU_EP_PATCH} covers vLLM's unquantized CPU experts only). Remove "
            "--enable-expert-parallel, or serve an unquantized checkpoint."
        )


def check_cpu_mla(vllm_config: VllmConfig, role: str, platform: str) -> None:
    """vLLM's CPU MLA backend serves only a 512 + 64 latent
    (docs/models.md#platforms-test-models-and-gate-placement)."""
    model_config = vllm_config.model_config
    if platform != "cpu" or role != Role.ATTENTION or not model_config.use_mla:
        return
    hf = model_config.hf_text_config
    if (hf.kv_lora_rank, hf.qk_rope_head_dim) != (512, 64):
        raise ValueError(
            "vLLM's CPU MLA backend needs kv_lora_rank=512 and qk_rope_head_dim=64 "
            f"(model: {hf.kv_lora_rank}, {hf.qk_rope_head_dim}); set VLLM_MLA_DISABLE=1."
        )
