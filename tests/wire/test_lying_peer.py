"""A lying peer never aborts the receiving process (docs/security.md#what-is-validated).

The receiver runs in a process of its own over real gloo; its paired peer sends what an honest one never would.
To the FFN, a lying attention sends a count above its own ``max_rows``, a control body whose CRC fails, a body
shorter than its header says (gloo accepts a shorter message silently and leaves the rest of the buffer as it
was), a longer one, and data messages with fewer or more rows than published. To the attention, a lying FFN
returns more rows than published. The receiver must read past the surplus (the published rows intact), or end
with the Python error of a lost peer, and exit cleanly; a native abort (gloo's ``std::terminate``) would show as
the process's exit code instead. One abort is expected: a data message above the agreed ``max_rows``, the limit
docs/protocol.md#bounds states.
"""

from __future__ import annotations

import signal
import zlib

import pytest
import torch

from tests.connectors._harness import WorkerPool, free_port, make_connector, make_placement, make_spec

from vllm_afd.wire.errors import AFDPeerLostError, AFDPeerProtocolError
from vllm_afd.wire.integrity import seal_words
from vllm_afd.wire.messages import ControlPayload, control_header
from vllm_afd.wire.placement import A2F, CONTROL, F2A

ACCEPTED = "accepted"
MAX_ROWS = 8  # the attention's handshake announces it: every data message is posted at this many rows
# scenario -> (the receiving role, integrity mode, what the receiver ends with)
SCENARIOS = {
    "count above max_rows": ("ffn", False, "publishes 9 rows in stage 0; the attention's handshake announced "
                                           "max_rows=8"),
    "control crc": ("ffn", False, "fails its CRC-32"),
    "short control body": ("ffn", False, "fails its CRC-32"),
    "short data message": ("ffn", True, "fails its integrity seal: rows 1 (expected 2); nbytes 128 (expected 256); "
                                        "crc32"),
    # Longer than announced: the gloo transport posts control receives at the channel's largest message, so the
    # surplus is read and ignored (the announced bytes pass their CRC) instead of ending the process.
    "long control body": ("ffn", False, ACCEPTED),
    # More rows than published, within max_rows: data receives are posted at max_rows rows; the published rows are
    # used, the surplus ignored, and the next exchange reads as usual. In integrity mode the seal (over the five
    # rows sent) tells the FFN, which drops the pairing (a lost peer: the FFN loop re-forms).
    "long a2f message": ("ffn", False, ACCEPTED),
    "long a2f message, integrity": ("ffn", True, "fails its integrity seal: rows 5 (expected 2); nbytes 640 "
                                                 "(expected 256); crc32"),
    # The same from a lying FFN to the attention.
    "long f2a message": ("attention", False, ACCEPTED),
    "long f2a message, integrity": ("attention", True, "fails its integrity seal: rows 5 (expected 2); nbytes 640 "
                                                       "(expected 256); crc32"),
    # Above max_rows: more than any receive is posted for, so gloo still ends the FFN (exit -SIGABRT).
    "a2f message above max_rows": ("ffn", False, None),
}


def rows(num_rows: int) -> torch.Tensor:
    """``num_rows`` distinct, exactly representable bf16 rows: a message whose head can be told from its surplus."""
    return (torch.arange(num_rows * 64).reshape(num_rows, 64) % 251).to(torch.bfloat16)


def _pair(port: int, scenario: str, role: str):
    victim, integrity, _ = SCENARIOS[scenario]
    spec = make_spec(port, integrity=integrity, exchanges_per_stage=1)
    extra = {"max_rows": MAX_ROWS} if role == "attention" else {}
    connector = make_connector(spec, make_placement(role, 0, 1, 1), integrity=integrity, **extra)
    connector.init()
    return connector


def _checked(received: torch.Tensor, num_rows: int) -> str:
    return ACCEPTED if torch.equal(received, rows(num_rows)) else f"wrong rows: {received.float().tolist()}"


def ffn_receiver(port: int, scenario: str) -> str:
    """One FFN rank: pair, take a step (two for a long a2f message: the second is honest); how it ends, as text."""
    ffn = _pair(port, scenario, "ffn")
    try:
        ffn.next_step()
        batch = ffn.recv_a2f(0)
        if not scenario.startswith("long a2f"):
            return ACCEPTED
        outcome = _checked(batch.hidden_states, 2)
        ffn.send_f2a(0, batch.hidden_states)
        ffn.wait_sends()
        ffn.next_step()
        return outcome if outcome != ACCEPTED else _checked(ffn.recv_a2f(0).hidden_states, 3)
    except AFDPeerProtocolError as exc:
        assert isinstance(exc, AFDPeerLostError)
        return f"AFDPeerProtocolError: {exc}"
    finally:
        ffn.close()


