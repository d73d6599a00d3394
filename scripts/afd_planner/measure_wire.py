"""The `transport` samples of `afd_plan.py profile`: the connector's round trip between two local processes.

An FFN rank and an attention rank (1A1F, spawned, one thread each) build the device's connector as a
deployment does (`vllm_afd.connect.TRANSPORTS`: gloo on CPU, the IPC transport on CUDA with both roles on
GPU 0), rendezvous on loopback, and run `warmup + repeats` rounds of one step per batch B (interleaved), each
of `EXCHANGES` exchanges:
the attention publishes the step's control payload, then per exchange sends [B, hidden] and receives them
back from an FFN that returns what it got (no compute, so the round trip is the transport alone).  A sample
is the median exchange at B rows; the publish (send of the control frame) is timed per step.  As
scripts/bench_gloo_roundtrip.py's connector path, without its raw-gloo comparison.
"""

from __future__ import annotations

import json
import multiprocessing
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["EXCHANGES", "round_trips"]

EXCHANGES = 4  # exchanges per step (one control payload each step), as a 4-layer model


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _connector(role: str, port: int, device: str, hidden: int, dtype: Any, max_rows: int, timeout_s: float) -> Any:
    import torch

    from vllm_afd.connect import TRANSPORTS
    from vllm_afd.wire.ends import make_connector
    from vllm_afd.wire.handshake import Fingerprint
    from vllm_afd.wire.placement import Placement
    from vllm_afd.wire.spec import ConnectorSpec

    name = "P2pIpcAFDConnector" if device == "cuda" else "P2pGlooAFDConnector"
    spec = ConnectorSpec(
        name=name, hidden_size=hidden, dtype=dtype, device=torch.device("cuda:0" if device == "cuda" else "cpu"),
        host="127.0.0.1", port=port, rendezvous_timeout_s=timeout_s, step_timeout_s=timeout_s,
        peer_timeout_s=timeout_s, exchanges_per_stage=EXCHANGES, max_rows=max_rows, startup_timeout_s=timeout_s)
    placement = Placement(role, 0, 1, 1)
    fingerprint = Fingerprint.for_rank(
        placement, connector=name, compute_gate_on_attention=False, overlay_version="afd_plan",
        vllm_version="afd_plan", architecture="afd_plan", hidden_size=hidden, num_hidden_layers=EXCHANGES,
        dtype=str(dtype).removeprefix("torch."), layer_kinds="M" * EXCHANGES, num_routed_experts=0,
        graph_mode="eager", device=device, max_rows=max_rows)
    return make_connector(spec, placement, TRANSPORTS[name](spec.device, spec), fingerprint, terminate=None)


def _rank(role: str, port: int, device: str, hidden: int, dtype_name: str, batches: list[int], warmup: int,
          repeats: int, timeout_s: float, out: str) -> None:
    """One rank's loop; the attention writes {batch: [exchange ms...], "publish": [ms...]} to `out` as JSON."""
    import torch

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    connector = _connector(role, port, device, hidden, dtype, max(batches), timeout_s)
    connector.init()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    result: dict[str, list[float]] = {"publish": [], **{str(batch): [] for batch in batches}}
    inputs = {batch: torch.randn(batch, hidden).to(dtype).to(connector.spec.device) for batch in batches}
    for step in range(warmup + repeats):  # NOTE: batches interleaved, so a burst of other load hits every size alike
        for batch in batches:
            rows, samples = inputs[batch], result[str(batch)]
            started = time.perf_counter()
            if role == "attention":
                connector.publish({0: [batch]})
                if step >= warmup:
                    result["publish"].append((time.perf_counter() - started) * 1e3)
            else:
                connector.next_step()
            for _ in range(EXCHANGES):
                started = time.perf_counter()
                if role == "attention":
                    connector.send_a2f(0, rows)
                    connector.recv_f2a(0, rows)
                    sync()
                else:
                    connector.send_f2a(0, connector.recv_a2f(0).hidden_states)
                if step >= warmup:
                    samples.append((time.perf_counter() - started) * 1e3)
    connector.close()
    if role == "attention":
        Path(out).write_text(json.dumps(result), encoding="utf-8")


def round_trips(device: str, hidden: int, dtype: Any, grid: Any, timeout_s: float = 120.0
                ) -> tuple[list[dict[str, Any]], float, list[str]]:
    """(transport samples, median publish ms per step, notes with the spread) for `grid.batches`."""
    dtype_name = str(dtype).removeprefix("torch.")
    batches = sorted(set(grid.batches))
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="afd-plan-wire-") as tmp:
        out = str(Path(tmp) / "attention.json")
        procs = [ctx.Process(target=_rank, args=(role, port, device, hidden, dtype_name, batches, grid.warmup,
                                                 grid.repeats, timeout_s, out), daemon=True)
                 for role in ("ffn", "attention")]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s * 2
        for proc in procs:
            proc.join(max(1.0, deadline - time.monotonic()))
        stuck = [proc for proc in procs if proc.is_alive()]
        for proc in stuck:
            proc.kill()
            proc.join(5)
        if stuck or any(proc.exitcode for proc in procs) or not Path(out).is_file():
            raise RuntimeError(f"profile: the transport's two processes did not finish within {timeout_s * 2:.0f} s "
                               f"(exit codes {[proc.exitcode for proc in procs]}); see their output above")
        result = json.loads(Path(out).read_text(encoding="utf-8"))
    samples, notes = [], []
    for batch in batches:
        times = result[str(batch)]
        samples.append({"bytes": batch * hidden * dtype.itemsize, "ms": round(statistics.median(times), 4)})
        notes.append(f"transport B {batch} ({batch * hidden * dtype.itemsize} bytes): "
                     f"{statistics.median(times):.3f} ms ({min(times):.3f}..{max(times):.3f})")
    publish = statistics.median(result["publish"])
    notes.append(f"control payload publish per step: {publish:.3f} ms "
                 f"({min(result['publish']):.3f}..{max(result['publish']):.3f})")
    return samples, publish, notes
