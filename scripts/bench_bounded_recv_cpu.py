"""The cost of gloo data receives on CPU, two ways side by side: bounded ÷ exact, or pre-posted ÷ not.

Spawned processes (``--attention-ranks`` attention ranks, default 2, and FFN rank 0: 2A1F, so the FFN joins two
peers' rows) run one pairing over ``GlooTransport`` and switch one of its settings step by step (ABBA…); the
messages are the same either way.  ``--compare bounded`` (the default) switches ``bounded_receives``:
  exact:   today's before: every data receive posted at exactly the published rows (the FFN into a fresh tensor
           per peer, then ``torch.cat``; the attention straight into the tensor it passed);
  bounded: posted at the attention's ``max_rows`` rows, into buffers made once (the FFN's peers' rows land
           concatenated in place; the attention copies its published rows into the tensor it passed).
``--compare prepost`` switches ``prepost_receives`` (receives bounded both ways; docs/protocol.md#receive-order):
  off: each receive is posted when it is waited: a message sent before waits for the receiver's notice and then
       leaves from the sender's gloo loop thread;
  on:  the FFN posts the next exchange's receives as soon as the current one's completed, the attention a stage's
       answer before its send (with two peers the FFN then joins their slots with one copy).
Each step is one control payload and ``--layers`` layers of ``--num-stages`` exchanges of ``[B, hidden]`` bf16 per
attention rank, the FFN echoing; the attention interleaves its stages as its stage threads do (a stage receives
its layer's answer, then sends its next layer, while the other stages' rows travel); ``--compute-us`` keeps each
end busy that long per exchange between its receive and its send, as a layer's compute would.  Printed per batch
size B: attention rank 0's p50 time per layer in ``send_a2f`` and ``recv_f2a`` (every stage's: the transport, no
compute) and the FFN's p50 ``recv_a2f``, each as a ratio; with ``--compare bounded``, also what the one copy the
attention now makes (``out.copy_(head)``, B rows) and the concatenation the FFN no longer makes (2 x B rows) cost
alone, measured in the attention process.  ``--rounds 2`` (the default) runs it twice, each a fresh set of
processes: read the spread as the noise.

    python scripts/bench_bounded_recv_cpu.py [--compare bounded|prepost] [--num-stages 2] [--attention-ranks 2]
        [--compute-us 500] [--batch-sizes 1,64,256] [--hidden 2048] [--layers 8] [--steps 80]
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import sys
import time
from typing import Any

# The setting each comparison switches on the transport, and its two values' names (off, on).
SWITCHES = {"bounded": ("bounded_receives", ("exact", "bounded")), "prepost": ("prepost_receives", ("off", "on"))}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _make_connector(role: str, rank: int, port: int, args: argparse.Namespace) -> Any:
    import torch

    from vllm_afd.wire.ends import make_connector
    from vllm_afd.wire.handshake import Fingerprint
    from vllm_afd.wire.placement import Placement
    from vllm_afd.wire.spec import ConnectorSpec
    from vllm_afd.wire.transports.gloo import GlooTransport

    spec = ConnectorSpec(
        name="P2pGlooAFDConnector", hidden_size=args.hidden, dtype=torch.bfloat16, device=torch.device("cpu"),
        host="127.0.0.1", port=port, rendezvous_timeout_s=120.0, step_timeout_s=120.0, peer_timeout_s=20.0,
        exchanges_per_stage=args.layers, max_rows=args.max_rows, num_stages=args.num_stages,
    )
    num_role_ranks = args.attention_ranks if role == "attention" else 1
    placement = Placement(role, rank, args.attention_ranks, 1, dp_size=num_role_ranks, tp_size=1)
    fingerprint = Fingerprint.for_rank(
        placement, connector=spec.name, compute_gate_on_attention=False, overlay_version="bench",
        vllm_version="bench", architecture="bench", hidden_size=args.hidden, num_hidden_layers=args.layers,
        dtype="bfloat16", layer_kinds="M" * args.layers, num_routed_experts=0, graph_mode="eager", device="cpu",
        max_rows=args.max_rows, num_stages=args.num_stages,
    )
    return make_connector(spec, placement, GlooTransport(spec.device), fingerprint, terminate=None)


def _switched_on(step: int) -> bool:
    """ABBA…: off, on, on, off, …"""
    return step % 4 in (1, 2)


def _compute(microseconds: float) -> None:
    """Stand-in for a layer's compute: keep this rank's core busy, as a model would, for ``microseconds``."""
    until = time.perf_counter() + microseconds * 1e-6
    while time.perf_counter() < until:
        pass


def _copy_costs(batch: int, hidden: int, repeats: int = 200) -> tuple[float, float]:
    """p50 seconds of the attention's copy of B rows, and of concatenating two peers' B rows."""
    import torch

    head = torch.randn(batch, hidden).to(torch.bfloat16)
    out = torch.empty_like(head)
    parts = [torch.randn(batch, hidden).to(torch.bfloat16) for _ in range(2)]
    copies, cats = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        out.copy_(head)
        copies.append(time.perf_counter() - started)
        started = time.perf_counter()
        torch.cat(parts)
        cats.append(time.perf_counter() - started)
    return statistics.median(copies), statistics.median(cats)


def _rank(role: str, rank: int, args: argparse.Namespace, port: int, results: Any) -> None:
    import torch

    torch.set_num_threads(1)
    connector = _make_connector(role, rank, port, args)
    connector.init()
    transport = connector.transport
    switch = SWITCHES[args.compare][0]
    stages = range(args.num_stages)
    measured: dict[tuple[int, bool], list[float]] = {}
    for batch in args.batch_sizes:
        counts = {stage: [batch] * args.attention_ranks for stage in stages}
        hidden = {stage: torch.randn(batch, args.hidden).to(torch.bfloat16) for stage in stages}
        for step in range(args.warmup + args.steps):
            mode = _switched_on(step)
            setattr(transport, switch, mode)  # our own transport object, between steps: the way it receives
            samples = measured.setdefault((batch, mode), []) if step >= args.warmup else []
            if role == "ffn":
                connector.next_step()
                for _ in range(args.layers):
                    for stage in stages:
                        started = time.perf_counter()
                        batch_in = connector.recv_a2f(stage)
                        samples.append(time.perf_counter() - started)
                        _compute(args.compute_us)
                        connector.send_f2a(stage, batch_in.hidden_states)
                connector.wait_sends()
                continue
            connector.publish(counts)
            started = time.perf_counter()
            for stage in stages:
                connector.send_a2f(stage, hidden[stage])
            wire = time.perf_counter() - started  # this layer's time in the connector's calls
            for layer in range(args.layers):
                for stage in stages:  # as the stage threads take turns: this stage's answer, its next layer's send
                    started = time.perf_counter()
                    connector.recv_f2a(stage, hidden[stage])
                    wire += time.perf_counter() - started
                    if layer + 1 < args.layers:
                        _compute(args.compute_us)
                        started = time.perf_counter()
                        connector.send_a2f(stage, hidden[stage])
                        wire += time.perf_counter() - started
                samples.append(wire)
                wire = 0.0
    connector.close()
    report: dict[Any, Any] = {key: statistics.median(values) for key, values in measured.items()}
    if role == "attention" and rank == 0 and args.compare == "bounded":
        report["copies"] = {batch: _copy_costs(batch, args.hidden) for batch in args.batch_sizes}
    if role == "ffn" or rank == 0:
        results.put((role, report))


def _one_round(args: argparse.Namespace) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    ranks = [context.Process(target=_rank, args=(role, rank, args, port, results), daemon=True)
             for role, rank in [("ffn", 0)] + [("attention", k) for k in range(args.attention_ranks)]]
    for process in ranks:
        process.start()
    try:
        return dict(results.get(timeout=1800) for _ in range(2))
    finally:
        for process in ranks:
            process.join(60)
            if process.is_alive():
                process.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", choices=sorted(SWITCHES), default="bounded",
                        help="bounded: receives at max_rows ÷ exact; prepost: receives posted ahead ÷ when waited")
    parser.add_argument("--num-stages", type=int, default=1, help="micro-batch stages per step")
    parser.add_argument("--attention-ranks", type=int, default=2, help="attention ranks, all peers of one FFN rank")
    parser.add_argument("--compute-us", type=float, default=0.0,
                        help="each end busy this long per exchange, between its receive and its send (compute)")
    parser.add_argument("--batch-sizes", type=lambda s: [int(b) for b in s.split(",")], default=[1, 64, 256])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=80, help="measured steps per batch size (half of them each way)")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--max-rows", type=int, default=8192, help="the attention's max_rows (max_num_batched_tokens)")
    parser.add_argument("--rounds", type=int, default=2, help="independent runs (each a fresh set of processes)")
    args = parser.parse_args(argv)
    off, on = SWITCHES[args.compare][1]
    print(f"{on} ÷ {off} gloo data receives, {args.attention_ranks}A1F on loopback, [B, {args.hidden}] bf16 per "
          f"attention rank, max_rows {args.max_rows}, {args.layers} layers x {args.num_stages} stages per step, "
          f"{args.compute_us:g} us compute per exchange on each end, p50 of {args.steps // 2} steps each way (ABBA)")
    copies = args.compare == "bounded"
    print(f"round  B     attn per layer {off}/{on} ms  ratio   FFN recv_a2f {off}/{on} ms  ratio"
          + ("   copy B us  cat 2B us" if copies else ""))
    for round_index in range(1, args.rounds + 1):
        reports = _one_round(args)
        attention, ffn = reports["attention"], reports["ffn"]
        for batch in args.batch_sizes:
            a_off, a_on = attention[(batch, False)] * 1e3, attention[(batch, True)] * 1e3
            f_off, f_on = ffn[(batch, False)] * 1e3, ffn[(batch, True)] * 1e3
            line = (f"{round_index:>5}  {batch:<5} {a_off:10.3f} {a_on:10.3f}      {a_on / a_off:5.2f}   "
                    f"{f_off:10.3f} {f_on:10.3f}      {f_on / f_off:5.2f}")
            if copies:
                copy_s, cat_s = attention["copies"][batch]
                line += f"   {copy_s * 1e6:9.1f}  {cat_s * 1e6:9.1f}"
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
