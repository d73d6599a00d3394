#!/usr/bin/env python3
"""Per-layer round trip of the CUDA IPC transport: the floor that serving's per-layer cost is divided by.

Spawns an attention and an FFN process on cuda:0 (both roles on one GPU, as in the device run) and,
for each shape ``[rows, hidden]`` (bf16) and ``--layers`` crossings per step, times on the attention
side the round trip per crossing layer:

* ``raw_graph``: ``IpcTransport`` send/recv only (identity FFN), one step captured in a CUDA graph on
  each side and replayed: no Python, no protocol, the floor;
* ``raw_eager``: the same operations enqueued from Python, layer by layer;
* ``connector_eager``: ``AFDConnector`` over the transport (publish / next_step, send_a2f / recv_f2a,
  row checks, watchdog): what P2pIpcAFDConnector adds in eager serving;
* ``device_flags_graph``: the measured probe's mechanism (flags in device memory, buffers shared by
  torch.multiprocessing), captured like ``raw_graph``: what the transport's host-memory flags cost
  (docs/decisions.md#20-a-capturable-one-node-transport-p2pipcafdconnector).

Both processes time-slice the one GPU, so a round trip costs about two context switches (a probe of
the device-flag mechanism measured 0.29 ms on the H200, flat from 1 to 256 rows of 4 KiB).

    python3 scripts/device/bench_ipc_floor.py --out ipc_floor.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import queue
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench_connector_rtt import free_port, parse_shapes
from e2e_report import percentiles_ms

DEFAULT_SHAPES = "1x128,32x128,1x2048,256x2048"
CONNECTOR = "P2pIpcAFDConnector"


def _connector(role: str, port: int, shape: tuple[int, int], layers: int, timeout_s: float) -> Any:
    import torch

    import vllm_afd
    from vllm_afd.connect import TRANSPORTS
    from vllm_afd.wire.ends import make_connector
    from vllm_afd.wire.handshake import Fingerprint
    from vllm_afd.wire.placement import Placement
    from vllm_afd.wire.spec import ConnectorSpec

    device = torch.device("cuda", 0)
    spec = ConnectorSpec(name=CONNECTOR, hidden_size=shape[1], dtype=torch.bfloat16, device=device, host="127.0.0.1",
                         port=port, rendezvous_timeout_s=timeout_s, step_timeout_s=timeout_s, peer_timeout_s=10.0,
                         exchanges_per_stage=layers, use_graph_buffers=True, max_rows=shape[0])
    placement = Placement(role, 0, 1, 1)
    fingerprint = Fingerprint.for_rank(
        placement, connector=CONNECTOR, compute_gate_on_attention=False, pid=0, overlay_version=vllm_afd.__version__,
        vllm_version="bench", architecture="Bench", hidden_size=shape[1], num_hidden_layers=layers, dtype="bfloat16",
        layer_kinds="M" * layers, num_routed_experts=8, graph_mode="eager", device="cuda", max_rows=shape[0])
    return make_connector(spec, placement, TRANSPORTS[CONNECTOR](device, spec), fingerprint, terminate=None)


def _timed_steps(role: str, step: Any, spec: dict[str, Any], per_step: Any = None) -> list[float]:
    """Run ``warmup + steps`` steps; on the attention, the per-layer time of each timed one (seconds)."""
    import torch

    samples = []
    for index in range(spec["warmup"] + spec["steps"]):
        started = time.perf_counter()
        (per_step or step)()
        torch.cuda.synchronize()
        if role == "attention" and index >= spec["warmup"]:
            samples.append((time.perf_counter() - started) / spec["layers"])
    return samples


def _captured(step: Any) -> Any:
    """``step`` once eagerly (warm-up), then recorded; returns the graph's replay."""
    import torch

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _transport_modes(role: str, connector: Any, shape: tuple[int, int], spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from vllm_afd.wire.placement import A2F, F2A

    transport, layers = connector.transport, spec["layers"]
    buffer = torch.ones(shape, dtype=torch.bfloat16, device="cuda")

    def raw_step() -> None:
        for _ in range(layers):
            if role == "attention":
                transport.send(A2F, buffer, 0)
                transport.recv(F2A, buffer, 0)
            else:
                transport.recv(A2F, buffer, 1)
                transport.send(F2A, buffer, 1)

    def connector_step() -> None:
        if role == "attention":
            connector.publish({0: [shape[0]]})
            for _ in range(layers):
                connector.send_a2f(0, buffer)
                connector.recv_f2a(0, buffer)
        else:
            connector.next_step()
            for _ in range(layers):
                connector.send_f2a(0, connector.recv_a2f(0).hidden_states)

    row = {"raw_eager_ms": percentiles_ms(_timed_steps(role, raw_step, spec))}
    row["raw_graph_ms"] = percentiles_ms(_timed_steps(role, raw_step, spec, per_step=_captured(raw_step)))
    row["connector_eager_ms"] = percentiles_ms(_timed_steps(role, connector_step, spec))
    return row


def _device_flags(role: str, shape: tuple[int, int], spec: dict[str, Any], shared: Any, barrier: Any) -> list[float]:
    """The probe's mechanism: flags and buffers in the attention's device memory, shared with the FFN."""
    import torch

    from vllm_afd.wire.transports.cuda_driver import WAIT, WRITE, CudaDriver, Op

    driver, layers = CudaDriver(torch.device("cuda", 0)), spec["layers"]
    if role == "attention":
        tensors = (torch.zeros(layers, 64, dtype=torch.int32, device="cuda"),
                   torch.zeros(layers, 64, dtype=torch.int32, device="cuda"),
                   torch.zeros((layers, *shape), dtype=torch.bfloat16, device="cuda"),
                   torch.zeros((layers, *shape), dtype=torch.bfloat16, device="cuda"))
        shared.put(tensors)
    else:
        tensors = shared.get(timeout=spec["timeout_s"])
    a2f, f2a, to_ffn, to_attention = tensors
    x = torch.ones(shape, dtype=torch.bfloat16, device="cuda")

    def flag(flags: Any, layer: int, kind: str, value: int) -> None:
        driver.enqueue([Op(kind, flags[layer].data_ptr(), value=value)], driver.current_stream())

    def step() -> None:
        for layer in range(layers):
            if role == "attention":
                to_ffn[layer].copy_(x)
                flag(a2f, layer, WRITE, 1)
                flag(f2a, layer, WAIT, 1)
                flag(f2a, layer, WRITE, 0)
                x.copy_(to_attention[layer])
            else:
                flag(a2f, layer, WAIT, 1)
                flag(a2f, layer, WRITE, 0)
                to_attention[layer].copy_(to_ffn[layer])
                flag(f2a, layer, WRITE, 1)

    samples = _timed_steps(role, step, spec, per_step=_captured(step))
    barrier.wait(spec["timeout_s"])  # the attention owns the memory: it outlives the FFN's last replay
    return samples


def run_rank(role: str, spec: dict[str, Any], results: Any, shared: Any, barrier: Any) -> None:
    """Body of one spawned process: every mode for every shape, in the same order on both sides."""
    try:
        import torch

        torch.cuda.set_device(0)
        rows = []
        for index, shape in enumerate(spec["shapes"]):
            row: dict[str, Any] = {"rows": shape[0], "hidden": shape[1], "bytes": shape[0] * shape[1] * 2}
            connector = _connector(role, spec["ports"][index], shape, spec["layers"], spec["timeout_s"])
            connector.init()
            try:
                row.update(_transport_modes(role, connector, shape, spec))
            finally:
                torch.cuda.synchronize()
                connector.close()
            if spec["device_flags"]:
                row["device_flags_graph_ms"] = percentiles_ms(_device_flags(role, shape, spec, shared, barrier))
            rows.append(row)
        results.put((role, "ok", rows))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put((role, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_bench(shapes: list[tuple[int, int]], *, layers: int = 8, steps: int = 100, warmup: int = 10,
              timeout_s: float = 180.0, device_flags: bool = True) -> dict[str, Any]:
    """Spawn both ranks, wait (bounded), return the attention's rows with the floor ratios."""
    ctx = multiprocessing.get_context("spawn")
    spec = {"shapes": shapes, "layers": layers, "steps": steps, "warmup": warmup, "timeout_s": timeout_s,
            "ports": [free_port() for _ in shapes], "device_flags": device_flags}
    results, shared, barrier = ctx.Queue(), ctx.Queue(), ctx.Barrier(2)
    procs = {role: ctx.Process(target=run_rank, args=(role, spec, results, shared, barrier), daemon=True)
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
            for role, proc in procs.items():
                if not proc.is_alive() and role not in outcome and results.empty():
                    time.sleep(0.5)  # a report may still be in flight
                    if results.empty():
                        outcome[role] = ("error", f"{role} process exited with code {proc.exitcode}")
    for proc in procs.values():
        if proc.is_alive():
            proc.kill()
        proc.join(5.0)
    failed = {role: value for role, (status, value) in outcome.items() if status != "ok"}
    missing = [role for role in procs if role not in outcome]
    if failed or missing:
        raise RuntimeError(f"bench_ipc_floor: ranks failed ({failed}) or timed out ({missing}) after "
                           f"{timeout_s:.0f} s; "
                           "expected both to finish. Raise --timeout-s or read the traceback above.")
    rows = outcome["attention"][1]
    for row in rows:
        floor = row["raw_graph_ms"].get("p50")
        row["connector_eager_over_floor_p50"] = row["connector_eager_ms"]["p50"] / floor if floor else None
    return {"device": "cuda", "dtype": "bfloat16", "layers": layers, "steps": steps, "warmup": warmup, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="ROWSxHIDDEN list (bf16 rows)")
    parser.add_argument("--layers", type=int, default=8, help="crossings per step (and per captured graph)")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per mode and shape")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per mode and shape")
    parser.add_argument("--timeout-s", type=float, default=180.0)
    parser.add_argument("--no-device-flags", action="store_true", help="skip the probe's device-flag variant")
    parser.add_argument("--out", type=Path, help="also write the JSON result here")
    args = parser.parse_args(argv)
    result = run_bench(parse_shapes(args.shapes), layers=args.layers, steps=args.steps, warmup=args.warmup,
                       timeout_s=args.timeout_s, device_flags=not args.no_device_flags)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
