"""One rank of vLLM's own expert-parallel MoE on CPU over gloo (run by test_hook_cpu_expert_parallel.py).

    RANK=<0|1> python _ep_moe.py MODEL_DIR OUT_DIR TP_PORT DP_PORT

Two worlds of 2 ranks, one after the other in the same processes (vLLM's import is most of the cost):
`tp`, tensor-parallel size 2 with --enable-expert-parallel, every rank feeding every row; then `dp`,
data-parallel size 2 with --enable-expert-parallel, each rank feeding its own rows with the DPMetadata
of every step, which the MoE exchanges through AgRsAll2AllManager (the `cpu-communicator-add-gatherv`
patch).  In both, each rank holds 4 of the 8 experts, so the output is right only if the CPU experts
honour the expert map (`cpu-moe-honour-expert-map`).  In `tp` the rank also calls the experts kernel
itself with apply_router_weight_on_input (top-1), a path the model does not take.

After each world the rank writes OUT_DIR/<tp|dp>_r<RANK>.pt: {"steps": [output rows per step]} (and
"weighted_on_input" for tp), so a failing `dp` leaves the `tp` results.  Native vLLM only
(VLLM_PLUGINS=""), fp32, eager, one MoE layer.
"""

from __future__ import annotations

import os
import sys

# Shared with the test: per step, the rows of DP rank 0 and 1 (uneven on purpose); the MoE layer; the
# top-1 rows of the kernel check.
STEP_COUNTS = ((3, 5), (1, 4), (6, 1))
MOE_LAYER = 1  # the tiny Qwen3-MoE's mlp_only_layers is [0]
NUM_TOP1_ROWS = 16


def step_input(step: int, hidden_size: int):
    """The rows of one step, all DP ranks' together; the same in every process."""
    import torch

    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(sum(STEP_COUNTS[step]), hidden_size, generator=generator, dtype=torch.float32)


def top1_input(hidden_size: int, num_experts: int):
    """(rows, expert ids, router weights) of the apply_router_weight_on_input check."""
    import torch

    generator = torch.Generator().manual_seed(7)
    rows = torch.randn(NUM_TOP1_ROWS, hidden_size, generator=generator, dtype=torch.float32)
    ids = (torch.arange(NUM_TOP1_ROWS, dtype=torch.int32) % num_experts).reshape(-1, 1)
    weights = torch.rand(NUM_TOP1_ROWS, 1, generator=generator, dtype=torch.float32) + 0.5
    return rows, ids, weights


def run_world(model_dir: str, out_dir: str, mode: str, rank: int, port: int) -> None:
    """One world of 2 ranks (`tp` or `dp`, both with expert parallelism): build, run every step, save, tear down."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.forward_context import DPMetadata, create_forward_context, override_forward_context
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    size = {"data_parallel_size": 2} if mode == "dp" else {"tensor_parallel_size": 2}
    config = EngineArgs(
        model=model_dir, enforce_eager=True, skip_tokenizer_init=True, dtype="float32", max_model_len=256,
        max_num_batched_tokens=256, distributed_executor_backend="external_launcher",
        enable_expert_parallel=True, **size,
    ).create_engine_config()
    with set_current_vllm_config(config), set_default_torch_dtype(config.model_config.dtype):
        init_distributed_environment(world_size=2, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=rank, backend="gloo")
        ensure_model_parallel_initialized(2 if mode == "tp" else 1, 1)
        model = initialize_model(vllm_config=config)
        get_model_loader(config.load_config).load_weights(model, config.model_config)
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))
        block = model.model.layers[MOE_LAYER].mlp
        assert block.experts.expert_map is not None, f"{mode} rank {rank}: expected expert parallelism"
        hidden_size = config.model_config.hf_text_config.hidden_size
        all_moe = config.compilation_config.static_all_moe_layers
        steps = []
        for step, counts in enumerate(STEP_COUNTS):
            rows = step_input(step, hidden_size)
            metadata = None
            if mode == "dp":
                rows = rows[sum(counts[:rank]) : sum(counts[: rank + 1])]
                counts_across_dp = torch.tensor(counts, dtype=torch.int32)
                metadata = DPMetadata.make(config.parallel_config, counts[rank], counts_across_dp)
            context = create_forward_context(None, config, dp_metadata=metadata)
            with torch.inference_mode(), override_forward_context(context):
                # NOTE: as the AFD FFN runner: the fast-MoE cold start reads the layer's index.
                context.moe_layer_index = all_moe.index(f"model.layers.{MOE_LAYER}.mlp.experts") if all_moe else 0
                steps.append(block(rows).clone())
        result = {"steps": steps}
        if mode == "tp":
            result["weighted_on_input"] = weighted_on_input(block.experts, hidden_size, MoEActivation.SILU)
        torch.save(result, os.path.join(out_dir, f"{mode}_r{rank}.pt"))
        destroy_model_parallel()
        destroy_distributed_environment()
    print(f"{mode} rank {rank}: done", flush=True)


def weighted_on_input(experts, hidden_size: int, activation):
    """This rank's share of top-1 rows whose router weight is already in the input (the kernel skips it)."""
    import torch

    routed = experts.routed_experts
    rows, ids, weights = top1_input(hidden_size, experts.expert_map.numel())
    output = torch.zeros_like(rows)
    empty = torch.empty(0)
    with torch.inference_mode():
        routed.quant_method.moe_kernel.fused_experts.apply(
            output, rows * weights, routed.w13_weight, routed.w2_weight, weights, ids, activation,
            experts.expert_map.numel(), experts.expert_map, None, None, empty, empty, None, True,
        )
    return output


if __name__ == "__main__":
    base_ident = os.environ["VLLM_DIST_IDENT"]
    for mode, port in (("tp", sys.argv[3]), ("dp", sys.argv[4])):
        os.environ["VLLM_DIST_IDENT"] = f"{base_ident}-{mode}"  # names the CPU SHM groups of this world
        run_world(sys.argv[1], sys.argv[2], mode, int(os.environ["RANK"]), int(port))
