"""AFDConnector in one process: lifecycle edges, refusals, row checks, control framing (docs/protocol.md).

Connectors rendezvous for real (a TCPStore on loopback) and exchange over the in-memory
``QueueTransport`` of tests/connectors/_harness.py, so every tensor that reached the wire can be
inspected; the real transports are covered by tests/connectors.
"""

from __future__ import annotations

import threading
import time
import zlib

import pytest
import torch

from tests.connectors._harness import (
    QueueTransport,
    free_port,
    init_all,
    make_connector,
    make_placement,
    make_spec,
    new_wire,
    pending,
)

from vllm_afd.wire.attention_end import AttentionConnector
from vllm_afd.wire.errors import AFDPeerLostError, AFDPeerProtocolError, AFDProtocolError, AFDRendezvousTimeout
from vllm_afd.wire.ffn_end import MAX_CONTROL_BYTES, FFNConnector
from vllm_afd.wire.messages import ControlPayload, RoutingSpec
from vllm_afd.wire.placement import CONTROL
from vllm_afd.wire.watchdog import NULL_WATCHDOG, Watchdog

BF16 = torch.bfloat16


def test_close_is_safe_uninitialised_and_repeated():
    connector = make_connector(make_spec(free_port()), make_placement("attention", 0, 1, 1))

    connector.close()
    connector.close()

    assert not connector.is_initialized
    connector.check_failed()  # closing is not a failure
    with pytest.raises(RuntimeError, match="the AFD connector is closed"):
        connector.recv_f2a(0, torch.zeros(1, 64, dtype=BF16))
    with pytest.raises(RuntimeError, match="after close"):
        connector.init()


@pytest.mark.parametrize("role", ["ffn", "attention"])
def test_every_call_before_init_says_not_initialized(role):
    connector = make_connector(make_spec(free_port()), make_placement(role, 0, 1, 1))
    rows = torch.zeros(1, 64, dtype=BF16)
    if role == "attention":
        calls = [connector.mark_startup_done, lambda: connector.publish({0: [1]}),
                 lambda: connector.send_a2f(0, rows), lambda: connector.recv_f2a(0, rows)]
    else:
        calls = [connector.next_step, lambda: connector.recv_a2f(0), lambda: connector.send_f2a(0, rows),
                 connector.wait_sends]

    for call in calls:
        with pytest.raises(RuntimeError, match="the AFD connector is not initialized; expected an initialised"):
            call()


def test_close_after_a_failed_rendezvous_releases_everything():
    port = free_port()
    connector = make_connector(make_spec(port, rendezvous_timeout_s=0.5), make_placement("ffn", 0, 1, 1))
    threads_before = threading.active_count()

    with pytest.raises(AFDRendezvousTimeout, match="missing: attention \\[0\\]"):
        connector.init()
    connector.close()
    connector.close()

    assert not connector.is_initialized
    assert threading.active_count() <= threads_before
    again = make_connector(make_spec(port, rendezvous_timeout_s=0.5), make_placement("ffn", 0, 1, 1))
    with pytest.raises(AFDRendezvousTimeout):  # the port is free again: the store was released
        again.init()
    again.close()


def test_close_cancels_a_pending_init_without_waiting_for_it_and_a_second_init_is_refused():
    connector = make_connector(make_spec(free_port(), rendezvous_timeout_s=30.0), make_placement("ffn", 0, 1, 1))
    errors = []

    def init():
        try:
            connector.init()
        except Exception as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    thread = threading.Thread(target=init)
    thread.start()
    time.sleep(0.5)  # FFN rank 0 is waiting for an attention rank that never comes
    with pytest.raises(RuntimeError, match="init\\(\\) is already running on another thread"):
        connector.init()
    started = time.monotonic()
    connector.close()

    assert time.monotonic() - started < 5.0
    thread.join(5.0)
    assert not thread.is_alive()
    assert "cancelled: the connector was closed" in str(errors[0])


def initialised(num_attention, num_ffn, **spec_overrides):
    """Every rank of an A x F deployment in this process, over one in-memory wire; FFN first."""
    port, wire = free_port(), new_wire()
    ranks = [("ffn", k) for k in range(num_ffn)] + [("attention", j) for j in range(num_attention)]
    connectors = [make_connector(make_spec(port, **spec_overrides), make_placement(role, rank, num_attention, num_ffn),
                                 transport=QueueTransport(wire)) for role, rank in ranks]
    init_all(connectors)
    return wire, connectors


