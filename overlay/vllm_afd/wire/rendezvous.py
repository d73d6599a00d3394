"""Rendezvous of all F + A ranks at one TCP store hosted by FFN rank 0 (docs/connection.md#rendezvous).

Steps, all bounded by one deadline (``rendezvous_timeout_s``): FFN rank 0 listens, the others connect
with retry (wire/store.py); every rank claims its ``(role, role_rank)`` atomically; every rank publishes
its fingerprint with its pairing proof (wire/auth.py), waits for all others, checks the proofs and
compares (``AFDConnector.init`` in wire/connector.py runs the steps, between them opening the watchdog's
own connection); a pairing refused for its proofs starts over on a fresh store until the deadline
(wire/refusal.py). Groups built later are key prefixes of this store (no derived ports), so FFN ranks
may span hosts.
torch.distributed is imported lazily, at the first store operation.
"""

from __future__ import annotations

import datetime
import functools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from vllm_afd.role import Role
from vllm_afd.wire.auth import PairingProof, Secret
from vllm_afd.wire.errors import AFDAuthenticationError, AFDRendezvousTimeout
from vllm_afd.wire.handshake import Fingerprint, compare_fingerprints
from vllm_afd.wire.placement import Placement
from vllm_afd.wire.refusal import (REFUSAL_BACKOFF_S, REFUSED_KEY, last_refusal, leave_refused_store,
                                   peer_refused_error, refusal_text)
from vllm_afd.wire.store import (POLL_INTERVAL_S, STALE_CLAIM_POLL_S, call_within, connect_client, host_store,
                                 rank_key, store_frozen_error, store_lost_error)

__all__ = ["Rendezvous", "RendezvousSpec"]

# While waiting (for the store, or for other ranks' fingerprints), one INFO line per this many seconds.
WAIT_LOG_INTERVAL_S = 10.0
# The roles in AFD rank order (FFN first), as messages list ranks.
AFD_ROLE_ORDER = (Role.FFN, Role.ATTENTION)
# Store counter: ranks that read every fingerprint of this pairing; after a refused comparison the store host
# keeps the store until all have, this long at most.
COMPARED_KEY = "afd/compared"
COMPARE_GRACE_S = 2.0

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RendezvousSpec:
    """Who this rank is and where the store lives."""

    # This rank's role, rank, A and F.
    placement: Placement
    # Address and port of FFN rank 0's store.
    host: str
    port: int
    # Bound on rendezvous, handshake and channel creation, in seconds.
    timeout_s: float
    # How long a claim held by another process is given to turn out stale (its holder died and FFN
    # rank 0 re-hosts the store) before it counts as a duplicate; 0: a duplicate at once.
    stale_claim_s: float = 0.0
    # FFN rank 0: how long to retry binding a port still held by its previous store (a re-formation).
    rebind_s: float = 0.0
    # Bound on each store call (the connector passes peer_timeout_s): one that does not return is a stopped,
    # stuck or cut-off store host, ``AFDPeerLostError`` (wire/store.py call_within).
    call_timeout_s: float = 30.0

    @property
    def role(self) -> str:
        return self.placement.role

    @property
    def role_rank(self) -> int:
        return self.placement.role_rank

    @property
    def is_store_host(self) -> bool:
        """FFN rank 0 hosts the store."""
        return self.placement.afd_rank == 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def identity(self) -> str:
        return f"role={self.role}, role_rank={self.role_rank}"

    @property
    def label(self) -> str:
        """``"<role> rank <role_rank>"``, as log lines name this rank."""
        return f"{self.role} rank {self.role_rank}"

    def all_ranks(self) -> list[tuple[Role, int]]:
        """Every (role, role_rank), FFN first (AFD rank order)."""
        return [(Role.FFN, k) for k in range(self.placement.num_ffn_ranks)] + [
            (Role.ATTENTION, j) for j in range(self.placement.num_attention_ranks)
        ]


