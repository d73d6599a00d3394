#!/usr/bin/env python3
"""Should I run AFD, and with which A:F?  A first-cut planner from a measured profile (docs/planner.md).

    python scripts/afd_plan.py plan PROFILE.json --gpus 8 [--tpot-ms 50] [--context 8192] \
        [--link nvlink|pcie|ib|eth|GB_S,US]
    python scripts/afd_plan.py predict PROFILE.json --attention-ranks 1 --ffn-ranks 1 --stages 2 --batch 8
    python scripts/afd_plan.py profile MODEL_DIR [--device cpu|cuda] [--load-format dummy] [--layers N|first-moe] \
        [--batches 1,8,32] [--contexts 16,512] [--tokens 1,8,32] --out PROFILE.json
    python scripts/afd_plan.py profile-from-timeline TIMELINE_DIR MODEL_DIR --context 512 --out PROFILE.json

`plan` prints one table: the colocated baseline (the better of DP x EP and TP) first, then the other colocated
layout and the AFD splits xA:yF at 1-3 stages, each at the batch with the most decode tok/s per GPU whose step
(TPOT) stays within --tpot-ms; then the recommendation as `vllm serve` commands of both roles.  `predict` prints
one deployment's step at one batch (the validation table of docs/planner.md).  Predictions, not measurements.
`profile` measures a PROFILE.json through the model's real vLLM layers (afd_planner/measure.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from afd_planner import launch
from afd_planner.cost import EP_ALL2ALL, EP_ALL_TO_ALL, EP_RINGS, CostModel
from afd_planner.launch import Cluster
from afd_planner.links import LINKS, Link, parse_link
from afd_planner.measure import (EXIT_CAPTURE_FAILED, LOAD_FORMATS, CaptureError, Grid, layers_through_first_moe,
                                 measure_profile, read_model_config)
from afd_planner.profile import PLATFORMS, ProfileError, StepSample, load_profile
from afd_planner.search import Candidate, Plan, plan

AFD_MARGIN = 0.05  # AFD must beat the baseline by more than this share: the model's own error is about that
FIRST_MOE = "first-moe"  # --layers: build up to the first MoE layer


def table(result: Plan) -> str:
    """The baseline first, the other colocated layout, then each AFD split at its best stage count (best first)."""
    lines = ["| deployment | stages | batch / rank | TPOT ms | tok/s per GPU | ÷ baseline |",
             "|---|---:|---:|---:|---:|---:|"]
    base = result.baseline.tok_s_per_gpu
    seen, splits = set(), []
    for c in result.afd:
        if c.label not in seen:
            seen.add(c.label)
            splits.append(c)
    for c in [result.baseline, *(c for c in result.colocated if c is not result.baseline), *splits]:
        name = f"colocated {c.label}" if c.kind == "colocated" else f"AFD {c.label}"
        name += " (baseline)" if c is result.baseline else ""
        batch = f"{c.batch}" + (" (max)" if c.batch == c.max_batch else "")
        tpot = f"{c.step_ms:.2f}" + ("" if c.meets_tpot else " (over)")
        lines.append(f"| {name} | {c.num_stages} | {batch} | {tpot} | {c.tok_s_per_gpu:,.0f} | "
                     f"{c.tok_s_per_gpu / base:.2f} |")
    return "\n".join(lines)


def afd_commands(best: Candidate, model: str, cluster: Cluster, port: int) -> list[str]:
    """`vllm serve` of the FFN and the attention role for one AFD split, one per host (afd_planner/launch.py)."""
    return launch.afd_commands(best.attention_ranks, best.ffn_ranks, best.num_stages, model, cluster, port)


def recommendation(result: Plan, model: str, cluster: Cluster, port: int, ep_all2all: str = EP_RINGS) -> str:
    best, base = result.best_afd, result.baseline
    if result.afd_wins(AFD_MARGIN):
        assert best is not None
        ratio = best.tok_s_per_gpu / base.tok_s_per_gpu
        lines = [f"Run AFD {best.label} with {best.num_stages} stage(s): {ratio:.2f}x "
                 f"the colocated {base.label} per GPU (batch {best.batch} per attention rank, TPOT "
                 f"{best.step_ms:.2f} ms).", "", "FFN role, then attention role (either may start first):", ""]
        lines += afd_commands(best, model, cluster, port) + launch.across_hosts(cluster)
        if result.gpus > 1 and ep_all2all == EP_RINGS and not cluster.on_cpu:
            lines += ["", f"This gain is over a colocated DP x EP on vLLM's default {EP_RINGS}; if yours would run "
                      f"all-to-all kernels (DeepEP), plan again with --ep-all2all {EP_ALL_TO_ALL} "
                      "(docs/planner.md#against-all-to-all-ep-kernels)."]
        return "\n".join(lines)
    why = ("no AFD split meets the TPOT bound" if best is None or not best.meets_tpot else
           f"the best AFD split ({best.label}, {best.num_stages} stage(s)) reaches "
           f"{best.tok_s_per_gpu / base.tok_s_per_gpu:.2f}x the colocated {base.label} per GPU; AFD is recommended "
           f"above {1 + AFD_MARGIN:.2f}x (the model's error)")
    backend = ep_all2all if ep_all2all != EP_RINGS else None
    lines = [f"Stay colocated: {why}.", "",
             *launch.colocated_commands(base.label, result.gpus, model, cluster, backend)]
    anyway = best is not None and best.meets_tpot
    if anyway:
        lines += ["", f"AFD {best.label} anyway (FFN role, then attention role):", "",
                  *afd_commands(best, model, cluster, port)]
    return "\n".join(lines + launch.across_hosts(cluster, afd=anyway))


def _model(args: argparse.Namespace):
    profile = load_profile(args.profile)
    if args.num_layers is not None:
        profile = replace(profile, model=replace(profile.model, num_layers=args.num_layers))
    if args.host_ms is not None:
        profile = replace(profile, step=tuple(StepSample(sample.batch, args.host_ms) for sample in profile.step))
    link = parse_link(args.link) if args.link else None
    collective = link or LINKS["nvlink"]
    if args.gpus_per_host is not None and args.gpus_per_host < 1:
        raise SystemExit(f"afd_plan: --gpus-per-host must be >= 1, got {args.gpus_per_host}")
    model = CostModel.from_profile(profile, link, collective, gpus_per_host=args.gpus_per_host or 0,
                                   host_link=args.host_link, ep_all2all=args.ep_all2all)
    return profile, model, link, collective


def _hosts(model: CostModel) -> str:
    if not model.gpus_per_host:
        return ""
    return f"; hosts of {model.gpus_per_host} GPUs joined by it, {model.host_link.name} inside a host"


def _memory(profile, device_gib: float | None):
    """The profile's memory block, for a device of `device_gib` GiB when given."""
    if device_gib is None:
        return profile.memory
    if not device_gib > 0:
        raise SystemExit(f"afd_plan: --device-gib must be a positive number of GiB, got {device_gib}")
    if profile.memory is None:
        raise SystemExit("afd_plan: --device-gib resizes the profile's memory block, and this profile has none; "
                         "measure one with `afd_plan.py profile` (it writes the block)")
    return replace(profile.memory, device_gib=device_gib)


