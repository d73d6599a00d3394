"""Exception types of the AFD overlay.

Every class keeps the builtin base its kind calls for (docs/failures.md#error-types), so callers that
only know builtin exceptions (vLLM's engine, the API server, plain ``except ValueError``) still classify
them correctly. ``AFDError`` is a marker mixin on top, for callers that want "any AFD failure" in one
``except`` clause.

NOTE: ``AFDRendezvousTimeout`` is a ``RuntimeError`` and deliberately *not* a ``TimeoutError``:
``TimeoutError`` is an ``OSError``, and the rendezvous client retries its connection on ``OSError``
until the deadline; a timeout that is itself an ``OSError`` could be swallowed by that very loop.
"""

from __future__ import annotations

__all__ = [
    "AFDAuthenticationError",
    "AFDConfigMismatchError",
    "AFDError",
    "AFDLayoutError",
    "AFDPeerLostError",
    "AFDPeerProtocolError",
    "AFDProtocolError",
    "AFDRendezvousTimeout",
    "AFDStepTimeoutError",
    "AFDWatchdogStalledError",
]


class AFDError(Exception):
    """Marker base of every AFD exception; never raised on its own."""


class AFDProtocolError(AFDError, RuntimeError):
    """A peer sent bytes or a message sequence this rank cannot interpret
    (docs/protocol.md#control-payload)."""


class AFDAuthenticationError(AFDProtocolError):
    """A rank did not prove it holds the shared secret, or the roles disagree on whether one is used
    (docs/security.md); refused like a mismatch, so the waiting role keeps waiting."""


class AFDRendezvousTimeout(AFDError, RuntimeError):  # noqa: N818 - a public name, in logs and docs
    """Rendezvous and handshake did not finish within ``rendezvous_timeout_s``
    (docs/connection.md#rendezvous)."""


class AFDConfigMismatchError(AFDError, ValueError):
    """Two ranks disagree on the model or on AFD settings (docs/connection.md#handshake)."""


class AFDLayoutError(AFDError, ValueError):
    """The DP x TP layouts of the two roles would feed FFN TP peers different tokens
    (docs/topology.md#layout-rule)."""


class AFDPeerLostError(AFDError, RuntimeError):
    """A data or control peer stopped heartbeating, its store connection broke, or a transfer to it
    failed (docs/connection.md#liveness)."""


class AFDPeerProtocolError(AFDProtocolError, AFDPeerLostError):
    """A paired peer sent what the protocol forbids (a count above ``max_rows``, a control frame whose CRC
    fails, a data message whose seal disagrees): handled as a lost peer, so the pairing re-forms
    (docs/security.md#what-is-validated)."""


class AFDStepTimeoutError(AFDError, RuntimeError):
    """One step's traffic did not complete within ``step_timeout_s`` (docs/connection.md#liveness)."""


class AFDWatchdogStalledError(AFDPeerLostError):
    """A rank's own liveness thread stopped ticking (stuck in a call, or dead), so nothing on it would be timed
    any more: handled as a lost peer, so the rank re-forms with a fresh watchdog (docs/connection.md#liveness)."""
