"""Rank bodies of the IPC transport's GPU tests (top-level, so ``spawn`` can import them).

Both ranks share cuda:0, as both roles do on one GPU; with ``ffn_gpu=1`` the FFN is on cuda:1, a peer GPU
of the same node (the IPC handle opened on another device, the copies over NVLink/P2P, the flags in host
memory). The data is _scenarios' small integers and FFN function, so every result is checked bit for bit
against the same arithmetic on CPU.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from tests.connectors._harness import NUM_EXPERTS, make_connector, make_placement, make_spec
from tests.connectors._scenarios import crossing_layers, ffn_compute, make_hidden, make_logits

from vllm_afd.wire.connector import AFDConnector
from vllm_afd.wire.messages import RoutingSpec

CONNECTOR = "P2pIpcAFDConnector"
MAX_ROWS = 16


def ipc_connector(role: str, port: int, *, gate: bool, graph_buffers: bool = False,
                  peer_timeout_s: float = 2.0, gpu: int = 0) -> AFDConnector:
    """A 1A1F connector over the registered IPC transport on cuda:<gpu>."""
    from vllm_afd.connect import TRANSPORTS

    device = torch.device("cuda", gpu)
    torch.cuda.set_device(device)
    spec = make_spec(port, name=CONNECTOR, device=device, exchanges_per_stage=len(crossing_layers(gate)),
                     router_logits_width=NUM_EXPERTS if gate else None, use_graph_buffers=graph_buffers,
                     max_rows=MAX_ROWS, peer_timeout_s=peer_timeout_s, rendezvous_timeout_s=60.0)
    return make_connector(spec, make_placement(role, 0, 1, 1), transport=TRANSPORTS[CONNECTOR](device, spec))


def _ffn_step(connector: AFDConnector, gate: bool) -> None:
    routing = RoutingSpec(NUM_EXPERTS, torch.float32) if gate else None
    for layer in crossing_layers(gate):
        batch = connector.recv_a2f(0, routing)
        connector.send_f2a(0, ffn_compute(batch.hidden_states, batch.router_logits, layer))


def _reference(hidden: torch.Tensor, gate: bool, logits_of: Any) -> torch.Tensor:
    """What the attention holds after every crossing layer of a step: the FFN's arithmetic, run locally."""
    for layer in crossing_layers(gate):
        hidden = ffn_compute(hidden, logits_of(layer) if gate else None, layer)
    return hidden


def eager_then_graphs(role: str, port: int, gate: bool, num_replays: int = 3, ffn_gpu: int = 0) -> dict[str, Any]:
    """Eager steps of varied rows, then one step captured on each side and replayed with new inputs."""
    connector = ipc_connector(role, port, gate=gate, graph_buffers=True, gpu=ffn_gpu if role == "ffn" else 0)
    device = connector.spec.device
    connector.init()
    layers = crossing_layers(gate)
    results: dict[str, Any] = {"eager": [], "replays": []}
    try:
        for step, num_rows in enumerate((3, 1, MAX_ROWS)):  # eager, with the same arithmetic on CPU
            if role == "ffn":
                connector.next_step()
                _ffn_step(connector, gate)
                torch.cuda.synchronize()
                continue
            connector.publish({0: [num_rows]})
            hidden = make_hidden(0, step, 0, 0, num_rows, torch.bfloat16, device)
            expected = _reference(
                hidden.clone(), gate,
                lambda layer, step=step, num_rows=num_rows: make_logits(0, step, layer, num_rows, device))
            for layer in layers:
                logits = make_logits(0, step, layer, num_rows, device) if gate else None
                connector.send_a2f(0, hidden, logits)
                connector.recv_f2a(0, hidden)
            results["eager"].append(torch.equal(hidden, expected))
        num_rows = 4
        static_in = torch.zeros(num_rows, connector.spec.hidden_size, dtype=torch.bfloat16, device=device)
        static_logits = [make_logits(0, 9, layer, num_rows, device) for layer in layers]
        static_out = torch.zeros_like(static_in)

        def attention_step() -> None:
            hidden = static_in + 0
            for position in range(len(layers)):
                connector.send_a2f(0, hidden, static_logits[position] if gate else None)
                connector.recv_f2a(0, hidden)
            static_out.copy_(hidden)

        graph = torch.cuda.CUDAGraph()
        if role == "ffn":
            for _ in range(2 + num_replays):  # warm-up, capture, replays
                payload = connector.next_step()
                if payload.is_graph_capturing:
                    with torch.cuda.graph(graph):
                        _ffn_step(connector, gate)
                elif payload.is_graph_replaying:
                    graph.replay()
                else:
                    _ffn_step(connector, gate)
                torch.cuda.synchronize()
            return results
        connector.publish({0: [num_rows]}, is_warmup=True)
        attention_step()
        torch.cuda.synchronize()
        connector.publish({0: [num_rows]}, is_graph_capturing=True)
        with torch.cuda.graph(graph):
            attention_step()
        for replay in range(num_replays):
            fresh = make_hidden(0, 20 + replay, 0, 0, num_rows, torch.bfloat16, device)
            expected = _reference(fresh.clone(), gate, lambda layer: make_logits(0, 9, layer, num_rows, device))
            static_in.copy_(fresh)
            connector.publish({0: [num_rows]}, is_graph_replaying=True)
            graph.replay()
            results["replays"].append(torch.equal(static_out, expected))
        return results
    finally:
        torch.cuda.synchronize()
        connector.close()


