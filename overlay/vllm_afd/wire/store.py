"""The rendezvous store: FFN rank 0 listens and hosts it, every connection knocks, then connects.

``Rendezvous`` (wire/rendezvous.py) owns the deadline and calls these with what is left of it. Every rank's
records are keys ``rank_key`` names; the store's loss is one error for every rank that talks through it
(``store_lost_error``), and so is a store call that does not return within its bound (``call_within``:
torch's store client ignores its own timeout once connected to a host that stopped answering, measured on
torch 2.13: an ``add`` to a SIGSTOPped host with a 2 s timeout blocked until SIGCONT). torch.distributed is
imported lazily, at the first store operation.
"""

from __future__ import annotations

import datetime
import errno
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from vllm_afd.role import Role
from vllm_afd.wire.errors import AFDPeerLostError

__all__ = ["KEY_PREFIX", "call_within", "connect_client", "host_store", "knock", "rank_key", "store_frozen_error",
           "store_lost_error", "store_timeout"]

KEY_PREFIX = "afd"
# Poll period while waiting for other ranks' keys; short against a start-up of seconds.
POLL_INTERVAL_S = 0.02
# Poll period while a store may go away (a held claim that may turn out stale, a refused pairing), and while a
# re-forming store host rebinds its port.
STALE_CLAIM_POLL_S = 0.1
# Per-attempt bound of a TCP connect to FFN rank 0 while it is not listening yet.
CONNECT_ATTEMPT_S = 1.0


def rank_key(kind: str, role: Role, role_rank: int) -> str:
    """Store key of one rank's record of ``kind`` (claim, fingerprint, heartbeat)."""
    return f"{KEY_PREFIX}/{kind}/{role}/{role_rank}"


def store_lost_error(address: str, role: str, role_rank: int, exc: BaseException) -> AFDPeerLostError:
    """The store's host (FFN rank 0) is gone: every rank that talks through the store lost a peer."""
    return AFDPeerLostError(
        f"AFD peer lost: the rendezvous store at {address} (hosted by ffn rank 0) is unreachable from "
        f"{role} rank {role_rank} ({exc}); expected FFN rank 0 to stay up for the whole AFD run. Check "
        "FFN rank 0's log and restart it: the other ranks pair with it again once it is back (an attention "
        "with CUDA graphs is restarted too; docs/operations.md)"
    )


def store_frozen_error(address: str, label: str, what: str, bound_s: float) -> AFDPeerLostError:
    """A store call that did not return within its bound: FFN rank 0 is stopped, stuck or cut off."""
    return AFDPeerLostError(
        f"AFD peer lost: the rendezvous store at {address} (hosted by ffn rank 0) did not answer {label}'s "
        f"{what} within {bound_s:g}s (peer_timeout_s); ffn rank 0's process is stopped or stuck, or the network "
        "to its host is cut. Check ffn rank 0's log and process state; restart it if it does not recover "
        "(docs/operations.md)"
    )


def call_within(call: Callable[[], Any], bound_s: float, expired: Callable[[], BaseException], *,
                poll: Callable[[], None] = lambda: None) -> Any:
    """``call()`` on a daemon thread; its result or its exception, or ``expired()`` raised once ``bound_s``
    passed without an answer.  ``poll()`` runs every ``POLL_INTERVAL_S`` meanwhile and may raise instead (a
    failure the watchdog recorded while a long call waits).

    The bound from outside, because torch's client does not time out a call to a stopped host.  A call that
    expired keeps its thread until the store answers or its connection closes; the caller must treat the store
    as lost and never call it again (a late answer would be read by the next call).
    """
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            outcome.append((False, exc))

    worker = threading.Thread(target=run, name="afd-store-call", daemon=True)
    worker.start()
    deadline = time.monotonic() + bound_s
    while not outcome and (left := deadline - time.monotonic()) > 0:
        worker.join(min(left, POLL_INTERVAL_S))
        if not outcome:
            poll()
    if not outcome:
        raise expired()
    ok, value = outcome[0]
    if ok:
        return value
    raise value


def store_timeout(remaining_s: float) -> datetime.timedelta:
    """A store's operation timeout: what is left of the deadline, at least a second."""
    return datetime.timedelta(seconds=max(remaining_s, 1.0))


def host_store(host: str, port: int, rebind_s: float, remaining_s: Callable[[], float],
               clock: Callable[[], float], sleep: Callable[[float], None]) -> Any:
    """FFN rank 0: listen on ``host:port`` (a port still held is retried for ``rebind_s``) and host the store."""
    from torch.distributed import TCPStore

    try:
        listener = _listen(host, port, clock() + min(rebind_s, remaining_s()), clock, sleep)
    except OSError as exc:
        raise RuntimeError(
            f"AFD FFN rank 0 cannot listen on {host}:{port}: {exc}; 'port' must be free and 'host' "
            "must be this machine's address"
        ) from exc
    # NOTE: we bind the socket ourselves so a busy port yields the OS error, not a store timeout.
    return TCPStore(
        host,
        port,
        is_master=True,
        master_listen_fd=listener.detach(),
        wait_for_workers=False,
        use_libuv=False,
        timeout=store_timeout(remaining_s()),
    )


def _listen(host: str, port: int, rebind_until: float, clock: Callable[[], float],
            sleep: Callable[[float], None]) -> socket.socket:
    """Bind and listen on the store's address; EADDRINUSE is retried until ``rebind_until``."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    while True:
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen()
            return listener
        except OSError as exc:
            listener.close()
            if exc.errno != errno.EADDRINUSE or clock() >= rebind_until:
                raise
        sleep(STALE_CLAIM_POLL_S)


def connect_client(host: str, port: int, remaining_s: Callable[[], float],
                   between_attempts: Callable[[BaseException], None]) -> Any:
    """A new client connection to the store (FFN rank 0 connects to itself), retrying while
    ``between_attempts(last_error)`` returns: it raises to give up (cancelled, the deadline) and sleeps.

    While nobody listens, only a plain socket knocks: torch's TCPStore client writes a C++ stack
    trace to stderr for every failed attempt (~700 lines a minute), so it is created only once
    the port accepts.
    """
    from torch.distributed import TCPStore

    while True:
        # NOTE: short attempts: TCPStore's connect retries internally for up to ~3x its timeout.
        attempt_s = min(CONNECT_ATTEMPT_S, max(remaining_s() / 3.0, 0.05))
        try:
            knock(host, port, attempt_s)
            store = TCPStore(host, port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=attempt_s))
            store.set_timeout(store_timeout(remaining_s()))
            return store
        except OSError as exc:  # nobody listens (yet); the knock's error, never a trace
            last_error: BaseException = exc
        except RuntimeError as exc:  # DistNetworkError: the port accepted, the store did not answer in time
            last_error = exc
        between_attempts(last_error)


def knock(host: str, port: int, timeout_s: float) -> None:
    """Raise ``OSError`` unless something accepts TCP connections at ``host:port``.

    NOTE: the knock closes at once; the store's server sees a peer that closed before it spoke,
    which it drops without a log line (tests/wire/test_rendezvous.py checks it keeps serving).  A
    new TCPStore client stalls ~5 s in 1-2 % of connects with or without a knock before it (measured
    on torch 2.13, 2026-12-01); ``connect_client``'s short attempts turn such a stall into one retry.
    """
    with socket.create_connection((host, port), timeout=timeout_s):
        pass
