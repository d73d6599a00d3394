"""The attention's outage notice: what its API server answers while its engine is down after an AFD
failure (docs/failures.md#requests-during-an-outage).

The failure is seen in a worker process, the requests arrive in the API server process.  The attention
connector's failure latch writes the failure's message to ``OUTAGE_FILE`` in the server's AFD
directory (``metrics_dir()``) the moment it records it, before the failure is raised into the engine
(connect.py passes ``outage_notice_writer()``), so no request reaches the dead engine after it;
the API server's request veto (plugin.py)
answers every generation request with HTTP 503 and that message while the file exists, instead of
vLLM's generic "EngineCore encountered an issue".  The root process of a ``vllm serve`` removes a file
left in that directory by an earlier run, so a restarted server starts without one.

A healing attention (attention/healing.py) says so in its notice (it pairs again by itself when the
FFN returns), removes the notice once paired again, and replaces it with the restart notice when it
gives up; the engine core's fault responder (plugin.py) reads the notice to tell an AFD failure,
which heals, from any other fault, which it leaves to vLLM.  The notice is also the one fact every
tensor-parallel rank of a server can read without a collective: the output rank's check after a step's
device work asks whether any rank failed (``outage_probe``, attention/step_gate.py).

A client reads the failure's kind only (``client_cause``): the connector's messages name hosts, ports,
ranks and raw transport errors, which belong in the server log (the failure latch logs each failure whole,
``AFD connector failed: …``), not in an answer to whoever sends a request (docs/security.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from vllm_afd.wire.errors import (AFDAuthenticationError, AFDConfigMismatchError, AFDLayoutError, AFDPeerLostError,
                                  AFDProtocolError, AFDRendezvousTimeout, AFDStepTimeoutError, AFDWatchdogStalledError)

__all__ = [
    "OUTAGE_FILE", "clear_outage", "client_cause", "healing_message", "outage_message", "outage_notice_writer",
    "outage_probe", "read_outage", "record_outage",
]

OUTAGE_FILE = "afd-attention-outage.txt"


# Failure class -> the phrase a client reads; the first match wins (subclasses first).
_CAUSES: tuple[tuple[type[BaseException], str], ...] = (
    (AFDWatchdogStalledError, "AFD watchdog stalled"),
    (AFDPeerLostError, "AFD peer lost"),
    (AFDStepTimeoutError, "AFD step timed out"),
    (AFDRendezvousTimeout, "AFD rendezvous timed out"),
    (AFDAuthenticationError, "AFD authentication failed"),
    (AFDProtocolError, "AFD protocol error"),
    (AFDConfigMismatchError, "AFD configuration mismatch"),
    (AFDLayoutError, "AFD layout mismatch"),
)


def client_cause(failure: BaseException) -> str:
    """What a client may read of ``failure``: a fixed phrase for its kind and its class, never its text
    (addresses, ranks, raw transport errors stay in the server log)."""
    phrase = next((text for kind, text in _CAUSES if isinstance(failure, kind)), "AFD failure")
    return f"{phrase}: {type(failure).__name__}; the details are in the server log"


def outage_message(failure: BaseException) -> str:
    """What a client of a down attention server reads: the cause and what happens next."""
    return (f"AFD attention server unavailable: its engine stopped after an AFD failure ({client_cause(failure)}). "
            "Restart this attention server: the FFN waits for it (reform_timeout_s) and pairs with the "
            "new one; send requests elsewhere meanwhile")


def healing_message(failure: BaseException, reform_timeout_s: float) -> str:
    """What a client of a healing attention server reads while it waits for its FFN."""
    return (f"AFD attention server unavailable: its FFN peer was lost ({client_cause(failure)}); re-forming: this "
            "server serves again once the FFN is back and paired (waiting up to "
            f"reform_timeout_s={reform_timeout_s:g} s). Retry shortly or send requests elsewhere meanwhile")


def record_outage(directory: str, message: str, *, replace: bool = False) -> None:
    """Write the notice (atomically: a reader sees all of it or nothing); the first one stays unless
    ``replace`` (a healing attention that gave up)."""
    path = os.path.join(directory, OUTAGE_FILE)
    if os.path.exists(path) and not replace:
        return
    staging = f"{path}.{os.getpid()}"
    with open(staging, "w", encoding="utf-8") as out:
        out.write(message)
    os.replace(staging, path)


def outage_notice_writer(reform_timeout_s: float | None = None) -> Callable[[BaseException], None] | None:
    """The attention connector's failure callback: the notice into this server's AFD directory (the
    healing one where ``reform_timeout_s`` is given); None where the process has none (AFD metrics off:
    vLLM's generic engine error remains)."""
    from vllm_afd.metrics import metrics_dir

    directory = metrics_dir()
    if directory is None:
        return None
    if reform_timeout_s is None:
        return lambda failure: record_outage(directory, outage_message(failure))
    return lambda failure: record_outage(directory, healing_message(failure, reform_timeout_s))


def read_outage(directory: str) -> str | None:
    """The notice, or None while the engine serves."""
    try:
        with open(os.path.join(directory, OUTAGE_FILE), encoding="utf-8") as notice:
            return notice.read()
    except FileNotFoundError:
        return None


def outage_probe(directory: str | None) -> Callable[[], bool]:
    """Whether a rank of this server recorded an AFD failure (one stat of its notice); always False without
    a directory.  The attention's output check asks it (docs/failures.md#23-no-token-from-an-aborted-step)."""
    if directory is None:
        return _no_outage
    path = os.path.join(directory, OUTAGE_FILE)
    return lambda: os.path.exists(path)


def _no_outage() -> bool:
    return False


def clear_outage(directory: str) -> None:
    """Remove an earlier run's notice (the directory may be a user's PROMETHEUS_MULTIPROC_DIR)."""
    try:
        os.remove(os.path.join(directory, OUTAGE_FILE))
    except FileNotFoundError:
        pass