def cmd_plan(args: argparse.Namespace) -> int:
    profile, model, link, collective = _model(args)
    cluster = Cluster.of(args.gpus, model.gpus_per_host, link.name if link else None, model.host_link.name,
                         args.hosts, profile.platform)
    if problem := cluster.problem():
        raise SystemExit(f"afd_plan: {problem}")
    context = args.context if args.context is not None else max(s.context for s in profile.attention)
    memory = _memory(profile, args.device_gib)
    result = plan(model, args.gpus, context, args.tpot_ms, args.max_batch, args.min_tokens_per_stage,
                  memory=memory)
    wire = link.name if link else "the profile's measured transport"
    bound = f"{args.tpot_ms:g} ms" if args.tpot_ms else "none"
    print(f"{profile.model.name or 'model'} on {args.gpus} x {profile.device or 'GPU'}: {profile.model.num_layers} "
          f"layers, context {context}, TPOT bound {bound}, A<->F wire {wire}, "
          f"collectives {collective.name}{_hosts(model)}, colocated EP {model.ep_all2all}; "
          f"batch 1..{args.max_batch} per rank"
          f"{f', and what fits in {memory.device_gib:g} GiB per GPU' if memory else ' (no memory in the profile)'}")
    print()
    print(table(result))
    print()
    print(recommendation(result, args.model or profile.model.name or "MODEL", cluster, args.port, model.ep_all2all))
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    if args.shared_device and (args.attention_ranks, args.ffn_ranks) != (1, 1):
        raise SystemExit(f"afd_plan: --shared-device models both roles of 1A1F on one device; got "
                         f"--attention-ranks {args.attention_ranks} --ffn-ranks {args.ffn_ranks}")
    _, model, _, _ = _model(args)
    context = args.context if args.context is not None else 0
    if args.ffn_ranks == 0:
        step = model.colocated_dp_ep_ms(args.attention_ranks, args.batch, context)
        tokens = args.batch * args.attention_ranks
        gpus = args.attention_ranks
    else:
        step = model.afd_ms(args.attention_ranks, args.ffn_ranks, args.stages, args.batch, context,
                            shared_device=args.shared_device)
        tokens = args.batch * args.attention_ranks
        gpus = 1 if args.shared_device else args.attention_ranks + args.ffn_ranks
    print(f"step {step:.3f} ms, {tokens / step * 1e3:,.1f} tok/s ({tokens / step * 1e3 / gpus:,.1f} per GPU)")
    if args.ffn_ranks:
        a, f, t = model.afd_layer_costs(args.attention_ranks, args.ffn_ranks, args.batch / args.stages, context)
        print(f"per layer and stage: attention {a:.4f}, FFN {f:.4f}, wire {t:.4f} ms")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    # NOTE: imported here: the converter reads timeline records through vllm_afd (its wire, no vLLM); `plan` and
    # `predict` need nothing but this folder.
    from afd_planner.timeline import profile_from_timeline

    body, notes = profile_from_timeline(args.timeline_dir, args.model_dir, args.context, args.device, args.num_layers,
                                        args.platform)
    args.out.write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")
    for note in notes:
        print(f"note: {note}")
    print(f"wrote {args.out}")
    return 0