class Rendezvous:
    """One rank's rendezvous; ``store`` is set once connected and stays owned by the caller."""

    def __init__(
        self,
        spec: RendezvousSpec,
        clock: Callable[[], float] = time.monotonic,
        cancelled: Callable[[], bool] = lambda: False,
        log_interval_s: float = WAIT_LOG_INTERVAL_S,
        sleep: Callable[[float], None] = time.sleep,
        failed: Callable[[], None] = lambda: None,
    ) -> None:
        self.spec = spec
        self._clock = clock
        self._sleep = sleep
        self._cancelled = cancelled
        # Raises a failure the watchdog recorded while this rank waits (its heartbeat runs from the claim on): a
        # peer lost mid-rendezvous ends the wait at once instead of the termination fallback.
        self._failed = failed
        self._log_interval_s = log_interval_s
        self.deadline = clock() + spec.timeout_s
        self._next_log = self.deadline - spec.timeout_s + log_interval_s
        self._next_refusal_log = self._next_log - log_interval_s
        self._rebind_s = spec.rebind_s
        self.store: Any = None
        # The last pairing refused for its proofs (AFDAuthenticationError); timeout messages name it.
        self.refused: AFDAuthenticationError | None = None
        self._claimed = False  # this rank holds its claim in ``store`` (leave() withdraws it)

    def remaining_s(self) -> float:
        return max(0.0, self.deadline - self._clock())

    def _log_waiting(self, waiting_for: str, stage: str) -> None:
        """One INFO line per interval, so an operator sees what a silent rank waits for, and since when."""
        now = self._clock()
        if now < self._next_log:
            return
        self._next_log = now + self._log_interval_s
        spec = self.spec
        elapsed = spec.timeout_s - max(0.0, self.deadline - now)
        logger.info("AFD %s: waiting for %s at %s (%s, %.0f s of %g s)", spec.label, waiting_for, spec.address,
                    stage, elapsed, spec.timeout_s)

    # ---- steps ----------------------------------------------------------------------------------

    def connect(self) -> Any:
        """FFN rank 0 listens and hosts the store; every other rank connects, retrying until the deadline."""
        spec = self.spec
        if spec.is_store_host:
            self.store = host_store(spec.host, spec.port, self._rebind_s, self.remaining_s, self._clock, self._sleep)
        else:
            self.store = self.connect_client()
        return self.store

    def connect_client(self) -> Any:
        """A new client connection to the store (wire/store.py), retrying until the deadline; one INFO line
        per interval says what this rank waits for."""
        return connect_client(self.spec.host, self.spec.port, self.remaining_s, self._wait_for_store)

    def _wait_for_store(self, last_error: BaseException) -> None:
        self._check_cancelled()
        if self.remaining_s() <= 0.0:
            raise self._unreachable_error(f"last error: {last_error}")
        self._log_waiting("FFN rank 0 (the rendezvous store)", "rendezvous")
        self._sleep(min(0.1, self.remaining_s()))

    def claim(self) -> bool:
        """Claim ``(role, role_rank)`` atomically; True once claimed.

        A claim already held is a duplicate (``ValueError`` on both sides) unless the store goes away
        within ``stale_claim_s``: then the holder was a process that died, the store's host (FFN rank 0)
        is re-forming, and the caller connects again and claims anew (False).
        """
        from torch.distributed import DistNetworkError

        count = self.store_call(lambda: self.store.add(self._own_key("claim"), 1))
        self._claimed = count == 1
        if count == 1:
            return True
        give_up = self._clock() + min(self.spec.stale_claim_s, self.remaining_s())
        logger.info("AFD %s: the claim of this rank is held at %s; waiting up to %.0f s for its holder's "
                    "store to be re-hosted (a restarted role), else this is a duplicate", self.spec.label,
                    self.spec.address, give_up - self._clock())
        while self._clock() < give_up:
            try:
                self._bounded(lambda: self.store.check([self._own_key("claim")]), "claim check")
            except DistNetworkError:  # FFN rank 0 dropped the old store: re-forming
                self.store = None
                return False
            self._check_cancelled()
            self._sleep(STALE_CLAIM_POLL_S)
        raise self._duplicate_error()

    def exchange_fingerprints(self, fingerprint: Fingerprint,
                              secret: Secret | None = None) -> dict[tuple[Role, int], Fingerprint]:
        """Nonces, then our fingerprint and its proof; wait for all F + A, check every proof (wire/auth.py),
        only then parse and compare (raises AFDAuthenticationError, AFDConfigMismatchError, AFDLayoutError)."""
        spec = self.spec
        ranks = spec.all_ranks()
        proof = PairingProof(secret, (spec.role, spec.role_rank), ranks, lambda kind, rank: rank_key(kind, *rank))
        self.store_call(lambda: self.store.set(self._own_key("nonce"), proof.nonce))
        nonce_keys = [rank_key("nonce", role, rank) for role, rank in ranks]
        self.wait_for_keys(nonce_keys, "waiting for the other ranks' nonces", log_stage="handshake", refusals=True)
        published = fingerprint.to_json().encode()
        mac = proof.prove(self.store_call(lambda: self.store.multi_get(nonce_keys)), published)
        self.store_call(lambda: self.store.set(self._own_key("proof"), mac))
        self.store_call(lambda: self.store.set(self._own_key("fingerprint"), published))
        proof_keys = [rank_key("proof", role, rank) for role, rank in ranks]
        keys = [rank_key("fingerprint", role, rank) for role, rank in ranks]
        self.wait_for_keys(proof_keys + keys, "waiting for the other ranks' fingerprints", log_stage="handshake",
                           refusals=True)
        values = self.store_call(lambda: self.store.multi_get(proof_keys + keys))
        self.store_call(lambda: self.store.add(COMPARED_KEY, 1))
        proof.verify(values[:len(ranks)], values[len(ranks):])
        fingerprints = {rank: Fingerprint.from_json(value) for rank, value in zip(ranks, values[len(ranks):])}
        try:
            compare_fingerprints(fingerprint, fingerprints.values())
        except ValueError:  # AFDConfigMismatchError, AFDLayoutError
            self._linger_until_compared(len(ranks))
            raise
        return fingerprints

    def _linger_until_compared(self, num_ranks: int) -> None:
        """Store host, after a refused comparison: keep the store until every rank has read the fingerprints
        (``COMPARED_KEY``), at most ``COMPARE_GRACE_S``, so each names the mismatch itself instead of losing the
        store in the middle of its reads."""
        if not self.spec.is_store_host:
            return
        until = self._clock() + COMPARE_GRACE_S
        while self.store_call(lambda: self.store.add(COMPARED_KEY, 0)) < num_ranks and self._clock() < until:
            self._sleep(POLL_INTERVAL_S)

    def refuse(self, refusal: AFDAuthenticationError) -> None:
        """Leave a pairing refused for its proofs (wire/refusal.py) so that a new one can start on a fresh
        store: the store host drops this one and hosts the next (``connect()``) after ``REFUSAL_BACKOFF_S``."""
        self.refused = last_refusal(self.refused, refusal)
        if self._clock() >= self._next_refusal_log:
            self._next_refusal_log = self._clock() + self._log_interval_s
            logger.error("AFD %s: refused the pairing at %s: %s; still waiting for ranks that authenticate "
                         "(until rendezvous_timeout_s / reform_timeout_s)", self.spec.label, self.spec.address, refusal)
        leave_refused_store(self.store, self.spec.is_store_host, len(self.spec.all_ranks()), self._clock,
                            self._sleep, self._check_cancelled,
                            lambda: self._check_deadline("waiting for a pairing that authenticates"),
                            self.spec.call_timeout_s)
        self.store = None
        self._claimed = False
        if self.spec.is_store_host:
            self._rebind_s = max(self._rebind_s, REFUSAL_BACKOFF_S + STALE_CLAIM_POLL_S)
            self._sleep(min(REFUSAL_BACKOFF_S, self.remaining_s()))

    def leave(self) -> None:
        """Withdraw this rank's claim from a store it leaves without pairing (a timeout, a failure), best
        effort: a rank restarted in its place can claim at once, and the ranks still waiting refuse the
        mixed pairing and start over, instead of waiting for the departed rank until their deadline."""
        if self.store is None or not self._claimed or self.spec.is_store_host:
            return
        self._claimed = False
        store, key = self.store, self._own_key("claim")
        try:
            store.set_timeout(datetime.timedelta(seconds=1.0))
            self._bounded(lambda: store.delete_key(key), "claim withdrawal")
        except RuntimeError:  # DistStoreError, DistNetworkError, AFDPeerLostError: the store is gone or stuck
            pass

    def wait_for_channels(self) -> None:
        """Announce this rank's channels ready, then wait until every rank's are.

        So ``init()`` returns on no rank before the pairing is complete on all: a healed attention
        rank that admitted a step while another rank of its server still mapped its channels would
        wait in that step's tensor-parallel collective for a rank that fails it (docs/connection.md#rendezvous).
        """
        self.store_call(lambda: self.store.set(self._own_key("ready"), b"1"))
        keys = [rank_key("ready", role, rank) for role, rank in self.spec.all_ranks()]
        self.wait_for_keys(keys, "waiting for the other ranks' channels")

    def wait_for_keys(self, keys: list[str], stage: str, log_stage: str | None = None, refusals: bool = False) -> None:
        """Poll until every key exists; our own claim is re-checked so a late duplicate fails us too.

        With ``log_stage``, one line per interval names the ranks that have not claimed yet; with ``refusals``,
        another rank's refusal of this pairing (``refuse()``) is ours too: ``PeerRefusedError``.
        """
        while True:
            complete = self.store_call(lambda: self.store.check(keys))
            if self.store_call(lambda: self.store.add(self._own_key("claim"), 0)) > 1:
                self._claimed = False  # NOTE: the key is shared with the other claimant: never withdraw it
                raise self._duplicate_error()
            if complete:
                return  # NOTE: before a relayed refusal, so a rank with every value finds its own reason
            if refusals and self.store_call(lambda: self.store.check([REFUSED_KEY])):
                raise peer_refused_error(self.spec.label)
            self._failed()
            self._check_cancelled()
            self._check_deadline(stage)
            if log_stage is not None and self._clock() >= self._next_log:
                self._log_waiting(self._missing_ranks_text(), log_stage)
            self._sleep(POLL_INTERVAL_S)

    def _missing_ranks_text(self) -> str:
        """``"ffn [1], attention [2 3]"``: the ranks whose claim is not in the store yet."""
        missing: dict[Role, list[int]] = {role: [] for role in AFD_ROLE_ORDER}
        for role, rank in self.spec.all_ranks():
            if not self.store_call(functools.partial(self.store.check, [rank_key("claim", role, rank)])):
                missing[role].append(rank)
        return _format_ranks(missing, skip_empty=True) or "the last ranks' fingerprints"

    # ---- errors ---------------------------------------------------------------------------------

    def _check_cancelled(self) -> None:
        if self._cancelled():
            raise RuntimeError(
                f"AFD rendezvous at {self.spec.address} ({self.spec.identity}) cancelled: the connector was "
                "closed while waiting; expected no close() before AFDConnector.init() returns"
            )

    def _check_deadline(self, stage: str) -> None:
        if self.remaining_s() <= 0.0:
            raise self.timeout_error(stage)

    def timeout_error(self, stage: str) -> AFDRendezvousTimeout:
        """The timeout of docs/connection.md#rendezvous: who joined, who is missing (from the claims)."""
        spec = self.spec
        joined: dict[Role, list[int]] = {role: [] for role in AFD_ROLE_ORDER}
        missing: dict[Role, list[int]] = {role: [] for role in AFD_ROLE_ORDER}
        if self.store is None:
            return self._unreachable_error(f"not connected while {stage}")
        try:
            for role, rank in spec.all_ranks():
                present = self.store.check([rank_key("claim", role, rank)])
                (joined if present else missing)[role].append(rank)
        except RuntimeError as exc:  # the store itself went away: report what we know
            return self._unreachable_error(f"lost while {stage}: {exc}")
        missing_text = _format_ranks(missing, skip_empty=True) or f"none (stalled while {stage})"
        return AFDRendezvousTimeout(
            f"AFD rendezvous timed out after {spec.timeout_s:g}s at {spec.address} ({spec.identity}); "
            f"joined: {_format_ranks(joined, skip_empty=False)}; missing: {missing_text}. Start the "
            f"other role with the same host/port/topology, or raise rendezvous_timeout_s{refusal_text(self.refused)}"
        )

    def _unreachable_error(self, detail: str) -> AFDRendezvousTimeout:
        spec = self.spec
        return AFDRendezvousTimeout(
            f"AFD rendezvous timed out after {spec.timeout_s:g}s at {spec.address} ({spec.identity}): "
            f"cannot reach the AFD rendezvous store at {spec.address} (hosted by FFN rank 0) "
            f"({detail}). Start the other role with the same host/port/topology, or raise "
            f"rendezvous_timeout_s{refusal_text(self.refused)}"
        )

    def _duplicate_error(self) -> ValueError:
        spec = self.spec
        return ValueError(
            f"AFD rank ({spec.identity}) joined twice; check DP/TP sizes and that only one deployment "
            f"uses {spec.address}"
        )

    # ---- store plumbing -------------------------------------------------------------------------

    def _own_key(self, kind: str) -> str:
        return rank_key(kind, self.spec.role, self.spec.role_rank)

    def store_call(self, call: Callable[[], Any]) -> Any:
        """Run one store operation within ``call_timeout_s``; a broken connection means FFN rank 0 (the host)
        is gone, a call that does not return that it is stopped or cut off (``AFDPeerLostError`` both).  The
        connector's own calls on this store go through it too (the attention's start-up flag)."""
        from torch.distributed import DistNetworkError

        try:
            return self._bounded(call, "store call")
        except DistNetworkError as exc:
            raise store_lost_error(self.spec.address, self.spec.role, self.spec.role_rank, exc) from exc

    def _bounded(self, call: Callable[[], Any], what: str) -> Any:
        """``call()`` within ``call_timeout_s``; past it the store is lost: never called again, no claim withdrawn."""
        spec = self.spec

        def expired() -> BaseException:
            self._claimed = False  # NOTE: leave() must not call a store that stopped answering
            return store_frozen_error(spec.address, spec.label, what, spec.call_timeout_s)

        return call_within(call, spec.call_timeout_s, expired)


def _format_ranks(ranks: dict[Role, Iterable[int]], *, skip_empty: bool) -> str:
    """``{"ffn": [0], "attention": [0, 1]}`` -> ``"ffn [0], attention [0 1]"``."""
    parts = []
    for role in AFD_ROLE_ORDER:
        values = list(ranks.get(role, ()))
        if values or not skip_empty:
            parts.append(f"{role} [{' '.join(map(str, values))}]")
    return ", ".join(parts)

