"""The cost of integrity mode on CPU: a step's exchanges with ``integrity`` on ÷ off, side by side in one run.

Two spawned processes (attention rank 0, FFN rank 0, 1A1F) hold two pairings over ``GlooTransport`` at once, one
with integrity mode on and one off (the handshake makes both roles agree per pairing). The attention times
whole steps, alternating the pairings step by step (ABAB…): one control payload, then ``--layers`` exchanges of
``[B, hidden]`` bf16 (``send_a2f`` + ``recv_f2a`` against ``recv_a2f`` + ``send_f2a``, the FFN echoing), after
``--warmup`` steps of each. It prints the p50 step time of each and the ratio on ÷ off per batch size; run it
twice (``--rounds 2`` does, in one invocation) and read the spread between rounds as the noise.

    python scripts/bench_integrity_cpu.py [--batch-sizes 1,64,256] [--hidden 2048] [--layers 8] [--steps 30]
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import sys
import threading
import time
from typing import Any


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _make_connector(role: str, port: int, args: argparse.Namespace, integrity: bool) -> Any:
    import torch

    from vllm_afd.wire.ends import make_connector
    from vllm_afd.wire.handshake import Fingerprint
    from vllm_afd.wire.placement import Placement
    from vllm_afd.wire.spec import ConnectorSpec
    from vllm_afd.wire.transports.gloo import GlooTransport

    spec = ConnectorSpec(
        name="P2pGlooAFDConnector", hidden_size=args.hidden, dtype=torch.bfloat16, device=torch.device("cpu"),
        host="127.0.0.1", port=port, rendezvous_timeout_s=60.0, step_timeout_s=120.0, peer_timeout_s=20.0,
        exchanges_per_stage=args.layers, integrity=integrity,
    )
    placement = Placement(role, 0, 1, 1)
    fingerprint = Fingerprint.for_rank(
        placement, connector=spec.name, compute_gate_on_attention=False, integrity=integrity, overlay_version="bench",
        vllm_version="bench", architecture="bench", hidden_size=args.hidden, num_hidden_layers=args.layers,
        dtype="bfloat16", layer_kinds="M" * args.layers, num_routed_experts=0, graph_mode="eager", device="cpu",
    )
    return make_connector(spec, placement, GlooTransport(spec.device), fingerprint, terminate=None)


def _ffn_serve(connector: Any, layers: int) -> None:
    """Echo every exchange until the attention closes the pairing."""
    try:
        while True:
            connector.next_step()
            for _ in range(layers):
                connector.send_f2a(0, connector.recv_a2f(0).hidden_states)
            connector.wait_sends()
    except RuntimeError:
        return


def _rank(role: str, args: argparse.Namespace, ports: dict[bool, int], results: Any) -> None:
    import torch

    torch.set_num_threads(1)
    connectors = {mode: _make_connector(role, port, args, mode) for mode, port in ports.items()}
    opened = [threading.Thread(target=c.init) for c in connectors.values()]
    for thread in opened:
        thread.start()
    for thread in opened:
        thread.join(120)
    if role == "ffn":
        servers = [threading.Thread(target=_ffn_serve, args=(c, args.layers)) for c in connectors.values()]
        for server in servers:
            server.start()
        for server in servers:
            server.join()
        for connector in connectors.values():
            connector.close()
        return
    measured: dict[tuple[int, bool], list[float]] = {}
    for batch in args.batch_sizes:
        hidden = torch.randn(batch, args.hidden).to(torch.bfloat16)
        for step in range(args.warmup + args.steps):
            for mode in (False, True) if step % 2 == 0 else (True, False):  # ABAB…, each first half the time
                connector = connectors[mode]
                started = time.perf_counter()
                connector.publish({0: [batch]})
                for _ in range(args.layers):
                    connector.send_a2f(0, hidden)
                    connector.recv_f2a(0, hidden)
                if step >= args.warmup:
                    measured.setdefault((batch, mode), []).append(time.perf_counter() - started)
    for connector in connectors.values():
        connector.close()
    results.put({key: statistics.median(values) for key, values in measured.items()})


def _one_round(args: argparse.Namespace) -> dict[tuple[int, bool], float]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ports = {False: _free_port(), True: _free_port()}
    ranks = [context.Process(target=_rank, args=(role, args, ports, results)) for role in ("ffn", "attention")]
    for process in ranks:
        process.start()
    medians = results.get(timeout=1800)
    for process in ranks:
        process.join(60)
    return medians


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=lambda s: [int(b) for b in s.split(",")], default=[1, 64, 256])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30, help="measured steps per pairing and batch size")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="independent runs (each a fresh pair of processes)")
    args = parser.parse_args(argv)
    print(f"integrity on ÷ off, 1A1F gloo on loopback, [B, {args.hidden}] bf16, {args.layers} exchanges per step, "
          f"p50 of {args.steps} steps each (ABAB)")
    print("round  B      off ms    on ms   on ÷ off")
    for round_index in range(1, args.rounds + 1):
        medians = _one_round(args)
        for batch in args.batch_sizes:
            off, on = medians[(batch, False)] * 1e3, medians[(batch, True)] * 1e3
            print(f"{round_index:>5}  {batch:<5} {off:8.3f} {on:8.3f}   {on / off:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
