"""The harness's port picks (afd_harness.server.free_ports): a server binds its port long after the pick, so
picks come from below the kernel's ephemeral range, where no connect() or bind to port 0 is handed one."""

from __future__ import annotations

import socket

from afd_harness.server import PORT_FLOOR, _ephemeral_floor, free_port, free_ports


def test_picked_ports_are_distinct_free_and_below_the_ephemeral_range():
    ports = free_ports(8) + [free_port()]

    assert len(set(ports[:8])) == 8
    assert all(PORT_FLOOR <= port < _ephemeral_floor() for port in ports)
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_picked(monkeypatch):
    import random

    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", 0))
    with held:
        busy = held.getsockname()[1]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            free = probe.getsockname()[1]
        picks = iter([busy, busy, free])
        monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, lo, hi: next(picks))
        monkeypatch.setattr("afd_harness.server._ephemeral_floor", lambda: 65536)

        assert free_port() == free
