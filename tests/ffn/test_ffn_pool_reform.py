"""An FFN DP pool leaves a failed step together and re-forms together (docs/ffn.md#re-forming-a-pool, decision 48).

Two FFN DP ranks with expert parallelism in two processes over gloo (tests/ffn/_pool_rank.py): the real runner,
loop and `DPPool`, the tiny Qwen3-MoE in float32, a scripted connector.  Rank 0 loses its attention once
mid-step (layer 1 of step 1) and once before a payload (step 3) while rank 1's attention goes on.  Without the
drain, rank 1 waits in layer 1's MoE collective for ever; without the start agreement, in step 3's first one:
either way its loop never ends and the rank process reports it stuck.
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


def run_pool(weights_dir: Path, tmp_path: Path) -> list[dict]:
    import torch

    port, ident = free_port(), f"afd-pool-{uuid.uuid4().hex[:12]}"
    outs = [tmp_path / f"rank-{rank}.pt" for rank in range(2)]
    procs = []
    for rank, out in enumerate(outs):
        env = {**os.environ, "RANK": str(rank), "OMP_NUM_THREADS": "1", "VLLM_DIST_IDENT": ident}
        with open(out.with_suffix(".log"), "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.ffn._pool_rank", str(weights_dir), str(out), str(port)],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [proc.wait(TIMEOUT_S) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    logs = "\n".join(out.with_suffix(".log").read_text()[-4000:] for out in outs)
    assert codes == [0, 0], f"exit codes {codes}\n{logs}"
    return [torch.load(out) for out in outs]


def test_ffn_dp_ranks_finish_a_failed_step_on_zeros_and_re_form_together(weights_dir, tmp_path):
    import torch

    rank_0, rank_1 = run_pool(weights_dir, tmp_path)

    assert rank_0["events"] == ["init", "step 0", "step 1", "lost at layer 1", "re-formed", "step 2",
                                "lost before a payload", "re-formed", "step 4"]
    assert rank_1["events"] == ["init", "step 0", "step 1", "re-formed", "step 2", "step 3", "re-formed", "step 4"]
    assert [(r["num_steps"], r["num_reformations"]) for r in (rank_0, rank_1)] == [(3, 2), (3, 2)]
    # Equal counts, equal rows: every completed step computes step 0's outputs again, on both ranks; rank 1's
    # step 1, whose peer finished it on zeros, too (rank 0's experts still computed rank 1's real rows).
    for rank, result, steps in ((0, rank_0, (2, 4)), (1, rank_1, (1, 2, 4))):
        outputs = result["outputs"]
        layers = sorted({layer for step, layer, _ in outputs if step == 0})
        for step in steps:
            for layer in layers:
                torch.testing.assert_close(outputs[(step, layer, 0)], outputs[(0, layer, 0)], rtol=0, atol=0,
                                           msg=lambda m, k=(rank, step, layer): f"rank, step, layer {k}: {m}")
    assert sorted({layer for step, layer, _ in rank_0["outputs"] if step == 1}) == [0]  # nothing sent after the loss
    assert not any(step == 3 for step, _, _ in rank_1["outputs"])  # the step the pool skipped together
