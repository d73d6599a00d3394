"""A bounded soak of AFD on CPU: 4 clients against the attention, an FFN crash and restart in the middle.

Every request must end completed with plain vLLM's greedy tokens, aborted by the client, or with a
clear error (docs/failures.md#requests-during-an-outage); the attention keeps its pid and heals
(docs/connection.md#healing-attention); both roles' RSS stays flat after the fault.  No timing
assertions.  An attention crash under a running FFN: tests/e2e/test_afd_cpu.py (TP 2); the longer
soak with both: scripts/soak_afd_cpu.py, numbers in docs/soak.md.
"""

from __future__ import annotations

import json

import pytest

from afd_harness.afd import AFDDeployment
from afd_harness.server import complete_batch
from afd_harness.soak import MAX_TOKENS, PROMPTS, Fault, SoakPlan, run_soak, summary

pytestmark = pytest.mark.e2e

MAX_GROWTH_MB = 50.0  # over the measured window; generous: a leak per request shows far above it


def batched_tokens(base_url: str) -> list[list[int] | None]:
    return [g.token_ids for g in complete_batch(base_url, list(PROMPTS), MAX_TOKENS)]


PLAIN_REQUESTS = (batched_tokens,)  # answered by the session's plain server (conftest.py)


@pytest.fixture(scope="module")
def baseline(plain_outputs):
    return plain_outputs("qwen3_moe", batched_tokens)


def test_soak_with_an_ffn_crash_and_restart(tiny_model_dir, vllm_python, tmp_path, baseline):
    plan = SoakPlan(PROMPTS, baseline, clients=4, duration_s=45.0, min_window_s=30.0, settle_s=5.0,
                    faults=(Fault(10.0, "ffn"),))
    afd = AFDDeployment(tiny_model_dir("qwen3_moe"), python=vllm_python, log_dir=tmp_path)

    with afd:
        report = run_soak(afd, plan)
    digest = summary(report)
    print(json.dumps({k: v for k, v in digest.items() if k != "failures"}, indent=1))

    assert not report.failures, json.dumps(digest["failures"], indent=1)
    counts = report.counts
    assert counts.get("completed", 0) > 0 and counts.get("aborted", 0) > 0, counts
    (fault,) = report.faults
    assert fault.attention_pid_kept and not fault.ffn_pid_kept, fault
    assert counts.get("unavailable_503", 0) > 0, counts  # clients met the outage, with the AFD notice
    healed = report.t0 + fault.at_s + fault.serving_again_s
    assert any(o == "completed" and a.started > healed for o, a in zip(report.outcomes, report.attempts))
    for role in ("ffn", "attention"):
        growth = report.growth(role)
        assert growth is not None and growth.requests > 0, (role, digest["memory"])
        assert growth.growth_mb < MAX_GROWTH_MB, (role, growth)
