"""The FFN runner's MoE path at FFN DP 2 over gloo, with and without vLLM's expert parallelism
(docs/ffn.md#per-step-compute): two FFN DP ranks, each fed its block of 4 attention ranks' rows, together
return what one FFN rank returns for all of them.

Each rank is a fresh process (tests/ffn/_ep_rank.py: vLLM's groups are per process) running the real
`AFDFFNModelRunner` on the tiny Qwen3-MoE with weights, its steps on a thread as the FFN loop does; only its
connector is a stand-in.  It needs the series' CPU pin fixes: `cpu-communicator-add-gatherv` (without it
vLLM's `CpuCommunicator` raises `NotImplementedError` in `all_gatherv`) and, with EP,
`cpu-moe-honour-expert-map` (without it the EP outputs are wrong).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm")
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator  # noqa: E402

from tests.connectors._harness import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# NOTE: `vars`, not hasattr: the base communicator defines all_gatherv to raise NotImplementedError.
pytestmark = pytest.mark.skipif(
    "all_gatherv" not in vars(CpuCommunicator),
    reason="the installed vLLM's CpuCommunicator lacks all_gatherv (patch cpu-communicator-add-gatherv not "
           "installed); FFN DP > 1 cannot run its MoE collectives on CPU without it",
)
TIMEOUT_S = 420


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory) -> Path:
    from afd_harness.tiny_models import build_tiny_model

    return build_tiny_model("qwen3_moe", tmp_path_factory.mktemp("models") / "qwen3_moe")


def start_rank(mode: str, rank: int, weights_dir: Path, out: Path, port: int, ident: str) -> subprocess.Popen:
    env = {**os.environ, "RANK": str(rank), "OMP_NUM_THREADS": "1", "VLLM_DIST_IDENT": ident}
    with open(out.with_suffix(".log"), "w") as log:  # the child writes through its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "tests.ffn._ep_rank", mode, str(weights_dir), str(out), str(port)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def run_ranks(mode: str, num_ranks: int, weights_dir: Path, tmp_path: Path) -> list[dict]:
    import torch

    port = free_port()
    outs = [tmp_path / f"{mode}-{rank}.pt" for rank in range(num_ranks)]
    ident = f"afd-ep-{uuid.uuid4().hex[:12]}"  # vLLM's CPU shared-memory names: unique per run
    procs = [start_rank(mode, rank, weights_dir, out, port, ident) for rank, out in enumerate(outs)]
    try:
        codes = [proc.wait(TIMEOUT_S) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    logs = "\n".join(out.with_suffix(".log").read_text()[-3000:] for out in outs)
    assert codes == [0] * num_ranks, f"{mode}: exit codes {codes}\n{logs}"
    return [torch.load(out) for out in outs]


@pytest.fixture(scope="module")
def reference(weights_dir, tmp_path_factory) -> dict:
    """One FFN rank (FFN DP 1) serving all 4 attention ranks."""
    (outputs,) = run_ranks("ref", 1, weights_dir, tmp_path_factory.mktemp("ref"))
    return outputs


@pytest.mark.parametrize("mode", ["dp-ep", "dp"], ids=["expert-parallel", "no-expert-parallel"])
def test_two_ffn_dp_ranks_return_what_one_ffn_rank_returns(weights_dir, reference, tmp_path, mode):
    import torch

    rank_0, rank_1 = run_ranks(mode, 2, weights_dir, tmp_path)

    assert rank_0.keys() == rank_1.keys() == reference.keys()
    for key, expected in reference.items():
        both = torch.cat([rank_0[key], rank_1[key]])
        assert both.shape == expected.shape, key
        torch.testing.assert_close(both, expected, rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
