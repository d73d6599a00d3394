#!/usr/bin/env python3
"""A longer soak of AFD on CPU: client threads for --duration-s, attention and FFN crashes in between.

Runs a plain-vLLM baseline first (the expected greedy tokens), then an FFN + attention
deployment (one core each) under `--clients` threads of the soak driver
(tests/harness/afd_harness/soak.py), injecting `--faults` in order, spread over the first
half of the run: `attention` = SIGKILL the attention and restart it (the FFN must keep its pid
and re-form); `ffn` = SIGKILL the FFN and restart it (the attention must keep its pid and heal,
docs/connection.md#healing-attention).  Prints and writes (--out X.json and X.md) requests by outcome,
each fault's time to serve again, and RSS growth per 100 requests after the last fault.
Exit code 1 if any request ended wrongly.  Results: docs/soak.md.

    python scripts/soak_afd_cpu.py --duration-s 600 --clients 4 \
        --faults attention,attention,ffn,attention --out /tmp/soak
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from afd_harness.afd import AFDDeployment
from afd_harness.server import VllmServer, complete_batch, cpu_server_env
from afd_harness.soak import MAX_TOKENS, PROMPTS, Fault, SoakPlan, run_soak, summary
from afd_harness.tiny_models import build_tiny_model, serve_env

REPO = Path(__file__).resolve().parents[1]
ROLES = ("attention", "ffn")


def fault_schedule(roles: list[str], duration_s: float) -> tuple[Fault, ...]:
    """Faults spread evenly over [10 %, 50 %] of the run (each waits for the one before)."""
    if not roles:
        return ()
    step = 0.4 * duration_s / max(len(roles) - 1, 1)
    return tuple(Fault(0.1 * duration_s + i * step, role) for i, role in enumerate(roles))


def markdown(digest: dict, command: str) -> str:
    lines = [f"`{command}`", "", f"{digest['requests']} requests in {digest['duration_s']} s:", "",
             "| outcome | requests |", "|---|---|"]
    lines += [f"| {name} | {count} |" for name, count in digest["outcomes"].items()]
    lines += ["", "| fault | at (s) | serving again after (s) | restarted role's start-up (s) | FFN pid kept | "
              "attention pid kept | FFN re-formations |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {f['role']} | {f['at_s']:.0f} | {f['serving_again_s']:.1f} | {f['restarted_startup_s']:.1f} "
              f"| {f['ffn_pid_kept']} | {f['attention_pid_kept']} "
              f"| {f['ffn_reformations'] if f['ffn_reformations'] is not None else '–'} |" for f in digest["faults"]]
    lines += ["", f"RSS (MB) of each role's process group; window from {digest['memory_window_start_s']} s "
              "(after the last fault) to the end:", "",
              "| role | first sample | last sample | window start | window end | growth | requests | "
              "MB / 100 requests |", "|---|---|---|---|---|---|---|---|"]
    for role, memory in digest["memory"].items():
        w = memory["window"] or {}
        lines.append(f"| {role} | {memory['first_mb']:.0f} | {memory['last_mb']:.0f} | {w.get('start_mb', 0):.1f} | "
                     f"{w.get('end_mb', 0):.1f} | {w.get('growth_mb', 0):+.1f} | {w.get('requests', 0)} | "
                     f"{w.get('mb_per_100_requests', 0):+.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--faults", default="attention,attention,ffn,attention",
                        help="comma-separated roles to crash in order ('' for none)")
    parser.add_argument("--model", default="qwen3_moe", help="a tiny-model arch or a checkpoint directory")
    parser.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    parser.add_argument("--log-dir", type=Path, help="server logs (default: a temporary directory)")
    args = parser.parse_args(argv)
    roles = [r for r in args.faults.split(",") if r]
    if any(r not in ROLES for r in roles):
        parser.error(f"--faults {args.faults!r}: expected roles from {ROLES}, comma-separated")
    if args.duration_s <= 0 or args.clients <= 0:
        parser.error("--duration-s and --clients must be positive")

    model = (Path(args.model) if Path(args.model).is_dir()
             else build_tiny_model(args.model, REPO / "models" / args.model))
    env = serve_env(model)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="afd-soak-"))
    print(f"soak: logs in {log_dir}", flush=True)
    with VllmServer(model, launcher="cli", log_path=log_dir / "plain.log",
                    env={**cpu_server_env(omp_cpus="0"), **env}) as plain:
        expected = [g.token_ids for g in complete_batch(plain.base_url, list(PROMPTS), MAX_TOKENS)]
    plan = SoakPlan(PROMPTS, expected, clients=args.clients, duration_s=args.duration_s,
                    min_window_s=args.duration_s / 3, settle_s=10.0,
                    faults=fault_schedule(roles, args.duration_s))
    with AFDDeployment(model, python=sys.executable, log_dir=log_dir, env=env) as afd:
        report = run_soak(afd, plan, log=lambda line: print(line, flush=True))
    digest = summary(report)
    command = "python scripts/soak_afd_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    table = markdown(digest, command)
    print(table)
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps(digest, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(table)
    for failure in digest["failures"][:10]:
        print(f"FAILED request (times in s since the soak started): {failure}", file=sys.stderr)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
