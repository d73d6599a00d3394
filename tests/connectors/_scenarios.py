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
from _harness import HIDDEN_SIZE, NUM_EXPERTS, make_protocol, make_settings

from vllm_afd.connectors.metadata import AFDExpertRoutingSpec, AFDTransferContext, AFDTransferMetadata

LAYER_KINDS = "DMMM"


def crossing_layers(gate_on_attention: bool) -> list[int]:
    return [i for i, kind in enumerate(LAYER_KINDS) if kind == "M" or not gate_on_attention]


def step_counts(step: int, stage: int, num_attention: int) -> list[int]:
    """Published DP counts of one stage; zeros (idle ranks) included on purpose."""
    return [(step * 5 + rank * 3 + stage) % 4 for rank in range(num_attention)]


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
    dtype = getattr(torch, dtype_name)
    device = torch.device(device_name)
    layers = crossing_layers(gate)
    num_dp = num_attention // attention_tp
    layout = {"dp_size": num_dp, "tp_size": attention_tp} if role == "attention" else {}
    settings = make_settings(role, rank, num_attention, num_ffn, port, dtype=dtype, compute_gate_on_attention=gate,
                             exchanges_per_stage=len(layers), dp_size=num_dp if role == "attention" else num_ffn,
                             device=device)
    protocol = make_protocol(settings, **layout)
    started = time.monotonic()
    protocol.init()
    protocol.init()  # idempotent
    errors: list[str] = []
    payloads: list[dict[str, Any]] = []
    for step in range(num_steps):
        stages = {stage: step_counts(step, stage, num_dp) for stage in range(num_stages)}
        if role == "attention":
            protocol.send_dp_metadata(stages, is_profile=step == 0, is_warmup=step == 1)
        else:
            payload = protocol.recv_dp_metadata_list()
            protocol.update_state_from_dp_metadata(payload)
            payloads.append({"step_seq": payload.step_seq, "is_profile": payload.is_profile,
                             "is_warmup": payload.is_warmup,
                             "stages": {k: list(v.num_tokens_across_dp_cpu) for k, v in payload.dp_metadata_list.items()}})
        for layer in layers:
            for stage in range(num_stages):
                if role == "attention":
                    _attention_exchange(protocol, rank, step, layer, stage, stages[stage][rank // attention_tp], dtype, gate,
                                        probe_errors and step == 0 and not errors, errors, device)
                else:
                    _ffn_exchange(protocol, layer, stage, gate)
    protocol.close()
    protocol.close()
    return {"elapsed_s": time.monotonic() - started, "payloads": payloads, "errors": errors,
            "initialized_after_close": protocol.is_initialized}


def _attention_exchange(protocol: Any, rank: int, step: int, layer: int, stage: int, count: int,
                        dtype: torch.dtype, gate: bool, probe: bool, errors: list[str], device: torch.device) -> None:
    num_rows = max(1, count)
    hidden = make_hidden(rank, step, layer, stage, num_rows, dtype, device)
    logits = make_logits(rank, step, layer, num_rows, device) if gate else None
    context = AFDTransferContext(AFDTransferMetadata.create_attention_metadata(layer, stage, num_rows))
    if probe:  # wrong rows must raise before anything reaches the wire
        wrong = make_hidden(rank, step, layer, stage, num_rows + 1, dtype, device)
        attempts = [(wrong, AFDTransferContext(AFDTransferMetadata.create_attention_metadata(layer, stage, num_rows + 1)),
                     None)]
        if gate:
            attempts.append((hidden, context, make_logits(rank, step, layer, num_rows + 1, device)))
        for bad_hidden, bad_context, bad_logits in attempts:
            try:
                protocol.send_attn_output(bad_hidden, bad_context, bad_logits)
            except ValueError as exc:
                errors.append(str(exc))
    protocol.send_attn_output(hidden, context, logits)
    expected = ffn_compute(hidden, logits, layer)
    out = protocol.recv_ffn_output(hidden, stage)
    assert out.data_ptr() == hidden.data_ptr(), "the result must land in ref_tensor"
    assert out.device == device, f"result on {out.device}, expected {device}"
    assert torch.equal(out, expected), f"rank {rank} step {step} layer {layer}: wrong FFN result"


def _ffn_exchange(protocol: Any, layer: int, stage: int, gate: bool) -> None:
    spec = AFDExpertRoutingSpec(NUM_EXPERTS, torch.float32) if gate else None
    received = protocol.recv_attn_output(stage, spec)
    assert (received.router_logits is not None) == gate
    received.context.metadata.layer_idx = layer
    protocol.send_ffn_output(ffn_compute(received.hidden_states, received.router_logits, layer), received.context)


def exchange_then_die(role: str, rank: int, port: int, peer_timeout_s: float) -> dict[str, Any]:
    """1A1F: the FFN serves one step, then exits mid-step (after receiving); the attention times its error."""
    settings = make_settings(role, rank, 1, 1, port, peer_timeout_s=peer_timeout_s, exchanges_per_stage=4)
    protocol = make_protocol(settings)
    protocol.init()
    if role == "ffn":
        for step in range(2):
            payload = protocol.recv_dp_metadata_list()
            protocol.update_state_from_dp_metadata(payload)
            for layer in range(4):
                received = protocol.recv_attn_output(0)
                if step == 1 and layer == 1:
                    os._exit(3)  # dies holding the attention's layer-1 request
                protocol.send_ffn_output(ffn_compute(received.hidden_states, None, layer), received.context)
        return {}
    failed_at = None
    try:
        for step in range(2):
            protocol.send_dp_metadata({0: [3]})
            for layer in range(4):
                hidden = make_hidden(rank, step, layer, 0, 3, torch.bfloat16)
                context = AFDTransferContext(AFDTransferMetadata.create_attention_metadata(layer, 0, 3))
                protocol.send_attn_output(hidden, context)
                failed_at = time.monotonic()
                protocol.recv_ffn_output(hidden)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        first = f"{type(exc).__name__}: {exc}"
        elapsed = time.monotonic() - failed_at if failed_at else None
        try:
            protocol.check_failed()
            sticky = None
        except Exception as again:  # noqa: BLE001
            sticky = type(again).__name__
        protocol.close()
        return {"error": first, "elapsed_s": elapsed, "sticky": sticky}
    return {"error": None}


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
    settings = make_settings(role, rank, 1, 1, port, step_timeout_s=timeout_s, peer_timeout_s=timeout_s)
    protocol = make_protocol(settings, terminate=_report_and_exit(report_path, 17) if role == "attention" else None)
    protocol.init()
    if role == "ffn":
        protocol.update_state_from_dp_metadata(protocol.recv_dp_metadata_list())
        protocol.recv_attn_output(0)
        time.sleep(4.5)  # stuck, but alive and heartbeating (the attention goes down at ~3 s)
        protocol.close()
        return {}
    protocol.mark_startup_done()
    protocol.send_dp_metadata({0: [2]})
    hidden = make_hidden(rank, 0, 0, 0, 2, torch.bfloat16)
    protocol.send_attn_output(hidden, AFDTransferContext(AFDTransferMetadata.create_attention_metadata(0, 0, 2)))
    protocol.recv_ffn_output(hidden)  # blocks: gloo cannot be interrupted, so termination must follow
    return {"unexpected": "the receive returned"}


def idle_attention(role: str, rank: int, port: int, report_path: str) -> dict[str, Any]:
    """1A1F: FFN rank 0 (the store host) dies while the attention idles; the attention must go down."""
    settings = make_settings(role, rank, 1, 1, port, peer_timeout_s=1.0)
    protocol = make_protocol(settings, terminate=_report_and_exit(report_path, 18) if role == "attention" else None)
    protocol.init()
    if role == "ffn":
        time.sleep(0.5)
        os._exit(3)
    time.sleep(10.0)  # idle: nobody calls check_failed()
    return {"unexpected": "still alive"}


def garbage_payload(role: str, rank: int, port: int) -> dict[str, Any]:
    """The attention frames bytes that are not a payload; the FFN must refuse them."""
    from vllm_afd.connectors.channels import CONTROL

    protocol = make_protocol(make_settings(role, rank, 1, 1, port))
    protocol.init()
    try:
        if role == "attention":
            body = torch.frombuffer(bytearray(b"\x80not json"), dtype=torch.uint8)
            protocol.transport.send(CONTROL, torch.tensor([body.numel()], dtype=torch.int64), 0)
            protocol.transport.send(CONTROL, body, 0)
            return {}
        try:
            protocol.recv_dp_metadata_list()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {"error": None}
    finally:
        protocol.close()


def nccl_on_one_gpu(role: str, rank: int, port: int) -> str:
    """1A1F with both ranks on cuda:0 over NCCL: both must refuse, naming the fix."""
    from vllm_afd.connectors.nccl import NcclTransport

    settings = make_settings(role, rank, 1, 1, port, device=torch.device("cuda", 0), rendezvous_timeout_s=30.0,
                             connector_name="P2pNcclAFDConnector")
    protocol = make_protocol(settings, transport_cls=NcclTransport)
    try:
        protocol.init()
    except RuntimeError as exc:
        return str(exc)
    finally:
        protocol.close()
    return "initialised"