def _sizes(text: str, name: str, minimum: int) -> tuple[int, ...]:
    try:
        values = tuple(sorted({int(v) for v in text.split(",")}))
    except ValueError:
        raise SystemExit(f"afd_plan: --{name} must be comma-separated integers, got {text!r}") from None
    if min(values) < minimum:
        raise SystemExit(f"afd_plan: --{name} values must be >= {minimum}, got {text!r}")
    return values


def _addresses(text: str) -> tuple[str, ...]:
    addresses = tuple(a.strip() for a in text.split(","))
    if not all(addresses):
        raise argparse.ArgumentTypeError(f"expected comma-separated host addresses, got {text!r}")
    return addresses


def _host_link(text: str) -> Link:
    try:
        return parse_link(text, "--host-link")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _layers(text: str) -> int | str:
    if text == FIRST_MOE:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of layers or {FIRST_MOE}, got {text!r}") from None


def check_measure_args(args: argparse.Namespace) -> tuple[Grid, int | None]:
    """The grid and the layers to build (None: all), or SystemExit naming the bad argument (nothing built yet)."""
    grid = Grid(batches=_sizes(args.batches, "batches", 1), contexts=_sizes(args.contexts, "contexts", 1),
                tokens=_sizes(args.tokens, "tokens", 1), warmup=args.warmup, repeats=args.repeats)
    if args.warmup < 0 or args.repeats < 1:
        raise SystemExit(f"afd_plan: --warmup must be >= 0 and --repeats >= 1, got {args.warmup} and {args.repeats}")
    if args.device_gib is not None and not args.device_gib > 0:
        raise SystemExit(f"afd_plan: --device-gib must be a positive number of GiB, got {args.device_gib}")
    try:
        config = read_model_config(args.model_dir)
    except ValueError as exc:
        raise SystemExit(f"afd_plan: {exc}") from None
    layers = args.layers
    if layers == FIRST_MOE:
        try:
            layers = layers_through_first_moe(args.model_dir)
        except ValueError as exc:
            raise SystemExit(f"afd_plan: {exc}") from None
    if layers is not None and not 1 <= layers <= config["num_hidden_layers"]:
        raise SystemExit(f"afd_plan: --layers must be 1..{config['num_hidden_layers']} (the model's layers), "
                         f"got {layers}")
    longest = config.get("max_position_embeddings")
    if isinstance(longest, int) and max(grid.contexts) + 2 > longest:
        raise SystemExit(f"afd_plan: --contexts up to {max(grid.contexts)} exceed the model's "
                         f"max_position_embeddings {longest} (a context and its new token must fit)")
    if not args.out.parent.is_dir():
        raise SystemExit(f"afd_plan: --out {args.out}: folder {args.out.parent} does not exist")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("afd_plan: --device cuda but torch sees no CUDA device; use --device cpu")
    elif args.eager:
        raise SystemExit("afd_plan: --eager is for --device cuda (CPU samples are always eager calls)")
    return grid, layers