@pytest.fixture
def deploy():
    """``deploy(A, F, **spec_overrides)`` -> (wire, connectors); every connector is closed afterwards."""
    made = []

    def make(num_attention=1, num_ffn=1, **spec_overrides):
        made.append(initialised(num_attention, num_ffn, **spec_overrides))
        return made[-1]

    yield make
    for _, connectors in made:
        for connector in reversed(connectors):
            connector.close()


def test_each_end_has_only_its_roles_calls():
    ffn = make_connector(make_spec(free_port()), make_placement("ffn", 0, 1, 1))
    attention = make_connector(make_spec(free_port()), make_placement("attention", 0, 1, 1))
    attention_only = ("publish", "send_a2f", "recv_f2a", "defer_failure", "take_step_failure", "mark_startup_done")
    ffn_only = ("next_step", "recv_a2f", "send_f2a", "wait_sends")

    assert isinstance(attention, AttentionConnector) and isinstance(ffn, FFNConnector)
    assert all(callable(getattr(attention, name)) for name in attention_only)
    assert all(callable(getattr(ffn, name)) for name in ffn_only)
    assert [name for name in ffn_only if hasattr(attention, name)] == []
    assert [name for name in attention_only if hasattr(ffn, name)] == []


def test_shape_checks_raise_before_sending(deploy):
    wire, (ffn, attention) = deploy(exchanges_per_stage=1)
    attention.publish({0: [3]})
    ffn.next_step()
    good = torch.zeros(3, 64, dtype=BF16)
    bad = {
        "rank 1, expected 2-D": torch.zeros(3 * 64, dtype=BF16),
        "width 32, expected 64": torch.zeros(3, 32, dtype=BF16),
        "dtype torch.float32, expected torch.bfloat16": torch.zeros(3, 64),
        "device meta, expected cpu": torch.zeros(3, 64, dtype=BF16, device="meta"),
        "sends 2 rows in stage 0 but published 3": torch.zeros(2, 64, dtype=BF16),
    }

    for expected, tensor in bad.items():
        with pytest.raises(ValueError, match=expected):
            attention.send_a2f(0, tensor)
    with pytest.raises(ValueError, match="router logits given with compute_gate_on_attention=false"):
        attention.send_a2f(0, good, torch.zeros(3, 8))
    with pytest.raises(RuntimeError, match="no published rows for stage 1 \\(stages \\[0\\]\\)"):
        attention.send_a2f(1, good)
    with pytest.raises(ValueError, match="have 2 entries; expected one per attention DP rank \\(1\\)"):
        attention.publish({0: [1, 2]})
    assert pending(wire) == {}

    attention.send_a2f(0, good)  # nothing bad reached the wire: the FFN sees exactly this
    batch = ffn.recv_a2f(0)
    with pytest.raises(ValueError, match="FFN output has 2 rows in stage 0; expected 3 \\(peers' rows \\[3\\]\\)"):
        ffn.send_f2a(0, batch.hidden_states[:2])
    ffn.send_f2a(0, batch.hidden_states + 1)
    with pytest.raises(ValueError, match="receive into 2 rows in stage 0; expected the published 3"):
        attention.recv_f2a(0, good[:2])
    assert torch.equal(attention.recv_f2a(0, good), torch.ones(3, 64, dtype=BF16))


def test_router_logits_follow_the_hidden_states_and_are_checked_first(deploy):
    wire, (ffn, attention) = deploy(exchanges_per_stage=1, router_logits_width=8)
    attention.publish({0: [2]})
    ffn.next_step()
    hidden, logits = torch.ones(2, 64, dtype=BF16), torch.arange(16.0).reshape(2, 8)

    with pytest.raises(ValueError, match="router logits of shape \\[2, 4\\] cannot be sent: width 4, expected 8"):
        attention.send_a2f(0, hidden, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="router logits have 3 rows, hidden states 2; pass this layer's logits"):
        attention.send_a2f(0, hidden, torch.zeros(3, 8))
    assert pending(wire) == {}
    attention.send_a2f(0, hidden, logits)
    batch = ffn.recv_a2f(0, RoutingSpec(8, torch.float32))

    assert torch.equal(batch.hidden_states, hidden) and torch.equal(batch.router_logits, logits)
    assert tuple(batch.peer_rows) == (2,)


