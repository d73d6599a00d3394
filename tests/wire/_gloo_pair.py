"""An FFN and an attention ``GlooTransport`` joined on loopback, for transport-level tests."""

from __future__ import annotations

import socket
import threading

import torch
from torch.distributed import TCPStore

from vllm_afd.wire.placement import Placement
from vllm_afd.wire.transports.gloo import GlooTransport


def open_gloo_pair(device: torch.device) -> tuple[GlooTransport, GlooTransport]:
    """(ffn, attention), 1A1F, both open; close both when done.

    TCP stores, as the connector's (the gloo transport binds to the interface that reaches the store's
    host), one client per rank: two threads on one TCPStore client deadlock in its waits.
    """
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    stores = [TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False),
              TCPStore("127.0.0.1", port, is_master=False)]
    ffn, attention = GlooTransport(device), GlooTransport(device)
    opened = [threading.Thread(target=t.open, args=(store, Placement(role, 0, 1, 1, 1, 1), 30.0))
              for t, role, store in ((ffn, "ffn", stores[0]), (attention, "attention", stores[1]))]
    for thread in opened:
        thread.start()
    for thread in opened:
        thread.join(30)
    ffn.stores = attention.stores = stores  # the store lives as long as the groups
    return ffn, attention
