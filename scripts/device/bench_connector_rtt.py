#!/usr/bin/env python3
"""Per-layer round trip through the AFD gloo connector vs a raw gloo ping-pong of the same bytes.

The M2 / H2 / C2 ratios (docs/conventions.md#measuring-performance) ask for the exchange cost
inside AFD divided by the floor of the same transport and shapes between the same two
processes.  One GPU cannot host an NCCL pair, so on the H200 the transport is gloo with CUDA
tensors staged through host memory.  This script
spawns an attention and an FFN process and, for each shape ``[rows, hidden]`` (bf16), times
on the attention side:

* ``raw_host``: host tensors as uint8 views over two gloo groups (a2f, f2a): the wire floor;
* ``raw_staged`` (CUDA only): the same, plus what staging costs: device->host copy before
  the send, receive into pinned memory, host->device copy after, device synchronize;
* ``connector``: ``AFDConnector`` + ``GlooTransport`` (what ``P2pGlooAFDConnector`` runs):
  one control payload per step (``publish`` / ``next_step``), then ``layers`` exchanges of
  ``send_a2f`` + ``recv_f2a`` answered by ``recv_a2f`` + ``send_f2a`` (identity FFN).

No vLLM is needed: the connector is driven directly, as the connector tests do.

    python3 scripts/device/bench_connector_rtt.py --device cuda --out rtt.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import queue
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from e2e_report import percentiles_ms

DEFAULT_SHAPES = "1x128,32x128,1x2048,64x2048,256x2048"
NUM_EXPERTS = 8


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'1x128,64x2048' -> [(1, 128), (64, 2048)]."""
    shapes = []
    for part in text.split(","):
        try:
            num_rows, hidden = (int(v) for v in part.strip().lower().split("x"))
        except ValueError:
            num_rows = hidden = 0
        if num_rows <= 0 or hidden <= 0:
            raise ValueError(f"--shapes: {part!r} is not ROWSxHIDDEN with positive integers; "
                             "expected e.g. '1x128,64x2048'.")
        shapes.append((num_rows, hidden))
    return shapes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ----------------------------------------------------------------------------------- raw gloo

def _raw_groups(role: str, port: int, timeout_s: float) -> tuple[Any, Any, Any]:
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    timeout = datetime.timedelta(seconds=timeout_s)
    rank = 0 if role == "ffn" else 1
    store = TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timeout)
    a2f = ProcessGroupGloo(PrefixStore("raw/a2f", store), rank, 2, timeout)
    f2a = ProcessGroupGloo(PrefixStore("raw/f2a", store), rank, 2, timeout)
    return store, a2f, f2a


def _bytes(tensor: Any) -> Any:
    """The uint8 view gloo moves, as GlooTransport sends it."""
    import torch

    return tensor.reshape(-1).view(torch.uint8)


def _raw_pingpong(role: str, groups: tuple[Any, Any, Any], shape: tuple[int, int], device: Any,
                  staged: bool, num_iters: int, num_warmup: int) -> list[float]:
    """One side of `num_warmup + num_iters` exchanges; returns the attention's timed ones (s)."""
    import torch

    _, a2f, f2a = groups
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    host_buf = torch.zeros(shape, dtype=torch.bfloat16, pin_memory=staged)
    dev = torch.ones(shape, dtype=torch.bfloat16, device=device if staged else "cpu")
    samples = []
    for i in range(num_warmup + num_iters):
        if role == "attention":
            started = time.perf_counter()
            host = dev.to("cpu") if staged else dev
            a2f.send([_bytes(host.contiguous())], 0, 0).wait()
            f2a.recv([_bytes(host_buf)], 0, 0).wait()
            if staged:
                dev.copy_(host_buf)
                sync()
            if i >= num_warmup:
                samples.append(time.perf_counter() - started)
        else:
            a2f.recv([_bytes(host_buf)], 1, 0).wait()
            if staged:
                dev.copy_(host_buf)
                host = dev.to("cpu")
            else:
                host = host_buf
            f2a.send([_bytes(host.contiguous())], 1, 0).wait()
    return samples


# ---------------------------------------------------------------------------------- connector

def _connector(role: str, port: int, shape: tuple[int, int], num_layers: int, device: Any, timeout_s: float) -> Any:
    """A gloo connector for `shape` [rows, hidden]: its receives are posted at `rows` (the fingerprint's max_rows)."""
    rows, hidden = shape
    import torch

    import vllm_afd
    from vllm_afd.wire.ends import make_connector
    from vllm_afd.wire.handshake import Fingerprint
    from vllm_afd.wire.placement import Placement
    from vllm_afd.wire.spec import ConnectorSpec
    from vllm_afd.wire.transports.gloo import GlooTransport

    spec = ConnectorSpec(
        name="P2pGlooAFDConnector", hidden_size=hidden, dtype=torch.bfloat16, device=device, host="127.0.0.1",
        port=port, rendezvous_timeout_s=timeout_s, step_timeout_s=timeout_s, peer_timeout_s=10.0,
        exchanges_per_stage=num_layers, max_rows=rows,
    )
    placement = Placement(role, 0, 1, 1)
    fingerprint = Fingerprint.for_rank(
        placement, connector=spec.name, compute_gate_on_attention=False, pid=0,
        overlay_version=vllm_afd.__version__, vllm_version="bench", architecture="Bench", hidden_size=hidden,
        num_hidden_layers=num_layers, dtype="bfloat16", layer_kinds="M" * num_layers,
        num_routed_experts=NUM_EXPERTS, graph_mode="eager", device=str(device), max_rows=rows,
    )
    return make_connector(spec, placement, GlooTransport(device), fingerprint, terminate=None)