def peer_dies_mid_step(role: str, port: int, peer_timeout_s: float = 1.0) -> dict[str, Any]:
    """The FFN takes layer 1 of step 1 and exits; the attention's pending device wait must be released
    by the abort, and its next call must raise the sticky AFDPeerLostError, within the peer timeout."""
    connector = ipc_connector(role, port, gate=False, peer_timeout_s=peer_timeout_s)
    device = connector.spec.device
    connector.init()
    if role == "ffn":
        for step in range(2):
            connector.next_step()
            for layer in crossing_layers(False):
                batch = connector.recv_a2f(0)
                if step == 1 and layer == 1:
                    torch.cuda.synchronize()  # the request is in: die holding it
                    os._exit(3)
                connector.send_f2a(0, ffn_compute(batch.hidden_states, None, layer))
            torch.cuda.synchronize()
        return {}
    blocked_at = None
    try:
        for step in range(2):
            connector.publish({0: [2]})
            for layer in crossing_layers(False):
                hidden = make_hidden(0, step, layer, 0, 2, torch.bfloat16, device)
                connector.send_a2f(0, hidden)
                connector.recv_f2a(0, hidden)
                blocked_at = time.monotonic()
                torch.cuda.synchronize()  # an eager model's host sync: blocks on the device wait
                connector.check_failed()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        elapsed = time.monotonic() - blocked_at if blocked_at else None
        try:
            connector.send_a2f(0, torch.zeros(2, connector.spec.hidden_size, dtype=torch.bfloat16, device=device))
            sticky = None
        except Exception as again:  # noqa: BLE001
            sticky = type(again).__name__
        connector.close()
        return {"error": f"{type(exc).__name__}: {exc}", "elapsed_s": elapsed, "sticky": sticky}
    connector.close()
    return {"error": None}


def driver_on_this_gpu() -> dict[str, Any]:
    """The real driver's view of cuda:0 and a flag page in this machine's /dev/shm."""
    from vllm_afd.wire.transports.cuda_driver import WAIT, WRITE, CudaDriver, Op
    from vllm_afd.wire.transports.shm import FlagBlock
    from vllm_afd.wire.transports.slots import ABORT

    driver = CudaDriver(torch.device("cuda", 0))
    driver.bind()
    block = FlagBlock.create(64)
    try:
        pointer = driver.host_register(block.address, block.nbytes)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            driver.enqueue([Op(WRITE, pointer + 4, value=7), Op(WAIT, pointer, value=1),
                            Op(WRITE, pointer + 8, value=9)],
                           driver.current_stream())
        time.sleep(0.2)
        before = (block.read(1), block.read(2))  # the write ran; the one behind the wait did not
        block.write(0, ABORT)  # a host store releases the device wait
        stream.synchronize()
        after = block.read(2)
        driver.host_unregister(block.address)
        return {"problem": driver.missing_capability(), "identity": driver.identity(), "before": before,
                "after": after, "same_gpu_peer": driver.peer_problem(driver.identity()["gpu"]), "pointer": pointer}
    finally:
        block.unlink()
        block.close()
