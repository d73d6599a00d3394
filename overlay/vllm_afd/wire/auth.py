"""Authenticated pairing (docs/security.md#the-pairing-proof): every rank proves it holds the deployment's
shared secret before any peer's fingerprint is trusted.

The rendezvous store is readable and writable by whoever reaches ``host:port``, so only nonces and MACs
cross it, never the secret. Per rendezvous, every rank (1) publishes a fresh random nonce, or ``none``
without a secret; (2) once every nonce is in, publishes HMAC-SHA256(secret, transcript), the transcript
naming the protocol, every rank's nonce in AFD rank order, the prover's ``(role, role_rank)`` and the
fingerprint bytes it publishes; (3) checks every peer's MAC against its own view of the nonces, whose own
slot is the nonce it drew itself. So a proof recorded in an earlier rendezvous (another nonce), made for
another rank or over another fingerprint does not verify. Both roles must agree on whether a secret is
used: a rank with one refuses a peer without, and the other way round.

The secret is read by ``vllm_afd.config.secret`` (the environment variable or ``secret_file``); this
module only uses it. Pure Python: no torch, no vLLM, no socket;
``Rendezvous.exchange_fingerprints`` (rendezvous.py) drives ``PairingProof`` over the store.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_afd.config.secret import SECRET_ENV
from vllm_afd.wire.errors import AFDAuthenticationError, AFDProtocolError

__all__ = [
    "AUTH_FIX",
    "NO_SECRET",
    "PairingProof",
    "Secret",
    "warn_unauthenticated_once",
]

NONCE_BYTES = 32
# What a rank without a secret publishes as its nonce and its proof.
NO_SECRET = b"none"
# A nonce (32 bytes) and a MAC (SHA-256) as the store carries them: 64 lowercase hex digits.
_HEX64 = re.compile(rb"[0-9a-f]{64}")
TRANSCRIPT_TAG = b"vllm-afd pairing v1"
AUTH_FIX = "authentication failed: check VLLM_AFD_SECRET / secret_file on both roles"

logger = logging.getLogger(__name__)
_warned_lock = threading.Lock()
_warned = False


@dataclass(frozen=True, slots=True, eq=False)
class Secret:
    """The deployment's shared secret; its bytes never appear in a repr, a log line or the store."""

    # The secret itself (never shown).
    key: bytes = field(repr=False)
    # Where it came from, for messages: "VLLM_AFD_SECRET" or "secret_file <path>".
    source: str


def warn_unauthenticated_once(address: str) -> None:
    """One loud warning per process: without a secret, anyone who reaches the store can pair."""
    global _warned
    with _warned_lock:
        if _warned:
            return
        _warned = True
    logger.warning(
        "AFD: the control plane is UNAUTHENTICATED (neither %s nor secret_file is set): anything that reaches "
        "the rendezvous store at %s can pair with this server or stand in for its peer and receive its "
        "activations. Keep the AFD ports on a private network, or set a shared secret on both roles "
        "(docs/security.md)", SECRET_ENV, address)


def _shown(value: Any) -> str:
    """A store value for a message: its type, length and first bytes, never all of a huge one."""
    if isinstance(value, (bytes, bytearray)):
        return f"{bytes(value[:40])!r}{'…' if len(value) > 40 else ''} ({len(value)} bytes)"
    return f"a {type(value).__name__}"


