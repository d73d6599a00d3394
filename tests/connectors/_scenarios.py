"""Rank bodies for the multi-process connector tests (top-level, so ``spawn`` can import them).

The data is deterministic small integers, exact in bf16: attention rank j sends ``hidden(j, step,
layer, stage)``; the FFN answers ``2 * hidden + layer (+ row sums of the router logits)``, so every
attention rank can check its own result bit for bit, which proves the FFN split the fan-in right.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from tests.connectors._harness import HIDDEN_SIZE, NUM_EXPERTS, make_connector, make_placement, make_spec

from vllm_afd.wire.attention_end import AttentionConnector
from vllm_afd.wire.ffn_end import FFNConnector
from vllm_afd.wire.messages import RoutingSpec, control_header
from vllm_afd.wire.placement import CONTROL

LAYER_KINDS = "DMMM"


def crossing_layers(gate_on_attention: bool) -> list[int]:
    return [i for i, kind in enumerate(LAYER_KINDS) if kind == "M" or not gate_on_attention]


def step_counts(step: int, stage: int, num_dp: int) -> list[int]:
    """Published tokens per attention DP rank of one stage; zeros (idle ranks) included on purpose."""
    return [(step * 5 + rank * 3 + stage) % 4 for rank in range(num_dp)]


def make_hidden(rank: int, step: int, layer: int, stage: int, num_rows: int, dtype: torch.dtype,
                device: torch.device = torch.device("cpu")) -> torch.Tensor:
    values = (torch.arange(num_rows * HIDDEN_SIZE) + rank * 7 + step * 3 + layer * 5 + stage) % 13 - 6
    return values.reshape(num_rows, HIDDEN_SIZE).to(device=device, dtype=dtype)


def make_logits(rank: int, step: int, layer: int, num_rows: int,
                device: torch.device = torch.device("cpu")) -> torch.Tensor:
    values = (torch.arange(num_rows * NUM_EXPERTS) + rank + step + layer) % 5
    return values.reshape(num_rows, NUM_EXPERTS).to(device=device, dtype=torch.float32)


def ffn_compute(hidden: torch.Tensor, logits: torch.Tensor | None, layer: int) -> torch.Tensor:
    out = hidden * 2 + layer
    if logits is not None:
        out = out + logits.sum(dim=-1, keepdim=True).to(hidden.dtype)
    return out


def exchange(role: str, rank: int, num_attention: int, num_ffn: int, port: int, dtype_name: str,
             num_steps: int, gate: bool = False, num_stages: int = 1, probe_errors: bool = False,
             attention_tp: int = 1, device_name: str = "cpu") -> dict[str, Any]:
    """One rank of a full run: ``num_steps`` payloads, each followed by every crossing layer's exchanges."""
    dtype, device = getattr(torch, dtype_name), torch.device(device_name)
    layers = crossing_layers(gate)
    placement = make_placement(role, rank, num_attention, num_ffn, attention_tp=attention_tp)
    spec = make_spec(port, dtype=dtype, device=device, exchanges_per_stage=len(layers),
                     router_logits_width=NUM_EXPERTS if gate else None, num_stages=num_stages)
    connector = make_connector(spec, placement)
    num_dp = num_attention // attention_tp
    started = time.monotonic()
    connector.init()
    connector.init()  # idempotent
    errors: list[str] = []
    payloads: list[dict[str, Any]] = []
    for step in range(num_steps):
        counts_dp = {stage: step_counts(step, stage, num_dp) for stage in range(num_stages)}
        if role == "attention":
            payload = connector.publish(counts_dp, is_profile=step == 0, is_warmup=step == 1)
        else:
            payload = connector.next_step()
        payloads.append({"step_seq": payload.step_seq, "is_profile": payload.is_profile,
                         "is_warmup": payload.is_warmup,
                         "stages": {stage: list(counts) for stage, counts in payload.counts.items()}})
        for layer in layers:
            for stage in range(num_stages):
                if role == "attention":
                    count = counts_dp[stage][rank // attention_tp]
                    probe = probe_errors and step == 0 and not errors
                    _attention_exchange(connector, rank, step, layer, stage, count, dtype, gate, probe, errors, device)
                else:
                    _ffn_exchange(connector, layer, stage, gate)
        if role == "ffn":
            connector.wait_sends()
    connector.close()
    connector.close()
    return {"elapsed_s": time.monotonic() - started, "payloads": payloads, "errors": errors,
            "initialized_after_close": connector.is_initialized}


def _attention_exchange(connector: AttentionConnector, rank: int, step: int, layer: int, stage: int, count: int,
                        dtype: torch.dtype, gate: bool, probe: bool, errors: list[str], device: torch.device) -> None:
    num_rows = max(1, count)
    hidden = make_hidden(rank, step, layer, stage, num_rows, dtype, device)
    logits = make_logits(rank, step, layer, num_rows, device) if gate else None
    if probe:  # wrong rows must raise before anything reaches the wire
        attempts = [(make_hidden(rank, step, layer, stage, num_rows + 1, dtype, device), None)]
        if gate:
            attempts.append((hidden, make_logits(rank, step, layer, num_rows + 1, device)))
        for bad_hidden, bad_logits in attempts:
            try:
                connector.send_a2f(stage, bad_hidden, bad_logits)
            except ValueError as exc:
                errors.append(str(exc))
    connector.send_a2f(stage, hidden, logits)
    expected = ffn_compute(hidden, logits, layer)
    out = connector.recv_f2a(stage, hidden)
    assert out.data_ptr() == hidden.data_ptr(), "the result must land in the tensor just sent"
    assert out.device == device, f"result on {out.device}, expected {device}"
    assert torch.equal(out, expected), f"rank {rank} step {step} layer {layer}: wrong FFN result"


def _ffn_exchange(connector: FFNConnector, layer: int, stage: int, gate: bool) -> None:
    routing = RoutingSpec(NUM_EXPERTS, torch.float32) if gate else None
    batch = connector.recv_a2f(stage, routing)
    assert (batch.router_logits is not None) == gate
    assert batch.hidden_states.shape[0] == sum(batch.peer_rows)
    connector.send_f2a(stage, ffn_compute(batch.hidden_states, batch.router_logits, layer))


def pingpong(role: str, rank: int, num_attention: int, num_ffn: int, port: int, num_stages: int,
             num_steps: int) -> dict[str, Any]:
    """One rank of a run whose attention interleaves its stages as the stage baton does
    (docs/pingpong.md#5): per step it sends every stage of the first layer, then, per layer and stage,
    receives that stage's previous layer and sends its next; the FFN serves layer-major, stage-minor
    and waits its sends at the end of the step. Step s publishes s % num_stages + 1 stages (fewer
    than agreed is legal)."""
    dtype, layers = torch.bfloat16, crossing_layers(False)
    placement = make_placement(role, rank, num_attention, num_ffn)
    spec = make_spec(port, exchanges_per_stage=len(layers), num_stages=num_stages)
    connector = make_connector(spec, placement)
    connector.init()
    stage_counts = []
    for step in range(num_steps):
        stages = range(step % num_stages + 1)
        if role == "ffn":
            payload = connector.next_step()
            for layer in layers:
                for stage in payload.stages:
                    _ffn_exchange(connector, layer, stage, False)
            connector.wait_sends()
            stage_counts.append(len(payload.stages))
            continue
        counts_dp = {stage: step_counts(step, stage, num_attention) for stage in stages}
        connector.publish(counts_dp)
        sent: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def send(layer: int, stage: int, step: int = step, counts_dp: dict = counts_dp, sent: dict = sent) -> None:
            hidden = make_hidden(rank, step, layer, stage, max(1, counts_dp[stage][rank]), dtype)
            sent[stage] = (hidden, ffn_compute(hidden, None, layer))
            connector.send_a2f(stage, hidden)

        def receive(stage: int, step: int = step, sent: dict = sent) -> None:
            hidden, expected = sent.pop(stage)
            assert torch.equal(connector.recv_f2a(stage, hidden), expected), f"step {step} stage {stage}: wrong result"

        for stage in stages:
            send(layers[0], stage)
        for layer in layers[1:]:
            for stage in stages:
                receive(stage)
                send(layer, stage)
        for stage in stages:
            receive(stage)
        stage_counts.append(len(stages))
    connector.close()
    return {"stage_counts": stage_counts}


def exchange_then_die(role: str, rank: int, port: int, peer_timeout_s: float) -> dict[str, Any]:
    """1A1F: the FFN serves one step, then exits mid-step (after receiving); the attention times its error."""
    connector = make_connector(make_spec(port, peer_timeout_s=peer_timeout_s), make_placement(role, rank, 1, 1))
    connector.init()
    if role == "ffn":
        for step in range(2):
            connector.next_step()
            for layer in range(4):
                batch = connector.recv_a2f(0)
                if step == 1 and layer == 1:
                    os._exit(3)  # dies holding the attention's layer-1 request
                connector.send_f2a(0, ffn_compute(batch.hidden_states, None, layer))
        return {}
    failed_at = None
    try:
        for step in range(2):
            connector.publish({0: [3]})
            for layer in range(4):
                hidden = make_hidden(rank, step, layer, 0, 3, torch.bfloat16)
                connector.send_a2f(0, hidden)
                failed_at = time.monotonic()
                connector.recv_f2a(0, hidden)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        first = f"{type(exc).__name__}: {exc}"
        elapsed = time.monotonic() - failed_at if failed_at else None
        try:
            connector.check_failed()
            sticky = None
        except Exception as again:  # noqa: BLE001
            sticky = type(again).__name__
        connector.close()
        return {"error": first, "elapsed_s": elapsed, "sticky": sticky}
    return {"error": None}


def reforming_pair(role: str, generation: int, port: int, marker: str) -> dict[str, Any]:
    """1A1F re-forming (docs/connection.md#re-forming): attention generation 1 serves a step and dies
    mid-step; generation 2 starts while generation 1 still holds its claim and pairs with the same FFN.

    Each attention step is one payload of 3 rows and 4 exact exchanges; the FFN re-forms on the loss.
    """
    from vllm_afd.wire.errors import AFDPeerLostError

    spec = make_spec(port, peer_timeout_s=2.0)
    connector = make_connector(spec, make_placement(role, 0, 1, 1), reformable=role == "ffn")
    if role == "ffn":
        connector.init()
        served, lost = [], []
        while len(served) < 3:  # generation 1's step 0, then generation 2's steps 0 and 1
            try:
                payload = connector.next_step()
                for layer in range(4):
                    _ffn_exchange(connector, layer, 0, False)
                served.append(payload.step_seq)
            except AFDPeerLostError as exc:
                lost.append(str(exc))
                started = time.monotonic()
                connector.reform(20.0)
                reform_s = time.monotonic() - started
        connector.close()
        return {"served": served, "lost": lost, "reformations": connector.reformations, "reform_s": reform_s}
    if generation == 2:
        while not os.path.exists(marker):  # generation 1 is serving: its claim is held
            time.sleep(0.05)
    connector.init()
    for step in range(2):
        payload = connector.publish({0: [3]})
        for layer in range(4):
            if generation == 1 and step == 1:
                open(marker, "w").close()
                time.sleep(1.0)  # generation 2 is waiting on the held claim now
                os._exit(5)  # dies mid-step, before its first send
            _attention_exchange(connector, 0, step, layer, 0, 3, torch.bfloat16, False, False, [], spec.device)
    connector.close()
    return {"step_seqs": [0, payload.step_seq]}


def _report_and_exit(path: str, code: int) -> Any:
    """A termination hook for tests: write the cause where the test can read it, then exit."""
    def terminate(cause: BaseException) -> None:
        with open(path, "w") as out:
            out.write(f"{type(cause).__name__}: {cause}")
        os._exit(code)
    return terminate


def hung_ffn(role: str, rank: int, port: int, report_path: str) -> dict[str, Any]:
    """1A1F after start-up: the FFN takes a layer and sits on it; the attention's step must time out."""
    # NOTE: the FFN's long timeouts keep its own watchdog from aborting (which would close the pairs and
    # unblock the attention's receive); the receive must stay blocked for the termination fallback.
    timeout_s = 1.0 if role == "attention" else 30.0
    spec = make_spec(port, step_timeout_s=timeout_s, peer_timeout_s=timeout_s)
    terminate = _report_and_exit(report_path, 17) if role == "attention" else None
    connector = make_connector(spec, make_placement(role, rank, 1, 1), terminate=terminate)
    connector.init()
    if role == "ffn":
        connector.next_step()
        connector.recv_a2f(0)
        time.sleep(4.5)  # stuck, but alive and heartbeating (the attention goes down at ~3 s)
        connector.close()
        return {}
    connector.mark_startup_done()
    connector.publish({0: [2]})
    hidden = make_hidden(rank, 0, 0, 0, 2, torch.bfloat16)
    connector.send_a2f(0, hidden)
    connector.recv_f2a(0, hidden)  # blocks: gloo cannot be interrupted, so termination must follow
    return {"unexpected": "the receive returned"}


def idle_attention(role: str, rank: int, port: int, report_path: str) -> dict[str, Any]:
    """1A1F: FFN rank 0 (the store host) dies while the attention idles; the attention must go down."""
    terminate = _report_and_exit(report_path, 18) if role == "attention" else None
    connector = make_connector(make_spec(port, peer_timeout_s=1.0), make_placement(role, rank, 1, 1),
                               terminate=terminate)
    connector.init()
    if role == "ffn":
        time.sleep(0.5)
        os._exit(3)
    time.sleep(10.0)  # idle: nobody calls check_failed()
    return {"unexpected": "still alive"}


def garbage_payload(role: str, rank: int, port: int) -> dict[str, Any]:
    """The attention frames bytes that are not a payload; the FFN must refuse them."""
    connector = make_connector(make_spec(port), make_placement(role, rank, 1, 1))
    connector.init()
    try:
        if role == "attention":
            body = torch.frombuffer(bytearray(b"\x80not json"), dtype=torch.uint8)
            header = control_header(body.numpy().tobytes())  # a well-framed body that is not a payload
            connector.transport.send(CONTROL, torch.tensor(header, dtype=torch.int64), 0)
            connector.transport.send(CONTROL, body, 0)
            return {}
        try:
            connector.next_step()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {"error": None}
    finally:
        connector.close()


def nccl_on_one_gpu(role: str, rank: int, port: int) -> str:
    """1A1F with both ranks on cuda:0 over NCCL: both must refuse, naming the fix."""
    from vllm_afd.connect import TRANSPORTS

    device = torch.device("cuda", 0)
    spec = make_spec(port, device=device, rendezvous_timeout_s=30.0, name="P2pNcclAFDConnector")
    connector = make_connector(spec, make_placement(role, rank, 1, 1), transport=TRANSPORTS[spec.name](device))
    try:
        connector.init()
    except RuntimeError as exc:
        return str(exc)
    finally:
        connector.close()
    return "initialised"
