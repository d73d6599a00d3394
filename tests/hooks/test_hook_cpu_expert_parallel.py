"""vLLM's own expert parallelism on CPU equals one process without it: the pin fixes
`cpu-communicator-add-gatherv` and `cpu-moe-honour-expert-map` (docs/hooks.md, section 20).

Two pairs of real vLLM processes over gloo (`_ep_moe.py`) run one MoE layer of the tiny Qwen3-MoE in fp32,
each rank holding 4 of its 8 experts: data-parallel size 2 with --enable-expert-parallel (each rank its
own rows; without the first fix the dispatch raises NotImplementedError) and tensor-parallel size 2 with
--enable-expert-parallel (without the second fix every rank applies its local weights to global expert
ids: accepted by vLLM and wrong by 3 to 5 against outputs below 2).  The reference is the layer
computed from the checkpoint with plain torch: softmax router, top 2 renormalised, SwiGLU experts.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from _ep_moe import MOE_LAYER, STEP_COUNTS, step_input, top1_input
from hook_series import SUBPROCESS_TIMEOUT_S

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.vllm  # fast tier: about 20 s on 2 idle cores (vLLM imported twice, in parallel)

WORKER = Path(__file__).with_name("_ep_moe.py")
RANK_TIMEOUT_S = min(SUBPROCESS_TIMEOUT_S, 300.0)
TOLERANCE = 1e-5  # fp32; measured 1e-6 (the top-1 check 2e-6) against outputs up to 3.7


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, patched_python, tiny_model) -> dict[str, list[dict]]:
    """Per world (`tp`, `dp`), both ranks' saved outputs, or {"error": both ranks' log tails}."""
    out_dir = tmp_path_factory.mktemp("ep-moe")
    ports = [str(_free_port()), str(_free_port())]
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "VLLM_PLUGINS": "", "OMP_NUM_THREADS": "1",
               "VLLM_DIST_IDENT": f"afd-ep-test-{os.getpid()}"}
        procs.append(subprocess.Popen(
            [patched_python, str(WORKER), str(tiny_model), str(out_dir), *ports],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    deadline = time.monotonic() + RANK_TIMEOUT_S
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            proc.kill()
            logs.append(proc.communicate()[0] + f"\n[killed after {RANK_TIMEOUT_S:.0f} s]")
    results: dict[str, list[dict]] = {}
    for mode in ("tp", "dp"):
        saved = [out_dir / f"{mode}_r{rank}.pt" for rank in (0, 1)]
        if all(path.is_file() for path in saved):
            results[mode] = [torch.load(path) for path in saved]
        else:
            tails = "\n".join(f"--- rank {rank} (exit {proc.returncode}):\n{log[-3000:]}"
                              for rank, (proc, log) in enumerate(zip(procs, logs, strict=True)))
            results[mode] = [{"error": tails}]
    return results


@pytest.fixture(scope="module")
def reference(tiny_model):
    """`moe(rows)` and `expert(e, rows)` of the MoE layer, from the checkpoint in plain torch (fp32)."""
    import torch.nn.functional as F  # noqa: N812
    from safetensors.torch import load_file

    weights = {k: v.float() for k, v in load_file(str(tiny_model / "model.safetensors")).items()}
    prefix = f"model.layers.{MOE_LAYER}.mlp"
    gate = weights[f"{prefix}.gate.weight"]  # [num_experts, hidden_size]

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        w = {name: weights[f"{prefix}.experts.{e}.{name}_proj.weight"] for name in ("gate", "up", "down")}
        return (F.silu(rows @ w["gate"].T) * (rows @ w["up"].T)) @ w["down"].T

    def moe(rows: torch.Tensor) -> torch.Tensor:
        top_weights, top_ids = torch.softmax(rows @ gate.T, dim=-1).topk(2, dim=-1)
        top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)  # norm_topk_prob
        out = torch.zeros_like(rows)
        for k in range(2):
            for e in range(gate.shape[0]):
                chosen = top_ids[:, k] == e
                out[chosen] += top_weights[chosen, k, None] * expert(e, rows[chosen])
        return out

    return moe, expert


def _outputs(ranks: dict[str, list[dict]], mode: str) -> list[dict]:
    if "error" in ranks[mode][0]:
        pytest.fail(f"the {mode} 2 + EP ranks failed:\n{ranks[mode][0]['error']}")
    return ranks[mode]


def _worst(pairs) -> float:
    return max((got - want).abs().max().item() for got, want in pairs)


def test_dp2_with_expert_parallelism_equals_one_process(ranks, reference) -> None:
    moe, _ = reference
    rank0, rank1 = _outputs(ranks, "dp")

    wants = [moe(step_input(step, rank0["steps"][0].shape[1])) for step in range(len(STEP_COUNTS))]
    gots = [torch.cat((rank0["steps"][step], rank1["steps"][step])) for step in range(len(STEP_COUNTS))]

    assert [got.shape[0] for got in gots] == [sum(counts) for counts in STEP_COUNTS]
    assert _worst(zip(gots, wants, strict=True)) < TOLERANCE


def test_tp2_with_expert_parallelism_equals_one_process(ranks, reference) -> None:
    moe, _ = reference
    rank0, rank1 = _outputs(ranks, "tp")

    wants = [moe(step_input(step, rank0["steps"][0].shape[1])) for step in range(len(STEP_COUNTS))]

    assert _worst(zip(rank0["steps"], wants, strict=True)) < TOLERANCE
    assert _worst(zip(rank1["steps"], wants, strict=True)) < TOLERANCE


def test_weights_applied_on_input_count_only_the_ranks_own_experts(ranks, reference) -> None:
    """Top-1 rows whose router weight is already in the input: each row is its expert's output on exactly
    one rank and zero on the other (the kernel skips the weights, so "weight 0" must still hold)."""
    _, expert = reference
    shares = [r["weighted_on_input"] for r in _outputs(ranks, "tp")]
    rows, ids, weights = top1_input(shares[0].shape[1], 8)

    want = torch.stack([expert(int(e), row[None] * w)[0] for row, e, w in zip(rows, ids[:, 0], weights, strict=True)])
    nonzero = [(share.abs().amax(dim=1) > 0).tolist() for share in shares]

    assert _worst([(shares[0] + shares[1], want)]) < TOLERANCE
    assert all(a != b for a, b in zip(*nonzero, strict=True))

