"""A lying peer never aborts the receiving process (docs/security.md#what-is-validated).

The FFN runs in a process of its own over real gloo; a paired attention process sends what an honest one never
would: a count above its own ``max_rows``, a control body whose CRC fails, a body shorter than its header says
(gloo accepts a shorter message silently and leaves the rest of the buffer as it was), and, in integrity mode, a
data message with fewer rows than published. The FFN must end each case with the Python error of a lost peer and
exit cleanly; a native abort (gloo's ``std::terminate``) would show as the process's exit code instead.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.connectors._harness import WorkerPool, free_port, make_connector, make_placement, make_spec

from vllm_afd.wire.errors import AFDPeerLostError, AFDPeerProtocolError
from vllm_afd.wire.integrity import seal_words
from vllm_afd.wire.messages import ControlPayload, control_header
from vllm_afd.wire.placement import A2F, CONTROL, F2A

SCENARIOS = {
    "count above max_rows": "publishes 9 rows in stage 0; the attention's handshake announced max_rows=8",
    "control crc": "fails its CRC-32",
    "short control body": "fails its CRC-32",
    "short data message": "fails its integrity seal: rows 1 (expected 2); nbytes 128 (expected 256); crc32",
    # Longer than announced: the gloo transport posts control receives at the channel's largest message, so the
    # surplus is read and ignored (the announced bytes pass their CRC) instead of ending the process.
    "long control body": "accepted",
}


def _spec(port: int, scenario: str):
    return make_spec(port, integrity=scenario == "short data message", exchanges_per_stage=1)


def ffn_receiver(port: int, scenario: str) -> str:
    """One FFN rank: pair, take one step; the error it ends with, as text."""
    spec = _spec(port, scenario)
    ffn = make_connector(spec, make_placement("ffn", 0, 1, 1), integrity=spec.integrity)
    ffn.init()
    try:
        ffn.next_step()
        ffn.recv_a2f(0)
        return "accepted"
    except AFDPeerProtocolError as exc:
        assert isinstance(exc, AFDPeerLostError)
        return f"AFDPeerProtocolError: {exc}"
    finally:
        ffn.close()


def _send_control(transport, body: bytes, header: list[int]) -> None:
    transport.send(CONTROL, torch.tensor(header, dtype=torch.int64), 0)
    transport.send(CONTROL, torch.frombuffer(bytearray(body), dtype=torch.uint8), 0)


def lying_attention(port: int, scenario: str) -> str:
    """One attention rank that pairs honestly (max_rows 8), then lies; returns once the FFN dropped the pairing."""
    spec = _spec(port, scenario)
    attention = make_connector(spec, make_placement("attention", 0, 1, 1), integrity=spec.integrity, max_rows=8)
    attention.init()
    transport = attention.transport
    try:
        if scenario == "count above max_rows":
            body = ControlPayload({0: (9,)}).encode()
            _send_control(transport, body, control_header(body))
        elif scenario == "control crc":
            body = ControlPayload({0: (2,)}).encode()
            _send_control(transport, body, [len(body), zlib.crc32(body) ^ 0xFF])
        elif scenario == "short control body":
            body = ControlPayload({0: (2,)}).encode()
            _send_control(transport, body[:-4], control_header(body))
        elif scenario == "long control body":
            body = ControlPayload({0: (2,)}).encode()
            _send_control(transport, body + b" " * 100, control_header(body))
            transport.isend(A2F, torch.randn(2, 64).to(torch.bfloat16), 0).wait()
        else:
            attention.publish({0: [2]})
            one_row = torch.randn(1, 64).to(torch.bfloat16)
            transport.isend(A2F, one_row, 0).wait()
            seal = torch.tensor(seal_words(0, 0, 0, (one_row,)), dtype=torch.int64)
            transport.isend(A2F, seal, 0).wait()
        # NOTE: gate on the FFN's reaction, not on time: its dropped pairing fails this receive.
        transport.recv(F2A, torch.empty(2, 64, dtype=torch.bfloat16), 0)
        return "the FFN answered"
    except RuntimeError as exc:
        return f"dropped: {exc}"
    finally:
        attention.close()


@pytest.fixture(scope="module")
def pool():
    workers = WorkerPool(2)
    yield workers
    workers.close()


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_the_ffn_process_ends_a_lying_peer_with_a_python_error_not_an_abort(pool, scenario):
    port = free_port()

    (ffn_status, ffn_result), (attention_status, _) = pool.run(
        rank_body, [(port, scenario, "ffn"), (port, scenario, "attention")], timeout_s=120.0)

    assert ffn_status == "ok", (ffn_status, ffn_result)  # "exit" with -6 would be gloo's abort
    if SCENARIOS[scenario] == "accepted":
        assert ffn_result == "accepted"
    else:
        assert ffn_result.startswith("AFDPeerProtocolError: ") and SCENARIOS[scenario] in ffn_result, ffn_result
    assert attention_status == "ok"


def rank_body(port: int, scenario: str, role: str) -> str:
    """The pool's target: the FFN receiver or the lying attention."""
    return (ffn_receiver if role == "ffn" else lying_attention)(port, scenario)
