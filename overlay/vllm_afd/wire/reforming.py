"""Pair again after a lost peer, until one agrees or the time is up (docs/connection.md#re-forming).

Both roles re-form the same way: the FFN when its attention is lost (ffn/runner.py), a healing
attention when its FFN is lost (attention/healing.py).  ``AFDConnector.reform`` is one attempt;
this is the wait around it.  A returning peer whose handshake disagrees (another model, other AFD
settings) is refused: its own start-up fails naming the fields, and this side keeps waiting for
one that agrees, so a wrong restart never ends the survivor's wait early.  So is a pairing whose
store values fail their checks (``AFDProtocolError``, docs/connection.md#store-values): a stray or
hostile store client cannot end the wait either.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from vllm_afd.wire.errors import (AFDConfigMismatchError, AFDLayoutError, AFDPeerLostError, AFDProtocolError,
                                  AFDRendezvousTimeout)
from vllm_afd.role import Role

if TYPE_CHECKING:
    from vllm_afd.wire.connector import AFDConnector

__all__ = ["reform_within"]

logger = logging.getLogger(__name__)

# The least time one attempt gets, so a deadline reached mid-loop still makes one last attempt.
MIN_ATTEMPT_S = 0.1
# Pause before the next attempt after the store was lost mid-attempt (no busy loop against a dead host).
RETRY_PAUSE_S = 0.5


def reform_within(connector: AFDConnector, timeout_s: float, cause: BaseException, *, peer: str,
                  then: str) -> float:
    """Re-form ``connector`` within ``timeout_s``; returns the seconds it took.

    ``peer`` names what was lost ("the attention", "the FFN"), ``then`` what happens when it does
    not return (the sentence ending the error).  Raises ``AFDRendezvousTimeout`` naming the cause,
    the timeout and, when peers came back but were refused, the last refusal.
    """
    label = connector.placement.label
    started = time.monotonic()
    deadline = started + timeout_s
    logger.warning("AFD %s: lost %s (%s); waiting up to %g s for it to return and pair again "
                   "(reform_timeout_s)", label, peer, cause, timeout_s)
    refused: BaseException | None = None
    while True:
        try:
            connector.reform(max(deadline - time.monotonic(), MIN_ATTEMPT_S))
            break
        except (AFDConfigMismatchError, AFDLayoutError, AFDProtocolError) as exc:
            refused = exc
            logger.error("AFD %s: refused a returning %s: %s; still waiting", label, peer.removeprefix("the "), exc)
        except AFDRendezvousTimeout as exc:
            raise _gave_up(label, peer, timeout_s, cause, refused, then) from exc
        except AFDPeerLostError as exc:  # the store vanished or froze mid-attempt (a re-forming or stopped host)
            logger.warning("AFD %s: lost the store while pairing again (%s); still waiting", label, exc)
            time.sleep(min(RETRY_PAUSE_S, max(deadline - time.monotonic(), 0.0)))
        if time.monotonic() >= deadline:
            raise _gave_up(label, peer, timeout_s, cause, refused, then) from refused
    took = time.monotonic() - started
    placement = connector.placement
    peers = list(placement.attention_peers) if placement.role is Role.FFN else [placement.subgroup]
    logger.info("AFD %s: paired again with %s ranks %s after %.1f s (re-formation %d)", label,
                peer.removeprefix("the "), peers, took, connector.reformations)
    return took


def _gave_up(label: str, peer: str, timeout_s: float, cause: BaseException, refused: BaseException | None,
             then: str) -> AFDRendezvousTimeout:
    returned = "" if refused is None else f" (one returned but was refused: {refused})"
    return AFDRendezvousTimeout(
        f"AFD {label}: {peer} did not return with an agreeing handshake within reform_timeout_s="
        f"{timeout_s:g} after {cause}{returned}; {then}")
