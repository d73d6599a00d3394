"""The hooks fire in real vLLM processes on CPU (V1 runner), through the plugin entry point.

One `vllm.LLM` generation of a tiny Qwen3-MoE runs in a subprocess with the probe plugin
(`tests/hook_probe`) active; every probe hook appends events to per-process files. The
tests then check: the config hook ran in the front end while `worker_cls` was "auto" and
picked the probe worker; `_make_model_runner` ran exactly once, in the worker; every model
forward ran inside exactly one forward context whose hook fired; the worker executed one
step per generated token (prefill + decodes); the V1 runner asked its DP-1 micro-batch hook
once per executed step and, by vLLM's default, split none.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hook_series import SUBPROCESS_TIMEOUT_S

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

CPU_WORKER = "afd_hook_probe.cpu_worker.ProbeCPUWorker"
NUM_TOKENS = 6
PROMPT = "The quick brown fox"
GENERATE = """
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], enforce_eager=True, max_model_len=256, max_num_seqs=4, seed=0)
params = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3]), ignore_eos=True)
out = llm.generate([sys.argv[2]], params)[0]
print("RESULT " + json.dumps({"prompt_ids": out.prompt_token_ids,
                              "token_ids": list(out.outputs[0].token_ids)}))
"""


@dataclass(frozen=True)
class Run:
    front_end_pid: int
    result: dict[str, Any]
    events: list[dict[str, Any]]

    def of(self, event: str, pid: int | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event and pid in (None, e["pid"])]


def read_events(out_dir: Path) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for path in sorted(out_dir.glob("events-*.jsonl")):
        events += [json.loads(line) for line in path.read_text().splitlines() if line]
    return events


@pytest.fixture(scope="module")
def run(tmp_path_factory, patched_python, tiny_model, vllm_env) -> Run:
    out_dir = tmp_path_factory.mktemp("probe-events")
    proc = subprocess.Popen(
        [patched_python, "-c", GENERATE, str(tiny_model), PROMPT, str(NUM_TOKENS)],
        env=vllm_env(out_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        output, _ = proc.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"vLLM generation did not finish in {SUBPROCESS_TIMEOUT_S}s:\n{output[-4000:]}")
    assert proc.returncode == 0, f"vLLM generation failed:\n{output[-4000:]}"
    line = next(x for x in output.splitlines() if x.startswith("RESULT "))
    return Run(proc.pid, json.loads(line.removeprefix("RESULT ")), read_events(out_dir))


def test_plugin_loaded_in_front_end_engine_core_and_worker(run: Run) -> None:
    names = Counter(e["process_name"] for e in run.of("process"))

    assert run.of("process", run.front_end_pid)
    assert names["EngineCore"] >= 1
    assert sum(n for name, n in names.items() if name.startswith("VllmWorker")) == 1


def test_config_hook_ran_in_the_front_end_while_worker_cls_was_auto(run: Run) -> None:
    front_end = run.of("config_hook", run.front_end_pid)

    assert front_end, "the VllmConfig hook never ran in the front-end process"
    assert front_end[0]["worker_cls_before"] == "auto"
    assert {e["worker_cls_after"] for e in run.of("config_hook")} == {CPU_WORKER}


def test_make_model_runner_ran_exactly_once_in_the_worker(run: Run) -> None:
    calls = run.of("make_model_runner")

    assert len(calls) == 1
    assert calls[0]["pid"] != run.front_end_pid
    assert (calls[0]["worker"], calls[0]["runner"]) == ("ProbeCPUWorker", "ProbeCPUModelRunner")


def test_every_model_forward_ran_in_one_hooked_forward_context(run: Run) -> None:
    worker_pid = run.of("make_model_runner")[0]["pid"]
    sequence = [e["event"] for e in run.events if e["pid"] == worker_pid]
    forwards = [i for i, name in enumerate(sequence) if name == "model_forward"]

    assert forwards, "the model never ran"
    assert all(sequence[i - 1] == "forward_context" for i in forwards)
    assert sequence.count("forward_context") == len(forwards)
    assert [e["pid"] for e in run.of("forward_context")] == [worker_pid] * len(forwards)


def test_one_step_per_generated_token(run: Run) -> None:
    worker_pid = run.of("make_model_runner")[0]["pid"]
    steps = [e["num_scheduled_tokens"] for e in run.of("execute_model", worker_pid)]
    real_steps = [n for n in steps if n > 0]
    num_prompt = len(run.result["prompt_ids"])

    assert len(run.result["token_ids"]) == NUM_TOKENS
    assert real_steps == [num_prompt] + [1] * (NUM_TOKENS - 1)
    assert len(run.of("model_forward", worker_pid)) >= len(real_steps)


def test_the_dp_1_micro_batch_hook_is_asked_once_per_step_and_its_default_keeps_each_whole(run: Run) -> None:
    """`v1-runner-add-ubatch-without-dp`: at DP 1 `_determine_batch_execution_and_padding` asks the runner for
    every executed step, with its tokens and vLLM's veto answer (the veto only looks when the runner
    micro-batches, so it allows); vLLM's default answers False."""
    worker_pid = run.of("make_model_runner")[0]["pid"]
    asked = run.of("should_ubatch_without_dp", worker_pid)
    steps = [e["num_scheduled_tokens"] for e in run.of("execute_model", worker_pid)]
    real_steps = [n for n in steps if n > 0]

    assert [e["num_tokens"] for e in asked] == real_steps
    assert [e["uniform_decode"] for e in asked] == [False] + [True] * (len(real_steps) - 1)
    assert {(e["allow_microbatching"], e["answer"]) for e in asked} == {(True, False)}
