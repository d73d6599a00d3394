#!/usr/bin/env python3
"""Prove on a CUDA GPU that the Model Runner V2 hooks fire where the patch series says.

Runs a tiny model under MRV2 twice (fresh process each): eager, and with
`FULL_DECODE_ONLY` CUDA graphs. The probe worker (`tests/hook_probe`, passed as
`worker_cls`) builds a runner that overrides `before_model_forward` and selects a graph
manager, through `cudagraph_manager_cls`, that overrides `before_capture_forward` and
marks capture windows and FULL replays; a forward-context hook and a model pre-forward
hook count contexts and forwards. Prints JSON counts and exits 1 if any is wrong:

* `before_model_forward` fires once per executed step (model forwards outside capture
  plus FULL replays), never inside a forward context or a stream capture, and right
  before every FULL replay;
* `before_capture_forward` fires 2 x captured descriptors per capture (one warm-up, one
  capture each), only inside `capture()`, never during replay, never while the stream
  is capturing;
* every model forward runs in exactly one forward context whose hook fired.

`tokens_equal_eager_vs_graphs` is informative only: for the random tiny model, eager and
FULL_DECODE_ONLY (compiled) differ on one prompt in pristine vLLM as well.

Needs vLLM 0.30.0 patched in place. On the H200 with vLLM staged by shared/device (checked
2026-11-29: ok, counts in docs/hooks.md):
  export PYTHONPATH=~/vllm-site VLLM_USE_FLASHINFER_SAMPLER=0
  python3 scripts/apply_patches.py --apply-to ~/vllm-site  # needs unidiff; or patch -p1 each
  PYTHONPATH=$PYTHONPATH:tests/harness python3 -m afd_harness.tiny_models --arch qwen3_moe --out /tmp/m
  python3 scripts/gpu_hook_check.py --model-dir /tmp/m --out-dir $OUT [--timeout-s 480]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PROBE_DIR = REPO / "tests" / "hook_probe"
GPU_WORKER = "afd_hook_probe.gpu_worker.ProbeGPUWorker"
PROMPTS = ["The quick brown fox", "Once upon a time", "What is the capital of France?"]
MODES = {
    "eager": {"enforce_eager": True},
    "full_decode_only": {
        "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY",
                               "cudagraph_capture_sizes": [1, 2, 4, 8]},
    },
}
CHILD = """
import json, sys
from vllm import LLM, SamplingParams
cfg = json.loads(sys.argv[1])
llm = LLM(model=cfg["model"], worker_cls=cfg["worker_cls"], max_model_len=512, max_num_seqs=8,
          gpu_memory_utilization=0.3, seed=0, **cfg["engine"])
params = SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"], ignore_eos=True)
outs = llm.generate(cfg["prompts"], params, use_tqdm=False)
print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
"""


def run_mode(name: str, engine: dict, args: argparse.Namespace) -> tuple[list, list[dict]]:
    """One vLLM process for this mode; returns (tokens, probe events)."""
    out_dir = args.out_dir / name
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("events-*.jsonl"):
        old.unlink()
    env = dict(os.environ)
    env.update(
        AFD_HOOK_PROBE_OUT=str(out_dir),
        PYTHONPATH=os.pathsep.join(filter(None, [str(PROBE_DIR), env.get("PYTHONPATH")])),
        VLLM_USE_V2_MODEL_RUNNER="1",
        VLLM_USE_FLASHINFER_SAMPLER="0",
    )
    cfg = {"model": str(args.model_dir), "worker_cls": GPU_WORKER, "engine": engine,
           "prompts": PROMPTS, "max_tokens": args.max_tokens}
    log_path = out_dir / "vllm.log"  # vLLM logs to stdout; the RESULT line is in there too
    with log_path.open("w") as log:
        done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], env=env,
                              stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout_s)
    text = log_path.read_text(errors="replace")
    if done.returncode != 0:
        raise SystemExit(f"gpu_hook_check: {name}: vLLM exited with {done.returncode}:\n{text[-3000:]}")
    line = next(x for x in text.splitlines() if x.startswith("RESULT "))
    events = []
    for path in sorted(out_dir.glob("events-*.jsonl")):
        events += [json.loads(x) for x in path.read_text().splitlines() if x]
    return json.loads(line.removeprefix("RESULT ")), events


def check_worker(events: list[dict], failures: list[str], mode: str) -> dict[str, Any]:
    """Counts for one worker process's event sequence; appends to failures."""
    def fail(msg: str) -> None:
        failures.append(f"{mode}: {msg}")

    window = None  # manager id while inside capture()
    windows: list[dict[str, Any]] = []
    counts = Counter()
    last_bmf = None
    for e in events:
        kind = e["event"]
        counts[kind] += 1
        if kind == "capture_begin":
            window = {"manager": e["manager"], "graphs_before": e["num_graphs"], "bcf": []}
        elif kind == "capture_end":
            window["new_graphs"] = e["num_graphs"] - window["graphs_before"]
            windows.append(window)
            window = None
        elif kind == "before_capture_forward":
            if window is None:
                fail(f"before_capture_forward outside capture(): {e}")
                continue
            window["bcf"].append(e)
            if e["capturing"] or e["in_replay"] or not e["in_capture"]:
                fail(f"before_capture_forward in a bad state: {e}")
        elif kind == "before_model_forward":
            last_bmf = e
            if e["has_forward_context"] or e["capturing"]:
                fail(f"before_model_forward inside a forward context or capture: {e}")
        elif kind == "replay":
            counts["replay_steps"] += 1
            if last_bmf is None or last_bmf["cg_mode"] != "FULL" or \
                    last_bmf["num_tokens"] != e["num_tokens"]:
                fail(f"FULL replay not preceded by its before_model_forward: {last_bmf} -> {e}")
            last_bmf = None
        elif kind == "model_forward" and window is None:
            counts["model_forward_outside_capture"] += 1
        if kind == "forward_context" and e["capturing"]:
            counts["forward_context_in_graph"] += 1

    expected_steps = counts["model_forward_outside_capture"] + counts["replay_steps"]
    if counts["before_model_forward"] != expected_steps:
        fail(f"before_model_forward fired {counts['before_model_forward']} times; expected "
             f"{expected_steps} (model forwards outside capture + FULL replays)")
    if counts["forward_context"] != counts["model_forward"]:
        fail(f"{counts['forward_context']} forward contexts for {counts['model_forward']} forwards")
    num_descs = 0
    for w in windows:
        warm = Counter(e["desc"] for e in w["bcf"] if e["warmup"])
        cap = Counter(e["desc"] for e in w["bcf"] if not e["warmup"])
        num_descs += len(cap)
        if set(warm) != set(cap) or any(n != 1 for n in (*warm.values(), *cap.values())):
            fail(f"capture window {w['manager']}: warm-up {dict(warm)} vs capture {dict(cap)}")
        if len(w["bcf"]) != 2 * w["new_graphs"]:
            fail(f"capture window {w['manager']}: {len(w['bcf'])} capture hooks for "
                 f"{w['new_graphs']} new FULL graphs; expected 2 per graph")
    if counts["forward_context_in_graph"] != sum(w["new_graphs"] for w in windows):
        fail(f"{counts['forward_context_in_graph']} contexts built inside graphs; expected one "
             f"per captured FULL graph ({sum(w['new_graphs'] for w in windows)})")
    return {
        "before_model_forward": counts["before_model_forward"],
        "model_forward_outside_capture": counts["model_forward_outside_capture"],
        "full_replays": counts["replay_steps"],
        "worker_steps": counts["execute_model"],
        "before_capture_forward": counts["before_capture_forward"],
        "capture_calls": len(windows),
        "captured_descriptors": num_descs,
        "captured_full_graphs": sum(w["new_graphs"] for w in windows),
        "forward_context": counts["forward_context"],
        "forward_context_in_graph": counts["forward_context_in_graph"],
        "model_forward": counts["model_forward"],
    }


def check_mode(mode: str, events: list[dict], failures: list[str]) -> dict[str, Any]:
    runners = [e for e in events if e["event"] == "make_model_runner"]
    if len(runners) != 1 or runners[0]["runner"] != "ProbeMRV2Runner":
        failures.append(f"{mode}: expected one ProbeMRV2Runner from _make_model_runner, got {runners}")
        return {}
    pid = runners[0]["pid"]
    counts = check_worker([e for e in events if e["pid"] == pid], failures, mode)
    if mode == "eager" and (counts["before_capture_forward"] or counts["full_replays"]):
        failures.append(f"{mode}: capture or replay happened in eager mode: {counts}")
    if mode != "eager" and (counts["captured_full_graphs"] == 0 or counts["full_replays"] == 0):
        failures.append(f"{mode}: no FULL graph captured or replayed; the check proves nothing")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--timeout-s", type=float, default=480.0)
    args = parser.parse_args(argv)
    if not (args.model_dir / "config.json").is_file():
        parser.error(f"--model-dir {args.model_dir} has no config.json")

    failures: list[str] = []
    report: dict[str, Any] = {}
    tokens = {}
    for mode, engine in MODES.items():
        tokens[mode], events = run_mode(mode, engine, args)
        report[mode] = check_mode(mode, events, failures)
    report["tokens_equal_eager_vs_graphs"] = tokens["eager"] == tokens["full_decode_only"]
    report["failures"] = failures
    report["ok"] = not failures
    print(json.dumps(report, indent=2))
    (args.out_dir / "gpu_hook_check.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