def test_result_goes_to_a_new_tensor_when_out_does_not_fit(deploy):
    _, (ffn, attention) = deploy(exchanges_per_stage=1)
    attention.publish({0: [2]})
    ffn.next_step()
    hidden = torch.arange(128, dtype=BF16).reshape(2, 64)
    attention.send_a2f(0, hidden)
    ffn.send_f2a(0, ffn.recv_a2f(0).hidden_states * 2)

    out = torch.zeros(2, 64, dtype=torch.float32)  # same rows, other dtype: not a receive buffer
    result = attention.recv_f2a(0, out)

    assert result is not out and result.dtype == BF16
    assert torch.equal(result, hidden * 2)


def test_the_payload_crosses_as_an_int64_length_and_crc_then_its_bytes(deploy):
    wire, (ffn, attention) = deploy()

    published = attention.publish({0: [5]}, is_warmup=True)

    header, body = wire[(CONTROL, 1, 0)]
    assert header.dtype == torch.int64 and header.tolist() == [body.numel(), zlib.crc32(body.numpy().tobytes())]
    assert body.dtype == torch.uint8 and ControlPayload.decode(body.numpy().tobytes()) == published
    assert ffn.next_step() == published and published.is_warmup and published.step_seq == 0


def test_only_attention_ranks_below_f_transmit_but_every_rank_adopts(deploy):
    wire, (ffn, attention_0, attention_1) = deploy(2, 1)

    payloads = [attention.publish({0: [3, 0]}) for attention in (attention_0, attention_1)]

    assert pending(wire) == {(CONTROL, 1, 0): 2}  # length and body from attention rank 0 only
    assert ffn.next_step() == payloads[0] == payloads[1]
    assert [a.steps.stage(0).own_rows for a in (attention_0, attention_1)] == [3, 1]  # idle: one row
    assert ffn.steps.stage(0).peer_rows == (3, 1)


def send_control(attention, length, body, crc=None):
    crc = zlib.crc32(body or b"") if crc is None else crc
    attention.transport.send(CONTROL, torch.tensor([length, crc], dtype=torch.int64), 0)
    if body is not None:
        attention.transport.send(CONTROL, torch.frombuffer(bytearray(body), dtype=torch.uint8), 0)


@pytest.mark.parametrize("length", [0, -1, MAX_CONTROL_BYTES + 1])
def test_a_control_length_out_of_range_is_a_protocol_error(deploy, length):
    _, (ffn, attention) = deploy()
    send_control(attention, length, None)

    with pytest.raises(AFDPeerProtocolError, match=f"from attention rank 0: control payload length {length} is not in "
                                                   f"1..{MAX_CONTROL_BYTES}"):
        ffn.next_step()


def test_a_payload_for_another_deployment_is_refused_and_changes_nothing(deploy):
    _, (ffn, attention) = deploy()
    attention.publish({0: [2]})
    before = ffn.next_step()
    body = ControlPayload({0: (1, 2)}).encode()  # two attention ranks; this deployment has one
    send_control(attention, len(body), body)

    with pytest.raises(AFDProtocolError, match="control payload stage 0 has 2 counts \\[1, 2\\]; expected one per "
                                               "attention rank \\(1\\)"):
        ffn.next_step()

    assert ffn.steps.payload == before and ffn.steps.stage(0).peer_rows == (2,)


def test_undecodable_control_bytes_are_a_protocol_error(deploy):
    _, (ffn, attention) = deploy()
    send_control(attention, 9, b"\x80not json")

    with pytest.raises(AFDProtocolError, match="AFD control payload is undecodable"):
        ffn.next_step()


class BrokenTransport(QueueTransport):
    """Receives fail as gloo's do when the peer's connections close."""

    def recv(self, channel, tensor, src):
        if channel != CONTROL:
            raise RuntimeError("Connection closed by peer")
        super().recv(channel, tensor, src)


