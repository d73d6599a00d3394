"""Rank bodies of the NCCL transport's GPU tests (top-level, so ``spawn`` can import them).

The FFN on cuda:1, the attention on cuda:0: NCCL needs a distinct GPU per rank. The communicators are
built from the unique id the transport exchanged as raw bytes (``exchange_unique_id``), through vLLM's
``PyNcclCommunicator.from_unique_id_bytes``. The data is _scenarios' small integers and FFN function,
so every result is checked bit for bit against the same arithmetic on the attention's GPU. With
``loop_thread`` the FFN opens and runs its steps on a fresh thread that never sets a device, as the FFN
loop's thread starts (on cuda:0): the transport must still put every NCCL call on cuda:1's stream.
"""

from __future__ import annotations

from typing import Any

import torch
from tests.connectors._harness import make_connector, make_placement, make_spec
from tests.connectors._scenarios import crossing_layers, ffn_compute, make_hidden

CONNECTOR = "P2pNcclAFDConnector"


def exchange_on_two_gpus(role: str, port: int, num_steps: int = 3, loop_thread: bool = False) -> dict[str, Any]:
    """1A1F over NCCL: ``num_steps`` eager steps of varied rows, every crossing layer's exchange checked."""
    if loop_thread and role == "ffn":
        import threading

        result: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: result.update(_exchange(role, port, num_steps, bind=False)))
        thread.start()
        thread.join(170)
        assert not thread.is_alive() and result, "the FFN's thread did not finish its steps"
        return result
    return _exchange(role, port, num_steps, bind=True)


def _exchange(role: str, port: int, num_steps: int, *, bind: bool) -> dict[str, Any]:
    from vllm_afd.connect import TRANSPORTS

    device = torch.device("cuda", 1 if role == "ffn" else 0)
    if bind:
        torch.cuda.set_device(device)
    layers = crossing_layers(False)
    spec = make_spec(port, name=CONNECTOR, device=device, exchanges_per_stage=len(layers), rendezvous_timeout_s=60.0)
    connector = make_connector(spec, make_placement(role, 0, 1, 1), transport=TRANSPORTS[CONNECTOR](device))
    connector.init()
    exact: list[bool] = []
    try:
        for step, num_rows in enumerate((3, 1, 5)[:num_steps]):
            if role == "ffn":
                connector.next_step()
                for layer in layers:
                    batch = connector.recv_a2f(0)
                    connector.send_f2a(0, ffn_compute(batch.hidden_states, None, layer))
                connector.wait_sends()
                torch.cuda.synchronize(device)
                continue
            connector.publish({0: [num_rows]})
            hidden = make_hidden(0, step, 0, 0, num_rows, torch.bfloat16, device)
            expected = hidden.clone()
            for layer in layers:
                expected = ffn_compute(expected, None, layer)
                connector.send_a2f(0, hidden)
                connector.recv_f2a(0, hidden)
            torch.cuda.synchronize(device)
            exact.append(torch.equal(hidden, expected))
    finally:
        connector.close()
    return {"exact": exact}
