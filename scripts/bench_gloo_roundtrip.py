"""Per-layer round trip through AFDConnector over GlooTransport vs a raw gloo ping-pong (C2 of
docs/conventions.md#measuring-performance).

Two spawned processes (attention rank 0, FFN rank 0, 1A1F) measure, side by side in one run and in
alternating blocks, for every batch size B:
  raw:       attention sends B x hidden bytes on a bare ProcessGroupGloo, the FFN sends them back;
  connector: send_a2f + recv_f2a against recv_a2f + send_f2a (identity), one control payload
             (publish / next_step) per step of ``--layers`` exchanges, as a model forward would do.
The ratio connector / raw (p50) is the connector's software overhead on top of gloo (target <= 1.5).

    python scripts/bench_gloo_roundtrip.py [--batch-sizes 1,64,256] [--hidden 2048] [--pin] [--device cuda]

With ``--device cuda`` both ranks keep their tensors on cuda:0 and the connector stages them through
host memory (both roles on one GPU); the raw path still moves host bytes, so the ratio then includes
the device<->host copies.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import socket
import statistics
import sys
import time
from typing import Any


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _make_connector(role: str, port: int, hidden: int, dtype: Any, layers: int, device: str, max_rows: int) -> Any:
    """A gloo connector whose receives are posted at `max_rows` rows (the largest batch measured)."""
    import torch

    from vllm_afd.wire.ends import make_connector
    from vllm_afd.wire.handshake import Fingerprint
    from vllm_afd.wire.placement import Placement
    from vllm_afd.wire.spec import ConnectorSpec
    from vllm_afd.wire.transports.gloo import GlooTransport

    spec = ConnectorSpec(
        name="P2pGlooAFDConnector", hidden_size=hidden, dtype=dtype, device=torch.device(device), host="127.0.0.1",
        port=port, rendezvous_timeout_s=60.0, step_timeout_s=60.0, peer_timeout_s=10.0, exchanges_per_stage=layers,
        max_rows=max_rows,
    )
    placement = Placement(role, 0, 1, 1)
    fingerprint = Fingerprint.for_rank(
        placement, connector=spec.name, compute_gate_on_attention=False, overlay_version="bench",
        vllm_version="bench", architecture="bench", hidden_size=hidden, num_hidden_layers=layers,
        dtype=str(dtype).removeprefix("torch."), layer_kinds="M" * layers, num_routed_experts=0,
        graph_mode="eager", device=device, max_rows=max_rows,
    )
    return make_connector(spec, placement, GlooTransport(spec.device), fingerprint, terminate=None)


def _raw_groups(role: str, port: int) -> tuple[Any, Any, Any]:
    """A bare store + two gloo pairs (a2f, f2a), built exactly like the connector's but without it."""
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    timeout = datetime.timedelta(seconds=60)
    host = role == "ffn"
    store = TCPStore("127.0.0.1", port, is_master=host, wait_for_workers=False, timeout=timeout,
                     **({"use_libuv": False} if host else {}))
    rank = 0 if host else 1
    return store, ProcessGroupGloo(PrefixStore("raw/a2f", store), rank, 2, timeout), \
        ProcessGroupGloo(PrefixStore("raw/f2a", store), rank, 2, timeout)


def _rank(role: str, args: argparse.Namespace, ports: tuple[int, int], results: Any) -> None:
    import torch

    if args.pin:
        os.sched_setaffinity(0, {0 if role == "attention" else 1})
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    wait = datetime.timedelta(days=1)
    _, raw_a2f, raw_f2a = _raw_groups(role, ports[0])
    device = "cuda:0" if args.device == "cuda" else "cpu"
    connector = _make_connector(role, ports[1], args.hidden, dtype, args.layers, device, max(args.batch_sizes))
    connector.init()
    table = []
    for batch in args.batch_sizes:
        host_hidden = torch.randn(batch, args.hidden).to(dtype)
        raw_bytes = host_hidden.reshape(-1).view(torch.uint8)
        hidden = host_hidden.to(device)
        raw_s: list[float] = []
        conn_s: list[float] = []
        for _block in range(args.blocks):
            for i in range(args.warmup + args.iters):  # raw ping-pong
                started = time.perf_counter()
                if role == "attention":
                    raw_a2f.send([raw_bytes], 0, 0).wait(wait)
                    raw_f2a.recv([raw_bytes], 0, 0).wait(wait)
                else:
                    raw_a2f.recv([raw_bytes], 1, 0).wait(wait)
                    raw_f2a.send([raw_bytes], 1, 0).wait(wait)
                if i >= args.warmup:
                    raw_s.append(time.perf_counter() - started)
            num_steps = (args.warmup + args.iters) // args.layers
            for step in range(num_steps):  # the connector, one payload per step of `layers` exchanges
                if role == "attention":
                    connector.publish({0: [batch]})
                else:
                    connector.next_step()
                for layer in range(args.layers):
                    started = time.perf_counter()
                    if role == "attention":
                        connector.send_a2f(0, hidden)
                        connector.recv_f2a(0, hidden)
                    else:
                        connector.send_f2a(0, connector.recv_a2f(0).hidden_states)
                    if step * args.layers + layer >= args.warmup:
                        conn_s.append(time.perf_counter() - started)
        table.append((batch, raw_s, conn_s))
    connector.close()
    if role == "attention":
        results.put(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,64,256", help="comma-separated rows per exchange")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", type=int, default=16, help="exchanges per step (one payload each step)")
    parser.add_argument("--iters", type=int, default=64, help="measured round trips per block and path")
    parser.add_argument("--warmup", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=8,
                        help="alternating raw/connector blocks (more blocks: less drift)")
    parser.add_argument("--pin", action="store_true", help="pin attention to CPU 0 and FFN to CPU 1")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the connector's tensors live")
    args = parser.parse_args(argv)
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        parser.error(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}")
    if (args.warmup + args.iters) % args.layers:
        parser.error(f"--warmup + --iters ({args.warmup + args.iters}) must be a multiple of --layers ({args.layers})")

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    ports = (_free_port(), _free_port())
    procs = [ctx.Process(target=_rank, args=(role, args, ports, results), daemon=True) for role in ("ffn", "attention")]
    for proc in procs:
        proc.start()
    try:
        table = results.get(timeout=600)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    print(f"gloo round trip per layer, [B, {args.hidden}] {args.dtype}, 1A1F loopback, connector tensors on "
          f"{args.device}, {args.blocks}x{args.iters} samples per path, pinned={args.pin}")
    print(f"{'B':>5} {'raw p50 ms':>11} {'conn p50 ms':>12} {'ratio p50':>10} {'raw p99 ms':>11} {'conn p99 ms':>12}")
    for batch, raw_s, conn_s in table:
        raw50, conn50 = statistics.median(raw_s) * 1e3, statistics.median(conn_s) * 1e3
        print(f"{batch:>5} {raw50:>11.3f} {conn50:>12.3f} {conn50 / raw50:>10.2f} "
              f"{_percentile(raw_s, 0.99) * 1e3:>11.3f} {_percentile(conn_s, 0.99) * 1e3:>12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