class PairingProof:
    """One rank's side of the proof in one rendezvous; ``ranks`` lists every (role, role_rank), FFN first."""

    def __init__(self, secret: Secret | None, me: tuple[str, int], ranks: Sequence[tuple[str, int]],
                 key_of: Callable[[str, tuple[str, int]], str], *,
                 token_bytes: Callable[[int], bytes] = secrets.token_bytes) -> None:
        assert me in ranks, f"{me} is not one of the rendezvous' ranks {list(ranks)}"
        self.secret = secret
        self.me = me
        self.ranks = list(ranks)
        self._key_of = key_of  # ("nonce" | "proof", rank) -> its store key, for messages
        # This rendezvous' nonce (fresh per PairingProof), or NO_SECRET.
        self.nonce = NO_SECRET if secret is None else token_bytes(NONCE_BYTES).hex().encode()
        self._nonces: list[bytes] = []

    def prove(self, nonces: Sequence[Any], fingerprint: bytes) -> bytes:
        """Every rank's published nonce, in ``ranks`` order -> this rank's proof over ``fingerprint``.

        Raises ``AFDProtocolError`` for a value that is no nonce, ``AFDAuthenticationError`` when a rank
        and this one disagree on whether a secret is used.
        """
        parsed = [self._checked("nonce", rank, value, "a nonce of 64 lowercase hex digits or 'none'")
                  for rank, value in zip(self.ranks, nonces, strict=True)]
        # NOTE: our own slot is the nonce we drew, whatever the store says: the replay protection.
        self._nonces = [self.nonce if rank == self.me else value for rank, value in zip(self.ranks, parsed)]
        without = self.secret is None
        unlike = [rank for rank, value in zip(self.ranks, self._nonces) if (value == NO_SECRET) != without]
        if unlike:
            names = ", ".join(f"{role} rank {rank}" for role, rank in unlike)
            if self.secret is None:
                detail = f"{names} requires a shared secret and this rank has none"
            else:
                detail = f"{names} has no secret (runs without VLLM_AFD_SECRET / secret_file) while this rank has one"
            raise AFDAuthenticationError(f"AFD {self._label}: {AUTH_FIX} ({detail})")
        return NO_SECRET if self.secret is None else self._mac(self.me, fingerprint)

    def verify(self, proofs: Sequence[Any], fingerprints: Sequence[Any]) -> None:
        """Check every peer's proof over the fingerprint it published (both in ``ranks`` order); after ``prove``.

        Raises ``AFDProtocolError`` for a value that is no MAC, ``AFDAuthenticationError`` naming every
        peer whose MAC does not verify with this rank's secret.
        """
        if self.secret is None:
            return
        failed = []
        for rank, proof, fingerprint in zip(self.ranks, proofs, fingerprints, strict=True):
            if rank == self.me:
                continue
            given = self._checked("proof", rank, proof, "an HMAC-SHA256 of 64 lowercase hex digits")
            if not isinstance(fingerprint, (bytes, bytearray)):
                raise AFDProtocolError(f"AFD {self._label}: store key {self._key_of('fingerprint', rank)} holds "
                                       f"{_shown(fingerprint)}; expected the fingerprint's JSON bytes")
            if not hmac.compare_digest(self._mac(rank, bytes(fingerprint)), given):
                failed.append(f"{rank[0]} rank {rank[1]}")
        if failed:
            raise AFDAuthenticationError(
                f"AFD {self._label}: {AUTH_FIX} (the proof of {', '.join(failed)} does not verify with this rank's "
                f"secret from {self.secret.source}: the roles hold different secrets, or the proof was made for "
                "another rendezvous)")

    @property
    def _label(self) -> str:
        return f"{self.me[0]} rank {self.me[1]}"

    def _checked(self, kind: str, rank: tuple[str, int], value: Any, expected: str) -> bytes:
        if isinstance(value, (bytes, bytearray)) and (value == NO_SECRET or _HEX64.fullmatch(value)):
            return bytes(value)
        raise AFDProtocolError(f"AFD {self._label}: store key {self._key_of(kind, rank)} holds {_shown(value)}; "
                               f"expected {expected}. Something other than an AFD rank writes to the rendezvous "
                               "store: keep its port private (docs/security.md)")

    def _mac(self, prover: tuple[str, int], fingerprint: bytes) -> bytes:
        assert self.secret is not None and self._nonces, "prove() runs first, with a secret"
        lines = [TRANSCRIPT_TAG]
        lines += [f"nonce {role} {rank} ".encode() + nonce for (role, rank), nonce in zip(self.ranks, self._nonces)]
        lines.append(f"prover {prover[0]} {prover[1]}".encode())
        # NOTE: last, so its bytes (JSON, possibly with newlines) cannot shift the fields above.
        lines.append(b"fingerprint " + fingerprint)
        return hmac.new(self.secret.key, b"\n".join(lines), hashlib.sha256).hexdigest().encode()