def test_a_transport_error_is_a_sticky_lost_peer_naming_the_exchange():
    port, wire = free_port(), new_wire()
    connectors = [
        make_connector(make_spec(port), make_placement("ffn", 0, 1, 1), transport=QueueTransport(wire)),
        make_connector(make_spec(port), make_placement("attention", 0, 1, 1), transport=BrokenTransport(wire)),
    ]
    threads = [threading.Thread(target=c.init) for c in connectors]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20.0)
    ffn, attention = connectors
    try:
        attention.publish({0: [1]})
        attention.send_a2f(0, torch.zeros(1, 64, dtype=BF16))

        with pytest.raises(AFDPeerLostError, match="AFD peer lost: f2a receive from ffn rank 0 failed on attention "
                                                   "rank 0 \\(Connection closed by peer\\)"):
            attention.recv_f2a(0, torch.zeros(1, 64, dtype=BF16))

        assert not attention.is_initialized
        with pytest.raises(AFDPeerLostError):
            attention.check_failed()
        with pytest.raises(AFDPeerLostError):
            attention.publish({0: [1]})  # sticky: every later call raises the same failure
    finally:
        for connector in connectors:
            connector.close()


def test_the_watchdog_is_the_null_one_before_init_and_after_close():
    wire, port = new_wire(), free_port()
    ffn, attention = (make_connector(make_spec(port), make_placement(role, 0, 1, 1), transport=QueueTransport(wire))
                      for role in ("ffn", "attention"))
    assert ffn._watchdog is NULL_WATCHDOG and attention._watchdog is NULL_WATCHDOG

    init_all([ffn, attention])
    watching = attention._watchdog
    ffn.close()
    attention.close()

    assert isinstance(watching, Watchdog) and not watching.is_alive
    assert ffn._watchdog is NULL_WATCHDOG and attention._watchdog is NULL_WATCHDOG


def test_a_graph_replay_step_is_not_timed(deploy):
    _, (ffn, attention) = deploy()

    attention.publish({0: [4]}, is_graph_replaying=True)
    ffn.next_step()

    assert attention._watchdog._step is None and ffn._watchdog._step is None
    attention.publish({0: [4]})
    assert attention._watchdog._step is not None


def test_graph_buffers_keep_their_address_for_a_known_shape(deploy):
    _, (ffn, attention) = deploy(exchanges_per_stage=1, use_graph_buffers=True)
    addresses = []

    for count in (4, 4, 2):
        attention.publish({0: [count]})
        ffn.next_step()
        attention.send_a2f(0, torch.full((count, 64), count, dtype=BF16))
        batch = ffn.recv_a2f(0)
        addresses.append(batch.hidden_states.data_ptr())
        ffn.send_f2a(0, batch.hidden_states)
        attention.recv_f2a(0, torch.empty(count, 64, dtype=BF16))

    assert addresses[0] == addresses[1] != addresses[2]


def test_mark_startup_done_arms_step_timeouts_on_both_sides(deploy):
    _, (ffn, attention) = deploy()

    attention.mark_startup_done()
    attention.mark_startup_done()  # counted once per attention rank
    deadline = time.monotonic() + 5.0
    while not (ffn._watchdog.armed and attention._watchdog.armed):
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_the_step_gate_takes_a_deferred_failure_once_and_a_pairing_that_is_not_ready_always():
    wire, port = new_wire(), free_port()
    ffn = make_connector(make_spec(port), make_placement("ffn", 0, 1, 1), transport=QueueTransport(wire))
    attention = make_connector(make_spec(port), make_placement("attention", 0, 1, 1), transport=QueueTransport(wire))
    init_all([ffn, attention])
    try:
        assert attention.take_step_failure() is None
        attention.defer_failure(AFDPeerLostError("first"))
        attention.defer_failure(AFDPeerLostError("second"))

        assert str(attention.take_step_failure()) == "first"  # the step's first failure, once
        assert attention.take_step_failure() is None
    finally:
        ffn.close()
        attention.close()

    failure = attention.take_step_failure()  # not paired (closed here; a background re-formation alike)
    assert isinstance(failure, AFDPeerLostError) and "cannot run" in str(failure)
