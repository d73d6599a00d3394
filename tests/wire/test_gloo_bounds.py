"""wire/transports/gloo.py: ``transfer_timeout_s`` bounds a data wait on a live but silent peer; control
receives stay unbounded (docs/failures.md#22-the-attention-tp-2-stall).

gloo cannot interrupt a blocked receive of its own process (``abort()`` and ``shutdown()`` leave it blocked
until the peer's exit, torch 2.13), so this bound is what releases a rank stuck on a peer that hangs.
"""

from __future__ import annotations

import threading
import time

import torch

from tests.wire._gloo_pair import open_gloo_pair
from vllm_afd.wire.placement import A2F, CONTROL


def open_pair():
    return open_gloo_pair(torch.device("cpu"))


def test_a_data_receive_from_a_silent_peer_fails_at_the_transfer_bound():
    ffn, attention = open_pair()
    attention.transfer_timeout_s = 0.5
    started = time.monotonic()

    try:
        attention.recv(A2F, torch.empty(4, dtype=torch.uint8), 0)
        raised = None
    except RuntimeError as exc:
        raised = exc
    elapsed = time.monotonic() - started
    ffn.close()
    attention.close()

    assert raised is not None and "Timed out" in str(raised)
    assert 0.4 <= elapsed < 5.0, elapsed


def test_without_a_bound_and_on_the_control_channel_a_receive_waits_for_the_peer():
    ffn, attention = open_pair()
    ffn.transfer_timeout_s = 0.2  # control receives ignore it: the FFN may wait idle for the next step
    received = torch.zeros(4, dtype=torch.uint8)
    receiver = threading.Thread(target=ffn.recv, args=(CONTROL, received, 1))
    receiver.start()

    time.sleep(1.0)
    still_waiting = receiver.is_alive()
    attention.send(CONTROL, torch.arange(4, dtype=torch.uint8), 0)
    receiver.join(10)
    ffn.close()
    attention.close()

    assert still_waiting and not receiver.is_alive()
    assert received.tolist() == [0, 1, 2, 3]