def attention_receiver(port: int, scenario: str) -> str:
    """One attention rank: pair, send one step's rows, receive the FFN's answer; how it ends, as text."""
    attention = _pair(port, scenario, "attention")
    try:
        attention.publish({0: [2]})
        attention.send_a2f(0, rows(2))
        return _checked(attention.recv_f2a(0, torch.zeros(2, 64, dtype=torch.bfloat16)), 2)
    except AFDPeerProtocolError as exc:
        assert isinstance(exc, AFDPeerLostError)
        return f"AFDPeerProtocolError: {exc}"
    finally:
        attention.close()


def _send_control(transport, body: bytes, header: list[int]) -> None:
    transport.send(CONTROL, torch.tensor(header, dtype=torch.int64), 0)
    transport.send(CONTROL, torch.frombuffer(bytearray(body), dtype=torch.uint8), 0)


def _send_sealed(connector, channel: str, dst: int, data: torch.Tensor) -> None:
    """``data`` as one message on ``channel``, then (integrity mode) its honest seal as exchange 0 of stage 0."""
    connector.transport.isend(channel, data, dst).wait()
    if connector.spec.integrity:
        seal = torch.tensor(seal_words(connector.steps.payload.step_seq, 0, 0, (data,)), dtype=torch.int64)
        connector.transport.isend(channel, seal, dst).wait()


def lying_attention(port: int, scenario: str) -> str:
    """One attention rank that pairs honestly (max_rows 8), then lies; returns once the FFN dropped the pairing."""
    attention = _pair(port, scenario, "attention")
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
        elif scenario == "short data message":
            attention.publish({0: [2]})
            _send_sealed(attention, A2F, 0, rows(1))
        else:  # more rows than the 2 published: 5 (within max_rows) or max_rows + 1
            attention.publish({0: [2]})
            _send_sealed(attention, A2F, 0, rows(5 if scenario.startswith("long") else MAX_ROWS + 1))
            if scenario == "long a2f message":
                attention.recv_f2a(0, torch.empty(2, 64, dtype=torch.bfloat16))
                attention.publish({0: [3]})  # an honest step after the lie
                attention.send_a2f(0, rows(3))
        # NOTE: gate on the FFN's reaction, not on time: its dropped pairing fails this receive.
        transport.recv(F2A, torch.empty(2, 64, dtype=torch.bfloat16), 0)
        return "the FFN answered"
    except RuntimeError as exc:
        return f"dropped: {exc}"
    finally:
        attention.close()


def lying_ffn(port: int, scenario: str) -> str:
    """One FFN rank that takes the step honestly, then returns 5 rows for the 2 published; returns once the
    attention closed."""
    ffn = _pair(port, scenario, "ffn")
    try:
        ffn.next_step()
        ffn.recv_a2f(0)
        _send_sealed(ffn, F2A, 1, rows(5))  # group rank 1: the attention peer
        # NOTE: gate on the attention's reaction, not on time: its close fails this receive.
        ffn.transport.recv(A2F, torch.empty(2, 64, dtype=torch.bfloat16), 1)
        return "the attention sent more"
    except RuntimeError as exc:
        return f"dropped: {exc}"
    finally:
        ffn.close()


@pytest.fixture(scope="module")
def pool():
    workers = WorkerPool(2)
    yield workers
    workers.close()


@pytest.mark.parametrize("scenario", sorted(s for s, (_, _, expected) in SCENARIOS.items() if expected is not None))
def test_a_receiver_ends_a_lying_peer_with_a_python_error_or_reads_past_it_never_an_abort(pool, scenario):
    victim, _, expected = SCENARIOS[scenario]
    port = free_port()

    outcomes = pool.run(rank_body, [(port, scenario, "ffn"), (port, scenario, "attention")], timeout_s=120.0)

    (victim_status, result), (liar_status, _) = outcomes if victim == "ffn" else outcomes[::-1]
    assert victim_status == "ok", (victim_status, result)  # "exit" with -6 would be gloo's abort
    if expected == ACCEPTED:
        assert result == ACCEPTED
    else:
        assert result.startswith("AFDPeerProtocolError: ") and expected in result, result
    assert liar_status == "ok"


def test_a_data_message_above_the_agreed_max_rows_still_ends_a_gloo_receiver(pool):
    """The documented limit (docs/protocol.md#bounds): posted at max_rows rows, a longer message is gloo's abort."""
    port = free_port()

    (ffn_status, exit_code), (attention_status, _) = pool.run(
        rank_body, [(port, "a2f message above max_rows", "ffn"), (port, "a2f message above max_rows", "attention")],
        timeout_s=120.0)

    assert (ffn_status, exit_code) == ("exit", -signal.SIGABRT)
    assert attention_status == "ok"


def rank_body(port: int, scenario: str, role: str) -> str:
    """The pool's target: the receiver of the scenario's victim role, or the lying peer."""
    victim = SCENARIOS[scenario][0]
    if role == victim:
        return (ffn_receiver if role == "ffn" else attention_receiver)(port, scenario)
    return (lying_attention if role == "attention" else lying_ffn)(port, scenario)
