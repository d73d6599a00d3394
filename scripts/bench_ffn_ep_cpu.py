#!/usr/bin/env python3
"""Per-layer FFN compute at F = 2 (FFN DP 2, vLLM's expert parallelism) ÷ F = 1 on this CPU, side by side.

The planner's number for an FFN pool: how long one layer of the FFN takes for the same rows when two FFN
ranks share them (each gathers every rank's rows, computes its half of the experts, reduce-scatters back:
vLLM's ``allgather_reducescatter`` over gloo) against one FFN rank computing all of them.

Three workers start once and stay up: F = 1 (one process, FFN DP 1, pinned to core 0) and F = 2 (two
processes, FFN DP 2 with ``--enable-expert-parallel``, pinned to cores 0 and 1). Each is the real
``AFDFFNModelRunner`` on the FFN half of the model; only its connector is a stand-in that hands it the rows of
A = 2 attention ranks (seeded hidden states, the same rows in both deployments) and times each layer from
"all rows received" to "output handed back" (the span the timeline calls FFN compute, docs/timeline.md).
At F = 2 a layer's time is the slower rank's (they finish a layer together: the reduce-scatter).

Each round runs every batch size on both deployments in turn, the order alternating between rounds (ABAB…),
so a busy moment of this shared machine lands on both; a cell is the median over rounds of the per-round
medians, and the ratio column the median of the per-round ratios (min–max beside it). Nothing is timed
while the other deployment runs: its workers block on their command pipe.

    python scripts/bench_ffn_ep_cpu.py --archs qwen3_moe qwen3_moe_1k_4l --batch-sizes 2,16,64,256 \\
        [--repeats 5] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NUM_ATTENTION = 2
# A line a worker prints for the parent; everything else on its stdout is vLLM's log.
PREFIX = "AFD-BENCH "
READY_TIMEOUT_S = 900
STEP_TIMEOUT_S = 600


# ---- worker: one FFN rank, commanded over stdin ------------------------------------------------------------

def timing_connector(placement, hidden_size: int):
    """The harness's seeded-rows stand-in, timing each layer from "all rows received" to "output handed back"."""
    from afd_harness.ffn_rank import SeededRowsConnector

    class TimingConnector(SeededRowsConnector):
        def __init__(self) -> None:
            super().__init__(placement, hidden_size)
            self.received_ns = 0
            self.compute_ns: list[int] = []  # one per layer and stage, in order

        def recv_a2f(self, stage: int, routing=None):
            batch = super().recv_a2f(stage, routing)
            self.received_ns = time.perf_counter_ns()
            return batch

        def keep(self, stage: int, output) -> None:
            self.compute_ns.append(time.perf_counter_ns() - self.received_ns)

    return TimingConnector()


