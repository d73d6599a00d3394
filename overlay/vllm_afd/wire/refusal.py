"""Leaving a pairing refused for its proofs (wire/auth.py), so that a new one can start on a fresh store.

Every rank counts its refusal in the store (``REFUSED_KEY``; the others' waits see it and refuse too:
``PeerRefusedError``); the store host waits (``REFUSAL_GRACE_S`` at most, past the deadline too) until all
have, so no rank loses the store in the middle of its checks, then drops it and, after ``REFUSAL_BACKOFF_S``,
hosts a new one; the others wait for the store to go away. ``Rendezvous.refuse`` (wire/rendezvous.py) runs
it; the waiting role keeps waiting: only the deadline ends it, naming the last refusal (``refusal_text``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_afd.wire.auth import AUTH_FIX
from vllm_afd.wire.errors import AFDAuthenticationError
from vllm_afd.wire.store import POLL_INTERVAL_S, STALE_CLAIM_POLL_S, call_within

__all__ = ["REFUSAL_BACKOFF_S", "REFUSED_KEY", "PeerRefusedError", "leave_refused_store", "refusal_text"]

# After a refused pairing: the store host waits this long at most for every rank to have refused too before it
# drops the store, then this long again before it hosts a new one (no busy loop of refusals).
REFUSAL_GRACE_S = 2.0
REFUSAL_BACKOFF_S = 1.0
# Counter of the ranks that refused this store's pairing (docs/connection.md#store-keys).
REFUSED_KEY = "afd/refused"


class PeerRefusedError(AFDAuthenticationError):
    """Another rank refused this pairing (its log says why); this rank leaves it too."""


def peer_refused_error(label: str) -> PeerRefusedError:
    """What a rank waiting in the handshake raises once ``REFUSED_KEY`` is in the store."""
    return PeerRefusedError(f"AFD {label}: {AUTH_FIX} (another rank refused this pairing's proofs; its log names "
                            "the rank and why)")


def last_refusal(previous: AFDAuthenticationError | None,
                 refusal: AFDAuthenticationError) -> AFDAuthenticationError:
    """The refusal timeout messages name: a rank's own reason, not the relayed one, when it has one."""
    return refusal if previous is None or not isinstance(refusal, PeerRefusedError) else previous


def refusal_text(refused: AFDAuthenticationError | None) -> str:
    """The tail of a timeout message: the last pairing's refusal, if any."""
    return "" if refused is None else f". The last pairing was refused: {refused}"


def leave_refused_store(store: Any, is_store_host: bool, num_ranks: int, clock: Callable[[], float],
                        sleep: Callable[[float], None], check_cancelled: Callable[[], None],
                        check_deadline: Callable[[], None], call_timeout_s: float) -> None:
    """Count this rank's refusal, then wait: the store host until every rank has (or the grace ends), the
    others until the store host drops the store. The store is gone either way: a call to a store host that
    stopped answering (torch's client never times out then) counts as gone after ``call_timeout_s``."""
    from torch.distributed import DistNetworkError

    def call(operation: Callable[[], Any]) -> Any:
        return call_within(operation, call_timeout_s, _StoreSilentError)

    try:
        call(lambda: store.add(REFUSED_KEY, 1))
        if is_store_host:
            grace = clock() + REFUSAL_GRACE_S
            while call(lambda: store.add(REFUSED_KEY, 0)) < num_ranks and clock() < grace:
                check_cancelled()
                sleep(POLL_INTERVAL_S)
            check_deadline()
        else:
            while True:  # until FFN rank 0 drops this store: DistNetworkError
                call(lambda: store.check([REFUSED_KEY]))
                check_cancelled()
                check_deadline()
                sleep(STALE_CLAIM_POLL_S)
    except (DistNetworkError, _StoreSilentError):
        pass  # the store is gone already, or its host stopped answering: the next connect finds out which


class _StoreSilentError(Exception):
    """A refusal's store call that got no answer within its bound."""
