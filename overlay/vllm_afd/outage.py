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
"""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["OUTAGE_FILE", "clear_outage", "outage_message", "outage_notice_writer", "read_outage", "record_outage"]

OUTAGE_FILE = "afd-attention-outage.txt"


def outage_message(failure: BaseException) -> str:
    """What a client of a down attention server reads: the cause and what happens next."""
    return (f"AFD attention server unavailable: its engine stopped after an AFD failure ({failure}). "
            "Restart this attention server: the FFN waits for it (reform_timeout_s) and pairs with the "
            "new one; send requests elsewhere meanwhile")


def record_outage(directory: str, failure: BaseException) -> None:
    """Write the notice once (atomically: a reader sees all of it or nothing)."""
    path = os.path.join(directory, OUTAGE_FILE)
    if os.path.exists(path):
        return
    staging = f"{path}.{os.getpid()}"
    with open(staging, "w", encoding="utf-8") as out:
        out.write(outage_message(failure))
    os.replace(staging, path)


def outage_notice_writer() -> Callable[[BaseException], None] | None:
    """The attention connector's failure callback: the notice into this server's AFD directory; None
    where the process has none (AFD metrics off: vLLM's generic engine error remains)."""
    from vllm_afd.metrics import metrics_dir

    directory = metrics_dir()
    if directory is None:
        return None
    return lambda failure: record_outage(directory, failure)


def read_outage(directory: str) -> str | None:
    """The notice, or None while the engine serves."""
    try:
        with open(os.path.join(directory, OUTAGE_FILE), encoding="utf-8") as notice:
            return notice.read()
    except FileNotFoundError:
        return None


def clear_outage(directory: str) -> None:
    """Remove an earlier run's notice (the directory may be a user's PROMETHEUS_MULTIPROC_DIR)."""
    try:
        os.remove(os.path.join(directory, OUTAGE_FILE))
    except FileNotFoundError:
        pass
