"""The cost of bounded data receives over gloo on CPU: receives posted at ``max_rows`` rows ÷ exact, side by side.

Three spawned processes (attention ranks 0 and 1, FFN rank 0: 2A1F, so the FFN concatenates two peers' rows) run
one pairing over ``GlooTransport`` and switch its receives step by step (ABBA…) between the two ways (the
transport's ``bounded_receives``; the messages are the same):
  exact:   today's before: every data receive posted at exactly the published rows (the FFN into a fresh tensor
           per peer, then ``torch.cat``; the attention straight into the tensor it passed);
  bounded: posted at the attention's ``max_rows`` rows, into buffers made once (the FFN's peers' rows land
           concatenated in place; the attention copies its published rows into the tensor it passed).
Each step is one control payload and ``--layers`` exchanges of ``[B, hidden]`` bf16 per attention rank, the FFN
echoing. Printed per batch size B: attention rank 0's p50 round trip (``send_a2f`` + ``recv_f2a``) and the FFN's
p50 ``recv_a2f``, each bounded ÷ exact, and, measured in the attention process, what the one copy the attention
now makes (``out.copy_(head)``, B rows) and the concatenation the FFN no longer makes (2 x B rows) cost alone.
``--rounds 2`` (the default) runs it twice, each a fresh set of processes: read the spread as the noise.

    python scripts/bench_bounded_recv_cpu.py [--batch-sizes 1,64,256] [--hidden 2048] [--layers 8] [--steps 80]
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import sys
import time
from typing import Any

ATTENTION_RANKS = 2


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
        exchanges_per_stage=args.layers, max_rows=args.max_rows,
    )
    num_role_ranks = ATTENTION_RANKS if role == "attention" else 1
    placement = Placement(role, rank, ATTENTION_RANKS, 1, dp_size=num_role_ranks, tp_size=1)
    fingerprint = Fingerprint.for_rank(
        placement, connector=spec.name, compute_gate_on_attention=False, overlay_version="bench",
        vllm_version="bench", architecture="bench", hidden_size=args.hidden, num_hidden_layers=args.layers,
        dtype="bfloat16", layer_kinds="M" * args.layers, num_routed_experts=0, graph_mode="eager", device="cpu",
        max_rows=args.max_rows,
    )
    return make_connector(spec, placement, GlooTransport(spec.device), fingerprint, terminate=None)


def _bounded(step: int) -> bool:
    """ABBA…: exact, bounded, bounded, exact, …"""
    return step % 4 in (1, 2)


def _copy_costs(batch: int, hidden: int, repeats: int = 200) -> tuple[float, float]:
    """p50 seconds of the attention's copy of B rows, and of concatenating two peers' B rows."""
    import torch

    head = torch.randn(batch, hidden).to(torch.bfloat16)
    out = torch.empty_like(head)
    parts = [torch.randn(batch, hidden).to(torch.bfloat16) for _ in range(ATTENTION_RANKS)]
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
    measured: dict[tuple[int, bool], list[float]] = {}
    for batch in args.batch_sizes:
        counts = {0: [batch] * ATTENTION_RANKS}
        hidden = torch.randn(batch, args.hidden).to(torch.bfloat16)
        for step in range(args.warmup + args.steps):
            mode = transport.bounded_receives = _bounded(step)  # our own transport object: the way it posts
            samples = measured.setdefault((batch, mode), []) if step >= args.warmup else []
            if role == "ffn":
                connector.next_step()
                for _ in range(args.layers):
                    started = time.perf_counter()
                    batch_in = connector.recv_a2f(0)
                    samples.append(time.perf_counter() - started)
                    connector.send_f2a(0, batch_in.hidden_states)
                connector.wait_sends()
                continue
            connector.publish(counts)
            for _ in range(args.layers):
                started = time.perf_counter()
                connector.send_a2f(0, hidden)
                connector.recv_f2a(0, hidden)
                samples.append(time.perf_counter() - started)
    connector.close()
    report = {key: statistics.median(values) for key, values in measured.items()}
    if role == "attention" and rank == 0:
        report["copies"] = {batch: _copy_costs(batch, args.hidden) for batch in args.batch_sizes}
    if role == "ffn" or rank == 0:
        results.put((role, report))


def _one_round(args: argparse.Namespace) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    ranks = [context.Process(target=_rank, args=(role, rank, args, port, results), daemon=True)
             for role, rank in [("ffn", 0)] + [("attention", k) for k in range(ATTENTION_RANKS)]]
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
    parser.add_argument("--batch-sizes", type=lambda s: [int(b) for b in s.split(",")], default=[1, 64, 256])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=80, help="measured steps per batch size (half of them each way)")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--max-rows", type=int, default=8192, help="the attention's max_rows (max_num_batched_tokens)")
    parser.add_argument("--rounds", type=int, default=2, help="independent runs (each a fresh set of processes)")
    args = parser.parse_args(argv)
    print(f"bounded ÷ exact gloo data receives, 2A1F on loopback, [B, {args.hidden}] bf16 per attention rank, "
          f"max_rows {args.max_rows}, {args.layers} exchanges per step, p50 of {args.steps // 2} steps each way (ABBA)")
    print("round  B     attn RTT exact/bounded ms  ratio   FFN recv exact/bounded ms  ratio   copy B us  cat 2B us")
    for round_index in range(1, args.rounds + 1):
        reports = _one_round(args)
        attention, ffn = reports["attention"], reports["ffn"]
        for batch in args.batch_sizes:
            a_exact, a_bounded = attention[(batch, False)] * 1e3, attention[(batch, True)] * 1e3
            f_exact, f_bounded = ffn[(batch, False)] * 1e3, ffn[(batch, True)] * 1e3
            copy_s, cat_s = attention["copies"][batch]
            print(f"{round_index:>5}  {batch:<5} {a_exact:10.3f} {a_bounded:10.3f}      {a_bounded / a_exact:5.2f}   "
                  f"{f_exact:10.3f} {f_bounded:10.3f}      {f_bounded / f_exact:5.2f}   {copy_s * 1e6:9.1f}  "
                  f"{cat_s * 1e6:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