def _connector_pingpong(role: str, connector: Any, shape: tuple[int, int], device: Any, num_layers: int,
                        num_steps: int, num_warmup: int) -> dict[str, list[float]]:
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    num_rows, _ = shape
    hidden = torch.ones(shape, dtype=torch.bfloat16, device=device)
    exchanges, steps = [], []
    for step in range(num_warmup + num_steps):
        if role == "attention":
            step_started = time.perf_counter()
            connector.publish({0: [num_rows]})
            for _ in range(num_layers):
                started = time.perf_counter()
                connector.send_a2f(0, hidden)
                connector.recv_f2a(0, hidden)
                sync()
                if step >= num_warmup:
                    exchanges.append(time.perf_counter() - started)
            if step >= num_warmup:
                steps.append(time.perf_counter() - step_started)
        else:
            connector.next_step()
            for _ in range(num_layers):
                connector.send_f2a(0, connector.recv_a2f(0).hidden_states)
    return {"exchange": exchanges, "step": steps}


# ------------------------------------------------------------------------------------ per rank

def run_rank(role: str, spec: dict[str, Any], results: Any) -> None:
    """Body of one spawned process: every mode for every shape, in the same order on both sides."""
    try:
        import torch

        device = torch.device(spec["device"])
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", 0)  # set_device needs an index ("cuda" has none)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        out: list[dict[str, Any]] = []
        groups = _raw_groups(role, spec["raw_port"], spec["timeout_s"])
        for shape in spec["shapes"]:
            row: dict[str, Any] = {"rows": shape[0], "hidden": shape[1], "bytes": shape[0] * shape[1] * 2}
            num_iters = spec["steps"] * spec["layers"]
            row["raw_host_ms"] = percentiles_ms(
                _raw_pingpong(role, groups, shape, device, False, num_iters, spec["warmup"]))
            if device.type == "cuda":
                row["raw_staged_ms"] = percentiles_ms(
                    _raw_pingpong(role, groups, shape, device, True, num_iters, spec["warmup"]))
            out.append(row)
        for index, shape in enumerate(spec["shapes"]):
            connector = _connector(role, spec["connector_ports"][index], shape, spec["layers"], device,
                                   spec["timeout_s"])
            connector.init()
            try:
                timed = _connector_pingpong(role, connector, shape, device, spec["layers"], spec["steps"],
                                            spec["warmup"])
            finally:
                connector.close()
            out[index]["connector_ms"] = percentiles_ms(timed["exchange"])
            step_ms = percentiles_ms(timed["step"])
            out[index]["connector_step_per_layer_ms"] = {k: v / spec["layers"] for k, v in step_ms.items()}
        results.put((role, "ok", out))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put((role, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_bench(device: str, shapes: list[tuple[int, int]], *, layers: int = 3, steps: int = 100,
              warmup: int = 10, timeout_s: float = 120.0) -> dict[str, Any]:
    """Spawn both ranks, wait (bounded), and return the attention's rows plus the ratios."""
    spec = {"device": device, "shapes": shapes, "layers": layers, "steps": steps, "warmup": warmup,
            "timeout_s": timeout_s, "raw_port": free_port(), "connector_ports": [free_port() for _ in shapes]}
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = {role: ctx.Process(target=run_rank, args=(role, spec, results), daemon=True)
             for role in ("ffn", "attention")}
    for proc in procs.values():
        proc.start()
    outcome: dict[str, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(outcome) < 2 and time.monotonic() < deadline:
        try:
            role, status, value = results.get(timeout=0.5)
            outcome[role] = (status, value)
        except queue.Empty:
            if any(not p.is_alive() and r not in outcome for r, p in procs.items()):
                time.sleep(0.5)  # a report may still be in flight
                for role, proc in procs.items():
                    if not proc.is_alive() and role not in outcome and results.empty():
                        outcome[role] = ("error", f"{role} process exited with code {proc.exitcode}")
    for proc in procs.values():
        if proc.is_alive():
            proc.kill()
        proc.join(5.0)
    errors = {role: value for role, (status, value) in outcome.items() if status != "ok"}
    missing = [role for role in procs if role not in outcome]
    if errors or missing:
        raise RuntimeError(
            f"bench_connector_rtt: ranks failed ({errors}) or timed out ({missing}) after {timeout_s:.0f} s; "
            "expected both to finish. Raise --timeout-s or read the traceback above."
        )
    rows = outcome["attention"][1]
    for row in rows:
        floor = row.get("raw_staged_ms") or row["raw_host_ms"]
        row["connector_over_raw_p50"] = row["connector_ms"]["p50"] / floor["p50"] if floor.get("p50") else None
    return {"device": device, "dtype": "bfloat16", "layers": layers, "steps": steps, "warmup": warmup,
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="'cuda' (host-staged) or 'cpu'")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="ROWSxHIDDEN list (bf16 rows)")
    parser.add_argument("--layers", type=int, default=3, help="exchanges per control payload (crossing layers)")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per shape (each `layers` exchanges)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per shape")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--out", type=Path, help="also write the JSON result here")
    args = parser.parse_args(argv)
    result = run_bench(args.device, parse_shapes(args.shapes), layers=args.layers, steps=args.steps,
                       warmup=args.warmup, timeout_s=args.timeout_s)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