def worker(model_dir: str, num_ffn: int, rank: int, port: int, cpu: int) -> None:
    """Load the FFN half, print READY, then run each command line's steps and print their per-layer times."""
    os.sched_setaffinity(0, {cpu})
    import torch

    from afd_harness.ffn_rank import ffn_rank
    from afd_harness.tiny_models import read_recipe
    from vllm_afd.wire.messages import ControlPayload

    torch.set_num_threads(1)
    afd = {"num_attention_ranks": NUM_ATTENTION, "num_ffn_ranks": num_ffn, "reform_timeout_s": 0}
    dummy = "--load-format" in read_recipe(Path(model_dir))["serve_args"]
    with ffn_rank(model_dir, afd, timing_connector, rank=rank, port=port, expert_parallel=num_ffn > 1,
                  max_model_len=1024, load_format="dummy" if dummy else "auto") as (runner, feeder):
        print(PREFIX + json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            command = json.loads(line)
            if command.get("quit"):
                break
            feeder.compute_ns = []
            for _ in range(command["steps"]):
                payload = ControlPayload({0: tuple(command["tokens"])})
                feeder.adopt(payload)
                runner.run_step(payload)
            print(PREFIX + json.dumps({"compute_ns": feeder.compute_ns}), flush=True)


# ---- parent: start both deployments, interleave, print ratios ----------------------------------------------

class Worker:
    """One worker process and a thread that queues its PREFIX lines (every wait below is bounded)."""

    def __init__(self, model_dir: Path, num_ffn: int, rank: int, port: int, cpu: int, ident: str,
                 log: Path) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_DIST_IDENT": ident, "RANK": str(rank)}
        with open(log, "w") as log_file:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, "--worker", str(model_dir), str(num_ffn), str(rank), str(port), str(cpu)],
                cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file, text=True)
        self.log = log
        self.lines: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with open(self.log, "a") as log_file:
            for line in self.proc.stdout:
                if line.startswith(PREFIX):
                    self.lines.put(json.loads(line[len(PREFIX):]))
                else:
                    log_file.write(line)

    def send(self, command: dict) -> None:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout_s: float) -> dict:
        try:
            return self.lines.get(timeout=timeout_s)
        except queue.Empty:
            tail = self.log.read_text()[-3000:]
            raise SystemExit(f"bench_ffn_ep_cpu: no reply from a worker within {timeout_s:.0f} s "
                             f"(exit code {self.proc.poll()}); its log {self.log} ends:\n{tail}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"quit": True})
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def per_layer_ns(workers: list[Worker], tokens: list[int], steps: int) -> list[int]:
    """Run ``steps`` steps on one deployment; per layer, the slowest rank's compute (ns)."""
    for w in workers:
        w.send({"tokens": tokens, "steps": steps})
    replies = [w.reply(STEP_TIMEOUT_S)["compute_ns"] for w in workers]
    return [max(layer) for layer in zip(*replies)]


def measure(arch: str, batch_sizes: list[int], repeats: int, steps: int, log_dir: Path) -> list[dict]:
    from afd_harness.tiny_models import build_tiny_model

    model = build_tiny_model(arch, REPO / "models" / arch)
    ident = f"afd-bench-ep-{uuid.uuid4().hex[:8]}"  # vLLM's CPU shared-memory names: unique per run
    port_1, port_2 = free_port(), free_port()
    f1 = [Worker(model, 1, 0, port_1, 0, ident + "-f1", log_dir / f"{arch}-f1.log")]
    f2 = [Worker(model, 2, rank, port_2, rank, ident + "-f2", log_dir / f"{arch}-f2-{rank}.log") for rank in (0, 1)]
    deployments = {"F=1": f1, "F=2": f2}
    try:
        for w in f1 + f2:
            w.reply(READY_TIMEOUT_S)
        samples: dict[tuple[str, int], list[float]] = {}
        for batch in batch_sizes:  # warm-up: one untimed run of every shape
            for workers in deployments.values():
                per_layer_ns(workers, split(batch), 1)
        for round_ in range(repeats):
            order = list(deployments) if round_ % 2 == 0 else list(reversed(deployments))
            for batch in batch_sizes:
                for name in order:
                    times = per_layer_ns(deployments[name], split(batch), steps)
                    samples.setdefault((name, batch), []).append(statistics.median(times) / 1e6)
            print(f"  {arch}: round {round_ + 1}/{repeats} done", flush=True)
    finally:
        for w in f1 + f2:
            w.stop()
    rows = []
    for batch in batch_sizes:
        one, two = samples[("F=1", batch)], samples[("F=2", batch)]
        ratios = [b / a for a, b in zip(one, two)]
        rows.append({"arch": arch, "batch": batch, "f1_ms": statistics.median(one), "f2_ms": statistics.median(two),
                     "ratio": statistics.median(ratios), "lo": min(ratios), "hi": max(ratios)})
    return rows


def split(batch: int) -> list[int]:
    """Tokens per attention rank: the batch over A = 2 ranks (rank 0 takes the odd one)."""
    return [batch - batch // 2, batch // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", nargs="+", default=["qwen3_moe", "qwen3_moe_1k_4l"])
    parser.add_argument("--batch-sizes", default="2,16,64,256", help="tokens per step over both attention ranks")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (ABAB…)")
    parser.add_argument("--steps", type=int, default=4, help="steps per deployment, batch and round")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/bench-ffn-ep"))
    args = parser.parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if min(batch_sizes) < 1 or max(batch_sizes) > 1024 or args.repeats < 2 or args.steps < 1:
        parser.error("batch sizes must be 1..1024 (max_num_batched_tokens), --repeats >= 2, --steps >= 1")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = [row for arch in args.archs for row in measure(arch, batch_sizes, args.repeats, args.steps, args.log_dir)]
    print(f"\nPer-layer FFN compute, F = 2 (EP over gloo, cores 0+1) ÷ F = 1 (core 0); started {started}, "
          f"{args.repeats} interleaved rounds x {args.steps} steps, load average {os.getloadavg()[0]:.1f} at the end\n")
    print("| model | tokens/step | F = 1 (ms/layer) | F = 2 (ms/layer) | F = 2 ÷ F = 1 | min–max over rounds |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['arch']} | {r['batch']} | {r['f1_ms']:.3f} | {r['f2_ms']:.3f} | {r['ratio']:.2f} | "
              f"{r['lo']:.2f}–{r['hi']:.2f} |")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        model_dir, num_ffn, rank, port, cpu = sys.argv[2:7]
        worker(model_dir, int(num_ffn), int(rank), int(port), int(cpu))
        sys.exit(0)
    sys.exit(main())
