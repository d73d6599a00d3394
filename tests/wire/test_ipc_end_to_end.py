"""AFDConnector over IpcTransport on CPU, end to end: rendezvous, handshake, control payloads through the
shared-memory mailbox, data slots and flags on a simulated device that runs behind the hosts (_ipc_sim).

Both roles are threads of this process (the fake driver gives them distinct pids); what only a GPU
shows is tests/connectors/test_ipc_cuda.py.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tests.connectors._harness import NUM_EXPERTS, free_port, make_connector, make_placement, make_spec
from tests.connectors._scenarios import crossing_layers, ffn_compute, make_hidden, make_logits
from tests.wire._ipc_sim import FakeDriver, ThreadedSimDevice

from vllm_afd.wire.messages import RoutingSpec
from vllm_afd.wire.transports.ipc import IpcTransport, message_row_bytes
from vllm_afd.wire.transports.mailbox import MailboxTransport

MAX_ROWS = 8
ROWS_PER_STEP = (3, 1, MAX_ROWS, 2)


def make(role: str, port: int, sim: ThreadedSimDevice, gate: bool, pid: int):
    spec = make_spec(port, name="P2pIpcAFDConnector", exchanges_per_stage=len(crossing_layers(gate)),
                     router_logits_width=NUM_EXPERTS if gate else None, use_graph_buffers=role == "ffn",
                     max_rows=MAX_ROWS)
    driver = FakeDriver(sim, pid=pid)
    row_bytes = message_row_bytes(spec.hidden_size, spec.dtype, spec.router_logits_width)
    transport = IpcTransport(spec.device, row_bytes=row_bytes, max_rows=MAX_ROWS, driver=driver)
    return make_connector(spec, make_placement(role, 0, 1, 1), transport=transport), driver


def ffn_side(connector, driver, gate: bool, errors: list) -> None:
    try:
        connector.init()
        routing = RoutingSpec(NUM_EXPERTS, torch.float32) if gate else None
        for _ in ROWS_PER_STEP:
            connector.next_step()
            outputs = []  # alive until the device copied them out
            for layer in crossing_layers(gate):
                batch = connector.recv_a2f(0, routing)
                driver.synchronize()  # the "MoE kernel" runs on the host here: after the receive, in order
                outputs.append(ffn_compute(batch.hidden_states, batch.router_logits, layer))
                connector.send_f2a(0, outputs[-1])
            driver.synchronize()  # as run_step ends each step
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        errors.append(exc)


@pytest.mark.parametrize("gate", [False, True], ids=["gate-on-ffn", "gate-on-attention"])
def test_steps_cross_exactly_with_control_in_the_mailbox_and_data_on_the_slots(gate):
    sim, port = ThreadedSimDevice(), free_port()
    ffn, ffn_driver = make("ffn", port, sim, gate, pid=1)
    attention, driver = make("attention", port, sim, gate, pid=2)
    errors: list[BaseException] = []
    thread = threading.Thread(target=ffn_side, args=(ffn, ffn_driver, gate, errors))
    thread.start()
    results = []
    try:
        attention.init()
        for step, rows in enumerate(ROWS_PER_STEP):
            attention.publish({0: [rows]})
            hidden = make_hidden(0, step, 0, 0, rows, torch.bfloat16)
            expected, kept = hidden.clone(), []
            for layer in crossing_layers(gate):
                logits = make_logits(0, step, layer, rows) if gate else None
                expected = ffn_compute(expected, logits, layer)
                attention.send_a2f(0, hidden, logits)
                attention.recv_f2a(0, hidden)
                kept.append(logits)  # the device copies from it later
            driver.synchronize()
            results.append(torch.equal(hidden, expected))
        thread.join(30)
    finally:
        attention.close()
        ffn.close()
        sim.stop()

    assert not errors, errors
    assert results == [True] * len(ROWS_PER_STEP)
    assert isinstance(ffn.transport._control, MailboxTransport)
    assert not driver.live and not ffn_driver.live