def cmd_measure(args: argparse.Namespace) -> int:
    grid, layers = check_measure_args(args)
    body, notes = measure_profile(args.model_dir, grid, device=args.device, load_format=args.load_format,
                                  num_layers=layers, transport=args.transport, eager=args.eager,
                                  device_gib=args.device_gib)
    if args.device_name:
        body["device"] = args.device_name
    args.out.write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")
    for note in notes:
        print(f"note: {note}")
    print(f"wrote {args.out}")
    return 0


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = root.add_subparsers(dest="command", required=True)

    def profile_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("profile", type=Path)
        p.add_argument("--context", type=int, help="tokens of context per request (default: the profile's largest)")
        p.add_argument("--num-layers", type=int, help="crossing layers to plan for (default: the profile's)")
        p.add_argument("--host-ms", type=float,
                       help="per-step host share measured in the served engine (e.g. bench_afd_cpu.py's 'host ms'), "
                            "instead of the profile's step samples (an isolated profile's are a lower bound)")
        p.add_argument("--link", help=f"A<->F and collective wire: {', '.join(LINKS)} or GB_PER_S,LATENCY_US "
                                      "(default: the profile's measured transport; collectives on nvlink)")
        p.add_argument("--gpus-per-host", type=int,
                       help="GPUs per host (default: one link for everything): collectives among at most this many "
                            "ranks, and the A<->F exchange of a deployment this small, run on --host-link; the rest "
                            "on --link, between hosts")
        p.add_argument("--host-link", default="nvlink", type=_host_link,
                       help="the wire inside a host, with --gpus-per-host (default nvlink)")
        p.add_argument("--ep-all2all", choices=EP_ALL2ALL, default=EP_RINGS,
                       help="the colocated DP x EP's --all2all-backend: allgather_reducescatter (vLLM's default, "
                            "two rings a layer) or deepep_low_latency (one-shot all-to-all kernels); AFD's FFN pool "
                            "runs the first (default allgather_reducescatter)")

    p = sub.add_parser("plan", help="rank colocated vLLM and AFD splits on N GPUs")
    profile_args(p)
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--tpot-ms", type=float, help="bound on the decode step (time per output token)")
    p.add_argument("--max-batch", type=int, default=256, help="largest batch per attention rank (default 256)")
    p.add_argument("--min-tokens-per-stage", type=int, default=4, help="as the AFD config key (default 4)")
    p.add_argument("--device-gib", type=float,
                   help="GiB per GPU instead of the profile's device (its timings stay the profiled card's): "
                        "what fits on a card with more or less memory")
    p.add_argument("--model", help="model path for the printed commands (default: the profile's model name)")
    p.add_argument("--hosts", type=_addresses, default=(),
                   help="the hosts' addresses, comma-separated, for the printed commands: host 0 holds FFN rank 0 "
                        "(the AFD store); default 127.0.0.1 on one host, else host0, host1, ...")
    p.add_argument("--port", type=int, default=6390, help="the rendezvous port for the printed config")
    p.set_defaults(run=cmd_plan)

    p = sub.add_parser("predict", help="one deployment's decode step at one batch")
    profile_args(p)
    p.add_argument("--attention-ranks", type=int, required=True, help="A (colocated: the GPUs)")
    p.add_argument("--ffn-ranks", type=int, required=True, help="F; 0 = colocated DP x EP on A GPUs")
    p.add_argument("--stages", type=int, default=1)
    p.add_argument("--batch", type=int, required=True, help="requests per attention rank")
    p.add_argument("--shared-device", action="store_true",
                   help="1A1F with both roles on one device that runs one role's kernels at a time (one GPU, "
                        "time-sliced or under MPS): compute never overlaps across the roles")
    p.set_defaults(run=cmd_predict)

    p = sub.add_parser("profile", help="measure a PROFILE.json through the model's vLLM layers (docs/planner.md)")
    p.add_argument("model_dir", type=Path, help="the model's directory (config.json, and weights unless dummy)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: one thread, gloo transport; cuda: GPU 0, the IPC transport")
    p.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                   help="vLLM's --load-format; dummy: random weights of the real shapes, no checkpoint")
    p.add_argument("--layers", type=_layers, help="layers to build (hf override of num_hidden_layers), or "
                   f"{FIRST_MOE}: up to the first MoE layer (a real-shape model on one device); the profile keeps "
                   "the full model's layer count")
    p.add_argument("--batches", default="1,4,8,16,32", help="requests per attention rank (attention, step, transport)")
    p.add_argument("--contexts", default="16,256", help="tokens of context per request (attention)")
    p.add_argument("--tokens", default="1,4,8,16,32", help="rows of one FFN rank (ffn)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before each sample (default 3)")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per sample; the median is kept (default 10)")
    p.add_argument("--no-transport", dest="transport", action="store_false",
                   help="skip the two-process round trip (a 0 ms transport sample; plan with --link)")
    p.add_argument("--eager", action="store_true",
                   help="cuda: time eager calls (launch costs included) instead of each sample's CUDA graph replay")
    p.add_argument("--device-name", help="the profile's device text (default: what was measured on)")
    p.add_argument("--device-gib", type=float,
                   help="memory of the device to plan for: writes the profile's memory block (the model's weights and "
                        "KV bytes per token, counted from the built layers); default on cuda: GPU 0's, on cpu: none")
    p.set_defaults(run=cmd_measure)

    p = sub.add_parser("profile-from-timeline", help="a PROFILE.json from timeline files (docs/timeline.md)")
    p.add_argument("timeline_dir", type=Path)
    p.add_argument("model_dir", type=Path, help="the directory holding the model's config.json")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--context", type=int, default=0, help="prompt tokens of the recorded requests (not in the records)")
    p.add_argument("--device", default="", help="device name for the profile, e.g. 'NVIDIA H200'")
    p.add_argument("--platform", choices=PLATFORMS, default=PLATFORMS[0],
                   help="what the recorded deployment ran on (default cuda): the printed commands follow it")
    p.add_argument("--num-layers", type=int, help="crossing layers of the model to plan (default: config.json's)")
    p.set_defaults(run=cmd_profile)
    return root


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    for name in ("gpus", "max_batch", "batch", "attention_ranks", "stages", "min_tokens_per_stage", "num_layers"):
        if getattr(args, name, 1) is not None and getattr(args, name, 1) < 1:
            raise SystemExit(f"afd_plan: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if getattr(args, "host_ms", None) is not None and args.host_ms < 0:
        raise SystemExit(f"afd_plan: --host-ms must be >= 0, got {args.host_ms}")
    if getattr(args, "stages", 1) > 3:
        raise SystemExit(f"afd_plan: --stages must be 1, 2 or 3, got {args.stages}")
    try:
        return args.run(args)
    except CaptureError as exc:
        print(f"afd_plan: {exc}", file=sys.stderr)
        return EXIT_CAPTURE_FAILED
    except (ProfileError, ValueError) as exc:
        raise SystemExit(f"afd_plan: {exc}") from None


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["Link", "afd_commands", "main", "recommendation", "table"]
