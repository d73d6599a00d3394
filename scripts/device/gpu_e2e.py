#!/usr/bin/env python3
"""The whole GPU evidence run in one command: patch, models, tokens, benchmarks, hook check.

The lent H200 is reachable only through single commands of at most 10 minutes and a
session budget of 30 device minutes, with no network and no vLLM of its own (the staged
official vLLM 0.30.0 lives in ~/vllm-site, see scripts/device/README.md).  So this script
does everything in one go, each phase isolated so that one failure keeps the others:

    models    build the tiny checkpoints (qwen3_moe; DeepSeek with MLA-sized latents)
    pristine  (optional) plain vLLM on the *unpatched* tree: tokens and tok/s for the hook-cost ratio
    patch     apply patches/series to ~/vllm-site in place; import check of vLLM + overlay plugin
    gputests  the repo's pytest tests marked `gpu` (CUDA-staged gloo connector, NCCL's one-GPU refusal)
    rtt       per-layer round trip through the gloo connector vs raw gloo (bench_connector_rtt.py)
    ipcfloor  per-layer round trip of the CUDA IPC transport: raw in a graph (the floor), raw eager,
              through the connector, and the probe's device flags (bench_ipc_floor.py)
    tokens    per model: plain eager, plain FULL_DECODE_ONLY graphs, AFD over gloo (eager) and AFD
              over CUDA IPC (eager, and FULL_DECODE_ONLY on both roles), served at once on the one
              GPU; greedy tokens compared (serving.py)
    bench     decode tok/s of the same servers, interleaved, batch 1 and 32 (with "tokens": one round)
    hooks     scripts/gpu_hook_check.py on the first model (MRV2 hooks, eager + graphs), its JSON recorded
    heal      (optional) an FFN killed mid-stream and restarted under the same attention (heal.py)
    profile   (optional) `afd_plan.py profile --device cuda --load-format dummy --layers first-moe` per model,
              written to OUT/profiles/<arch>.json (the planner's real-shape profiles)

Outputs under --out ($OUT on the device): summary.json and summary.md, rewritten after every
phase, and logs.tar.gz holding every server and subprocess log ($OUT returns at most 8
files, so the logs travel as one archive).  A global --budget-s keeps the run inside the
device's command limit; phases that no longer fit are recorded as skipped.  This file is the
CLI and the sequence; each phase lives in phases.py, the `Run` they share in run_state.py.

    python3 scripts/device/gpu_e2e.py --out "$OUT"
    python3 scripts/device/gpu_e2e.py --out "$OUT" --phases tokens --models qwen3_moe   # warm machine
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import e2e_report as report
import heal
import phases
import repo_paths  # noqa: F401 - serving.py starts the servers through afd_harness.server
from run_state import REPO, Run


# The gputests phase: the repo's tests that need a GPU, plus the CUDA path's pure tests.
GPU_TESTS = ("tests/connectors/test_connectors_cuda.py", "tests/connectors/test_ipc_cuda.py",
             "tests/ffn/test_ffn_graphs_cuda.py", "tests/attention/test_cuda_path.py",
             "tests/wire/test_timeline_cuda.py", "tests/wire/test_progress_cuda.py")
# Servers of a round (serving.VARIANT_SERVERS); plain_eager is the baseline of every comparison.
VARIANTS = ("plain_eager", "plain_graphs", "afd_eager", "afd_ipc_eager", "afd_ipc_graphs")
# Opt-in servers: AFD over IPC with micro-batch stages (docs/pingpong.md), e.g. --variants
# plain_eager,plain_graphs,afd_ipc_graphs,afd_ipc_graphs_s2,afd_ipc_graphs_s3
STAGE_VARIANTS = tuple(phases.serving.STAGE_TWINS)
# The profile phase's grid: decode batches and contexts of the planner's projections (docs/planner.md#projections),
# FFN rows up to a pool rank's share of many attention ranks; the projections plan the wire with --link.
PROFILE_ARGS = ("--batches 1,8,32,64,128 --contexts 4096,8192,32768 --tokens 1,8,32,128,512,1024 "
                "--warmup 3 --repeats 10 --no-transport")
CUDA_ONLY = phases.serving.CUDA_ONLY_VARIANTS


class Terminated(BaseException):
    """SIGTERM arrived (the device's time limit): stop servers, write what we have."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated(f"signal {signum}")


# ------------------------------------------------------------------------------------------- CLI

def _arg(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type whose ValueError message reaches the user (argparse hides plain ones)."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return convert


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--out", required=True, help="output directory ($OUT on the device)")
    add("--phases", type=_arg(report.parse_phases), default=report.parse_phases(",".join(report.DEFAULT_PHASES)),
        help=f"comma-separated subset of {','.join(report.PHASES)} or 'all' "
             f"(default: {','.join(report.DEFAULT_PHASES)})")
    add("--models", type=_names,
        default=["qwen3_moe", "deepseek_v2_mla"], help="tiny_models archs to serve, in order")
    add("--variants", type=_names, default=list(VARIANTS),
        help=f"servers per round, some of {','.join(VARIANTS)} ({', '.join(CUDA_ONLY)} need CUDA)")
    add("--platform", choices=("cuda", "cpu"), default="cuda", help="cpu: smoke-test this script on the CPU machine")
    add("--vllm-site", default="~/vllm-site", help="directory holding the staged vllm/ (patched in place)")
    add("--afd-site", default="~/afd-site", help="where the overlay's dist-info is written")
    add("--work", default="~/afd-e2e", help="models, logs and scratch files")
    add("--extra-wheels", default=str(REPO / ".devstage" / "extras"),
        help="carried pure-Python wheels (scripts/device/extras.txt)")
    add("--prebuilt-models", help="directory with carried <arch>/ tiny builds to reuse")
    add("--cuda-devices", default="0")
    add("--launcher", choices=("cli", "api_server"), default="cli")
    add("--budget-s", type=float, default=480.0, help="stop starting phases after this many seconds")
    add("--command-start", type=float, help="epoch seconds the device command began (T0=$(date +%%s) first): "
        "the budget then also ends --command-limit-s after it, minus a reserve")
    add("--command-limit-s", type=float, default=600.0)
    add("--min-round-s", type=float, default=120.0, help="time a model round needs to be started")
    add("--startup-timeout-s", type=float, default=300.0, help="per round; eight servers start at once")
    add("--request-timeout-s", type=float, default=120.0)
    add("--max-model-len", type=int, default=1024)
    add("--max-num-seqs", type=int, default=64)
    add("--gpu-mem-util", type=float, default=0.25)
    add("--kv-cache-bytes", type=_arg(report.parse_bytes), default=2 << 30, help="per server, e.g. 2GiB")
    add("--graph-compile", choices=("none", "vllm"), default="none",
        help="plain_graphs: FULL_DECODE_ONLY without torch.compile (none) or with vLLM's default compile")
    add("--serve-args", default="", help="extra flags for every vllm serve")
    add("--timeline", action="store_true",
        help="AFD ranks stamp their per-layer timeline (docs/timeline.md) into logs/timeline/<model>/<variant> "
             "(in OUT/logs.tar.gz); "
             "each round then writes timeline.md and timeline.png there and predicts each stage variant's "
             "k ÷ 1 ratio from its one-stage twin's timeline (stamps cost a little throughput)")
    add("--heal-variants", type=_names, default=list(heal.HEAL_VARIANTS),
        help="servers of the heal phase (plain_eager first: the tokens baseline)")
    add("--heal-rounds", type=int, default=1, help="kill and restart the FFN this many times per variant")
    add("--token-max-tokens", type=int, default=24)
    add("--bench-batches", type=_arg(lambda s: report.parse_int_list(s, "--bench-batches")), default=[1, 32])
    add("--bench-tokens", type=int, default=128)
    add("--bench-prompt-len", type=_arg(lambda s: report.parse_int_list(s, "--bench-prompt-len")), default=[32],
        help="prompt tokens of the bench requests; several (e.g. 512,8192): one bench per length, same servers")
    add("--bench-repeats", type=int, default=3,
        help="recorded repetitions after one warm-up; ratios are taken per repetition, so more repeats narrow "
             "their min–max and make the first and second half comparable (6 or more)")
    add("--bench-prefix-caching", action="store_true",
        help="keep vLLM's prefix caching on in runs with the bench phase (by default those rounds' servers get "
             "--no-enable-prefix-caching, so both requests of a sample compute their whole prefill)")
    add("--pin-servers", action="store_true",
        help="CUDA rounds: every server on two cores of its own (taskset), this script and the bench's requests on "
             "the cores left; refused where the round's servers need more cores than there are")
    add("--rtt-shapes", default="1x128,32x128,1x2048,64x2048,256x2048")
    add("--rtt-steps", type=int, default=100)
    add("--ipc-floor-shapes", default="1x128,32x128,1x2048,256x2048", help="ROWSxHIDDEN of the ipcfloor phase")
    add("--ipc-floor-steps", type=int, default=100)
    add("--ipc-floor-timeout-s", type=float, default=180.0, help="the ipcfloor phase's own budget")
    add("--gpu-tests", default=" ".join(GPU_TESTS),
        help="pytest paths of the gputests phase")
    add("--profile-args", default=PROFILE_ARGS,
        help="the profile phase's grid, passed to `afd_plan.py profile` (docs/planner.md#the-profile)")
    add("--gloo-bench-args", default="", help="extra args for scripts/bench_gloo_roundtrip.py --device cuda")
    add("--hook-check-args", default="--model-dir {model_dir} --out-dir {hook_out} --timeout-s {timeout_s}",
        help="args for scripts/gpu_hook_check.py; {model_dir} {hook_out} {json_out} {work} {timeout_s} are "
             "substituted, and {json_out} (= {hook_out}/gpu_hook_check.json) is read back")
    add("--hook-timeout-s", type=float, default=420.0,
        help="both hook-check modes together; a cold torch.compile of the graphs mode takes minutes")
    add("--hook-check-script", default=str(REPO / "scripts" / "gpu_hook_check.py"), help=argparse.SUPPRESS)
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if {"pristine", "tokens", "bench", "hooks", "heal", "profile"} & set(args.phases) and "models" not in args.phases:
        args.phases = report.parse_phases(",".join(["models", *args.phases]))  # cheap: reuses built models
    if args.platform == "cpu":  # a smoke run of this script: nothing that needs CUDA
        args.variants = [v for v in args.variants if v not in CUDA_ONLY]
        args.phases = [p for p in args.phases if p != "ipcfloor"]
    if args.pin_servers and args.platform == "cpu":
        parser.error("--pin-servers is for CUDA rounds; a CPU round binds each role's threads to a core already "
                     "(VLLM_CPU_OMP_THREADS_BIND): drop it")
    bad = sorted(set(args.variants) - set(VARIANTS) - set(STAGE_VARIANTS))
    if bad or "plain_eager" not in args.variants:
        parser.error(f"--variants: {bad or args.variants} invalid; expected plain_eager plus any of "
                     f"{', '.join(VARIANTS[1:] + STAGE_VARIANTS)} (plain_eager is the baseline of every comparison)")
    num_servers = phases.serving.num_servers(args.variants)
    needed = phases.serving.cores_needed(num_servers)
    if args.pin_servers and needed > len(os.sched_getaffinity(0)):
        parser.error(f"--pin-servers: {num_servers} servers need {needed} cores ({phases.serving.CORES_PER_SERVER} "
                     f"each, one for the client), this process may run on {len(os.sched_getaffinity(0))}; "
                     "serve fewer --variants")
    if max(args.bench_batches) > args.max_num_seqs:
        parser.error(f"--bench-batches {max(args.bench_batches)} exceeds --max-num-seqs {args.max_num_seqs}; "
                     "raise --max-num-seqs or lower the batch")
    if args.bench_tokens < 2:
        parser.error("--bench-tokens must be >= 2 (decode is timed as N tokens minus 1 token)")
    if min(args.bench_prompt_len) < 2:
        parser.error(f"--bench-prompt-len {min(args.bench_prompt_len)}: every bench prompt is unique in the run "
                     "and its first two token ids spell its number; pass lengths >= 2")
    needed = (2 * sum(args.bench_batches) * len(args.variants) * (1 + args.bench_repeats)
              * len(args.bench_prompt_len))
    if needed > report.BENCH_PROMPT_IDS ** 2:
        parser.error(f"the bench would send {needed} prompts, more than the {report.BENCH_PROMPT_IDS ** 2} "
                     "unique ones the tiny vocabulary makes; lower --bench-repeats, --bench-batches or the "
                     "prompt lengths")
    caching = ("--enable-prefix-caching", "--no-enable-prefix-caching")
    if "bench" in args.phases and not args.bench_prefix_caching and not set(caching) & set(args.serve_args.split()):
        # The rounds of this run serve the bench, the token cases of the same round and the pristine round alike,
        # so every comparison's two sides keep the same flags.
        args.serve_args = f"{args.serve_args} --no-enable-prefix-caching".strip()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    signal.signal(signal.SIGTERM, _on_sigterm)
    run = Run(args)
    phase_fns: dict[str, Callable[[Run], dict[str, Any]]] = {
        "models": phases.phase_models, "pristine": phases.phase_pristine, "patch": phases.phase_patch,
        "rtt": phases.phase_rtt, "ipcfloor": phases.phase_ipcfloor, "hooks": phases.phase_hooks,
        "gputests": phases.phase_gputests, "heal": heal.phase_heal, "profile": phases.phase_profile}
    code = 0
    try:
        phases.reap_leftovers(run)
        phases.probe_device(run)
        if args.platform == "cuda" and not (run.vllm_site / "vllm").is_dir():
            run.summary["notes"].append(f"{run.vllm_site}/vllm is missing: run bootstrap.py first (README).")
        for phase in args.phases:
            if phase == "bench" and "tokens" in args.phases:
                continue  # served in the same round as tokens
            if phase in ("tokens", "bench"):
                phases.phase_serve(run, "tokens" in args.phases, "bench" in args.phases)
            else:
                _record(run, phase, phase_fns[phase])
            run.save()
        phases.finalize(run)
    except Terminated as exc:
        run.summary["notes"].append(f"terminated by {exc} after {time.monotonic() - run.started:.0f} s")
        code = 124
    finally:
        run.save()
    print((run.out_dir / "summary.md").read_text())
    failed = [n for n, p in run.summary["phases"].items() if p.get("status") in ("failed", "partial")]
    return code or (1 if failed else 0)


def _record(run: Run, name: str, fn: Callable[[Run], dict[str, Any]]) -> None:
    """Run one phase; its result, status, seconds and error go into summary['phases'][name]."""
    if run.time_left() < 20:
        run.summary["phases"][name] = {"status": "skipped", "error": f"budget: {run.time_left():.0f} s left"}
        return
    started = time.monotonic()
    record: dict[str, Any] = {"status": "running"}
    run.summary["phases"][name] = record
    try:
        result = fn(run)
        record.update(result)
        record["status"] = result.get("status", "ok")
        record.setdefault("error", None)
    except Exception as exc:  # noqa: BLE001 - one phase failing must not lose the others
        record.update(status="failed", error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    record["seconds"] = round(time.monotonic() - started, 1)


if __name__ == "__main__":
    sys.exit(main())
