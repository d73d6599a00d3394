"""Exception types of the AFD overlay.

Every class keeps the builtin base the spec names (AFD_SPEC.md §3.6-3.8, §4.3, §8), so callers that
only know builtin exceptions (vLLM's engine, the API server, plain ``except ValueError``) still classify
them correctly. ``AFDError`` is a marker mixin on top, for callers that want "any AFD failure" in one
``except`` clause.

NOTE: ``AFDRendezvousTimeout`` is a ``RuntimeError`` and deliberately *not* a ``TimeoutError``:
``TimeoutError`` is an ``OSError``, and the rendezvous client retries its connection on ``OSError``
until the deadline; a timeout that is itself an ``OSError`` could be swallowed by that very loop.
"""

from __future__ import annotations

__all__ = [
    "AFDConfigMismatchError",
    "AFDError",
    "AFDLayoutError",
    "AFDPeerLostError",
    "AFDProtocolError",
    "AFDRendezvousTimeout",
    "AFDStepTimeoutError",
]


class AFDError(Exception):
    """Marker base of every AFD exception; never raised on its own."""


class AFDProtocolError(AFDError, RuntimeError):
    """A peer sent bytes or a message sequence this rank cannot interpret (§4.3, §6.4)."""


class AFDRendezvousTimeout(AFDError, RuntimeError):
    """Rendezvous and handshake did not finish within ``rendezvous_timeout_s`` (§3.6)."""


class AFDConfigMismatchError(AFDError, ValueError):
    """Two ranks disagree on the model or on AFD settings (handshake, §3.7)."""


class AFDLayoutError(AFDError, ValueError):
    """The DP x TP layouts of the two roles would feed FFN TP peers different tokens (§3.5)."""


class AFDPeerLostError(AFDError, RuntimeError):
    """A data or control peer stopped heartbeating or its store connection broke (§3.8)."""


class AFDStepTimeoutError(AFDError, RuntimeError):
    """One step's traffic did not complete within ``step_timeout_s`` (§3.8)."""
