"""``AFDConnector``: the link both ends of the AFD wire share, over any ``Transport``.

A rank holds one end, built by ``make_connector`` (ends.py) from ``placement.role``:
``AttentionConnector`` (attention_end.py: ``publish``, ``send_a2f``, ``recv_f2a``) or ``FFNConnector``
(ffn_end.py: ``next_step``, ``recv_a2f``, ``send_f2a``, ``wait_sends``); a role's calls do not exist on
the other end. This base owns what both share: rendezvous and handshake, re-forming and closing, the
step state each control payload sets (``_adopt``), the watchdog, the sticky failure and the timeline's
marks; what it exchanges and its bounds are the plain ``ConnectorSpec`` (spec.py), which also checks a
tensor's shape before any byte is sent. A transport only moves tensors (transport.py); exchanges are
positional, without tags (docs/protocol.md#one-exchange). Only the receives and the waits for issued
sends block, in (layer, stage) order on both ends, which makes k stages deadlock-free over rendezvous
transports (docs/pingpong.md#5-ordering-why-the-receives-cannot-deadlock); the watchdog times them.
Before ``init`` and after a release the watchdog is ``NULL_WATCHDOG``; without ``timeline_clock`` the
timeline is ``NULL_TIMELINE``: both are called unconditionally.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from vllm_afd.wire.auth import Secret, warn_unauthenticated_once
from vllm_afd.wire.errors import AFDAuthenticationError, AFDPeerLostError, AFDPeerProtocolError
from vllm_afd.wire.handshake import Fingerprint
from vllm_afd.wire.integrity import make_integrity
from vllm_afd.wire.messages import ControlPayload
from vllm_afd.wire.placement import Placement
from vllm_afd.wire.progress import make_progress
from vllm_afd.wire.rendezvous import Rendezvous, RendezvousSpec
from vllm_afd.wire.spec import ConnectorSpec
from vllm_afd.wire.steps import StepState
from vllm_afd.wire.store import call_within
from vllm_afd.wire.timeline import NULL_TIMELINE, NullTimeline, StepRecord, Timeline, make_timeline
from vllm_afd.wire.transport import SendHandle, Transport
from vllm_afd.wire.failure import FailureLatch, terminate_process
from vllm_afd.wire.watchdog import NULL_WATCHDOG, NullWatchdog, Watchdog, WatchdogSpec

__all__ = ["AFDConnector", "ConnectorSpec"]

# A data transfer's native bound once steps are timed: step_timeout_s plus this (the watchdog reports the
# late step first, with the ranks' names; the bound then releases the blocked wait).
TRANSFER_TIMEOUT_MARGIN_S = 5.0
# How long close() waits in total (watchdog thread, then the transport letting go), and for the watchdog.
CLOSE_JOIN_S = 5.0
WATCHDOG_JOIN_S = 1.0
# A claim held by another process is waited on this long beyond peer_timeout_s before it counts as a
# duplicate: long enough for FFN rank 0 to notice a dead holder and re-host the store (reform()).
STALE_CLAIM_MARGIN_S = 3.0
# A re-forming FFN rank 0 retries binding the store's port this long (the old store is still closing).
REBIND_S = 10.0
# Channel creation's bound from outside beyond what is left of the rendezvous (gloo's own bound reports first).
CHANNEL_OPEN_MARGIN_S = 5.0


class AFDConnector:
    """The link one rank's end shares with the other role; see the module docstring."""

    def __init__(
        self,
        spec: ConnectorSpec,
        placement: Placement,
        transport: Transport,
        fingerprint: Fingerprint,
        *,
        terminate: Callable[[BaseException], None] | None = terminate_process,
        new_transport: Callable[[], Transport] | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
        secret: Secret | None = None,
    ) -> None:
        self.spec = spec
        self.placement = placement
        self.transport = transport
        self.fingerprint = fingerprint
        self._terminate = terminate
        # Builds the fresh transport of a re-formation (reform()); None: this connector cannot re-form.
        self._new_transport = new_transport
        # Told each first failure at once, on the failing thread (connect.py: the attention's outage notice).
        self._on_failure = on_failure
        # The shared secret every pairing proves (wire/auth.py); None: unauthenticated, as before.
        self._secret = secret
        self._latch = FailureLatch(transport.abort, terminate, on_failure=on_failure)
        self._lock = threading.Lock()
        self._initialized = self._initializing = self._closed = False
        self._store: Any = None
        # init()'s Watchdog while paired; NULL_WATCHDOG before init() and after a release.
        self._watchdog: Watchdog | NullWatchdog = NULL_WATCHDOG
        # Built by init(): a Timeline when spec.timeline_clock is set, else NULL_TIMELINE (``timeline.enabled``).
        self.timeline: Timeline | NullTimeline = NULL_TIMELINE
        # Pairings completed by reform() since construction (the first init() is not one).
        self.reformations = 0
        # True while reform() runs: the lost peer counts as lost until it pairs again (metrics).
        self.reforming = False
        # FFN rank 0: how long init() retries binding the store's port (0 at start-up: a busy port is an
        # error at once; REBIND_S in a re-formation, while the previous store closes).
        self._rebind_s = 0.0
        self._new_pairing()

    def _new_pairing(self) -> None:
        """Start what belongs to one pairing afresh (construction, reform()); each end adds its own."""
        self.steps = StepState(self.placement, self.spec.exchanges_per_stage, self.spec.name)
        self.integrity = make_integrity(self.spec.integrity, self.spec.name, self.spec.device)
        # One event per step on a CUDA device, polled by the watchdog (wire/progress.py); CPU: the null object.
        self.progress = make_progress(self.spec.device)
        self.fingerprints: dict[tuple[str, int], Fingerprint] = {}
        self._transport_syncs = 0  # transport.host_syncs already counted into the timeline
        # Seconds init() took from its start to ready channels (rendezvous, handshake, channels).
        self.rendezvous_s: float | None = None

    def _announce(self, store: Any) -> None:
        """What this end tells a fresh store right after its claim (the attention's start-up flag)."""

    # ---- lifecycle ------------------------------------------------------------------------------

    @property
    def is_initialized(self) -> bool:
        return self._initialized and not self._closed and self._latch.failure is None

    def init(self, timeout_s: float | None = None) -> None:
        """Rendezvous, handshake, watchdog, channels; idempotent. A failure releases what was taken.

        Bounded by ``timeout_s`` (default ``rendezvous_timeout_s``). ``close()`` from another thread
        cancels a running init (the rendezvous polls for it) and never waits for it: the lock only
        guards the state flags.
        """
        s, p = self.spec, self.placement
        timeout_s = s.rendezvous_timeout_s if timeout_s is None else timeout_s
        with self._lock:
            if self._initialized:
                return
            if self._closed:
                raise RuntimeError(
                    f"{s.name}: init() after close(); expected a fresh connector. A store serves one AFD "
                    "run: restart both roles"
                )
            if self._initializing:
                raise RuntimeError(f"{s.name}: init() is already running on another thread; call it once")
            self._initializing = True
        started = time.monotonic()
        rendezvous = Rendezvous(
            RendezvousSpec(p, s.host, s.port, timeout_s, stale_claim_s=s.peer_timeout_s + STALE_CLAIM_MARGIN_S,
                           rebind_s=self._rebind_s, call_timeout_s=s.peer_timeout_s),
            cancelled=lambda: self._closed, failed=lambda: self._latch.check(),
        )
        if self._secret is None:
            warn_unauthenticated_once(f"{s.host}:{s.port}")
        try:
            watchdog_store = self._pair(rendezvous)
            watchdog = Watchdog(
                watchdog_store,
                WatchdogSpec(p, s.peer_timeout_s, s.step_timeout_s, f"{s.host}:{s.port}", s.startup_timeout_s),
                self._latch, progress=self.progress,
            )
            self._watchdog = watchdog
            watchdog.start()
            opening_s = max(rendezvous.remaining_s(), 0.1)
            try:
                # NOTE: group creation calls the store, and torch's client never times out against a stopped host
                # (a re-formation's FFN frozen meanwhile): bounded from outside, and polled for the failure the
                # watchdog records within peer_timeout_s (wire/store.py call_within).
                call_within(lambda: self.transport.open(self._store, p, opening_s), opening_s + CHANNEL_OPEN_MARGIN_S,
                            lambda: rendezvous.timeout_error("creating the data and control channels"),
                            poll=self._latch.check)
            except RuntimeError as exc:
                if rendezvous.remaining_s() < 0.5:  # group creation ran into the deadline
                    raise rendezvous.timeout_error("creating the data and control channels") from exc
                raise
            self._latch.check()  # a peer lost while the channels were built
            rendezvous.wait_for_channels()
            self.timeline = make_timeline(s.timeline_clock, p.role, p.role_rank, s.exchanges_per_stage, s.device)
            with self._lock:
                if self._closed:
                    raise RuntimeError(f"{s.name}: close() was called during init()")
                self._initialized = True
            self.rendezvous_s = time.monotonic() - started
        except BaseException:
            self._latch.close()  # the caller gets this exception: no termination fallback
            rendezvous.leave()
            # NOTE: the exception's traceback keeps this frame's rendezvous alive; without its store
            # reference FFN rank 0's store closes now, so a re-formation can listen on the port again.
            rendezvous.store = None
            self._release()
            raise
        finally:
            self._initializing = False

    def _pair(self, rendezvous: Rendezvous) -> Any:
        """Connect, claim, prove and compare until a pairing is accepted (or the deadline); returns the
        watchdog's store connection."""
        while True:
            self._store = rendezvous.connect()
            # NOTE: the watchdog's own connection is opened before the fingerprints are published: a
            # new TCPStore connection can stall for seconds, and a stall here delays every rank alike
            # instead of making this rank look silent to peers that already heartbeat.
            watchdog_store = rendezvous.connect_client()
            try:
                if rendezvous.claim():
                    rendezvous.store_call(lambda: self._announce(self._store))
                    self.fingerprints = rendezvous.exchange_fingerprints(self.fingerprint, self._secret)
                    return watchdog_store
                # Our claim was held by a dead process whose FFN rank 0 has now restarted the store.
            except AFDAuthenticationError as exc:
                # NOTE: refused, not fatal: a stray or misconfigured rank cannot end this rank's wait; the
                # deadline does. Our references go first, so FFN rank 0's store closes when refuse() drops it.
                self._store = watchdog_store = None
                rendezvous.refuse(exc)
            except AFDPeerLostError:
                if rendezvous.refused is None:
                    raise
                # After a refusal FFN rank 0 starts over on a fresh store, or gave up: connect until the deadline.
                rendezvous.store = None
            self._store = watchdog_store = None

    @property
    def can_reform(self) -> bool:
        return self._new_transport is not None and not self._closed

    def reform(self, timeout_s: float) -> None:
        """Pair again after a failure (docs/connection.md#re-forming): release the channels, the store
        and the watchdog, then rendezvous with a fresh transport, bounded by ``timeout_s``.

        Every rank re-forms, or none: FFN rank 0 re-hosts the store, so the ranks that did not lose a
        peer lose the store and re-form too. Step state, receive buffers and the timeline start anew;
        the failure is forgotten once the new pairing is ready. Raises what ``init()`` raises.
        """
        self.reforming = True  # NOTE: first, so an exchange racing this sees a lost peer, not "not initialized"
        try:
            with self._lock:
                if self._closed or self._new_transport is None:
                    why = "closed" if self._closed else "built without a transport factory"
                    raise RuntimeError(f"{self.spec.name}: reform() on a connector that is {why}; build it with "
                                       "vllm_afd.connect.build_connector")
                self._initialized = False
            self._latch.close()  # the old failure is handled here: no termination fallback
            self._release()
            self.transport = self._new_transport()
            self._latch = FailureLatch(self.transport.abort, self._terminate, on_failure=self._on_failure)
            self._new_pairing()  # step state, the lost pairing's sends, receive buffers, fingerprints
            self._rebind_s = REBIND_S  # the old store may still be closing
            self.init(timeout_s)
            self.reformations += 1
        finally:
            self.reforming = False

    def close(self) -> None:
        """Idempotent; safe uninitialised, during and after a partial init; bounded by CLOSE_JOIN_S."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._latch.close()
        self._release()

    def _release(self) -> None:
        started = time.monotonic()
        watchdog, self._watchdog = self._watchdog, NULL_WATCHDOG
        watchdog.stop(WATCHDOG_JOIN_S)
        closer = threading.Thread(target=self.transport.close, name="afd-close", daemon=True)
        closer.start()
        closer.join(max(0.0, CLOSE_JOIN_S - (time.monotonic() - started)))
        # NOTE: dropping the last reference stops FFN rank 0's store server; peers notice at once.
        self._store = None

    def take_records(self) -> list[StepRecord]:
        """Timeline records of the steps completed since the last call; [] with the timeline off."""
        return self.timeline.take_records()

    # ---- failure --------------------------------------------------------------------------------

    def check_failed(self) -> None:
        """Raise the sticky failure (lost peer, step timeout, transport error), if any."""
        self._latch.check()

    def fail(self, exc: BaseException) -> BaseException:
        """Record ``exc`` as this connector's failure unless one is recorded; return the sticky one."""
        return self._latch.fail(exc, observed=True)

    @property
    def failure(self) -> BaseException | None:
        return self._latch.failure

    # ---- helpers of both ends -------------------------------------------------------------------

    def _adopt(self, payload: ControlPayload) -> None:
        """Make ``payload`` this rank's step: rows per stage, the timeline's step, the watchdog's step."""
        self.steps.adopt(payload)
        self.integrity.start_step()
        self.timeline.open_step(payload, sum(stage.own_rows for stage in self.steps.stages.values()))
        watchdog = self._watchdog
        # NOTE: a FULL-graph replay runs its exchanges inside the graph: no step to count or time on the host;
        # the device event recorded here times everything enqueued before it (the previous step, a replay too).
        self.progress.record(payload.step_seq)
        watchdog.step_closed() if payload.is_graph_replaying else watchdog.step_opened(payload.step_seq)
        # A transfer that outlives its step (startup_timeout_s before steps are timed) is released by the
        # transport itself.
        self.transport.transfer_timeout_s = (
            self.spec.step_timeout_s if watchdog.armed else self.spec.startup_timeout_s) + TRANSFER_TIMEOUT_MARGIN_S

    def _require_ready(self, what: str) -> None:
        self._latch.check()
        s, p = self.spec, self.placement
        if self.reforming:
            raise AFDPeerLostError(f"{s.name}.{what}: {p.label} is pairing again after a lost peer; this exchange "
                                   "cannot run (docs/connection.md#healing-attention)")
        if not self._initialized or self._closed:
            state = "closed" if self._closed else "not initialized"
            raise RuntimeError(
                f"{s.name}.{what}: the AFD connector is {state}; expected an initialised connector. "
                "Call init() first (a closed connector cannot be reused)"
            )

    def _count_exchange(self) -> None:
        host_syncs = self.transport.host_syncs
        self.timeline.count_host_sync(host_syncs - self._transport_syncs)
        self._transport_syncs = host_syncs
        if self.steps.count_exchange():
            self.progress.record(self.steps.payload.step_seq)  # the step's own device work, once enqueued
            self._watchdog.step_closed()
            self.timeline.step_closed()

    def _mark(self, kind: str, position: int | None = None) -> None:
        """Stamp the timeline at exchange ``position`` (default: the exchanges finished in this step)."""
        self.timeline.mark(kind, self.steps.num_exchanges if position is None else position)

    def _check_seal(self, channel: str, src: int, tensors: tuple[Any, ...], stage: int, label: str, peer: int) -> None:
        """Integrity mode: receive the seal that follows ``tensors`` on ``channel`` from group rank ``src`` and
        check it; a bad one is the sticky failure (a lost peer). Off: nothing."""
        received = self.integrity.blanks()
        if not received:
            return
        for seal in received:
            self._call(label, peer, self.transport.recv, channel, seal, src)
        self._verify_seal(received, channel, tensors, stage, label, peer)

    def _check_posted_seal(self, channel: str, seals: list[Any], tensors: tuple[Any, ...], stage: int, label: str,
                           peer: int) -> None:
        """Integrity mode: wait the seal receives posted after ``tensors`` and check them (as ``_check_seal``).
        Off: nothing (no seal was posted)."""
        if seals:
            self._verify_seal([self._call(label, peer, handle.wait) for handle in seals], channel, tensors, stage,
                              label, peer)

    def _verify_seal(self, received: list[Any], channel: str, tensors: tuple[Any, ...], stage: int, label: str,
                     peer: int) -> None:
        """Check received seals against ``tensors``; a bad one is the sticky failure (a lost peer)."""
        exchange = self.integrity.next_position(f"recv {channel} {peer}")
        try:
            self.integrity.check(received, self.steps.payload.step_seq, exchange, stage, tensors, f"{label} {peer}")
        except AFDPeerProtocolError as exc:
            raise self._latch.fail(exc, observed=True) from None

    def _wait_sends(self, handles: list[SendHandle], label: str, peer: int) -> None:
        """Wait for issued sends, timed as transfers (the peer must post its receives)."""
        for handle in handles:
            self._call(label, peer, handle.wait)

    def _call(self, label: str, peer: int, method: Callable[..., Any], *args: Any, timed: bool = True) -> Any:
        """One transport call; a transport error becomes the sticky AFDPeerLostError naming the peer."""
        # NOTE: the watchdog and latch this transfer started with, even if a re-formation swaps them: a late
        # error of the old channels must not fail the new pairing.
        watchdog, latch = self._watchdog, self._latch
        if timed:
            watchdog.transfer_started(f"{label} {peer}")
        try:
            return method(*args)
        except RuntimeError as exc:
            if self._closed:
                raise RuntimeError(f"{self.spec.name}: {label} {peer} interrupted by close() ({exc})") from exc
            lost = AFDPeerLostError(
                f"AFD peer lost: {label} {peer} failed on {self.placement.label} ({exc}); the peer process died or "
                "closed its connections. Check the other role's log; restart the lost role: the other waits for "
                "it (reform_timeout_s, docs/operations.md)"
            )
            raise latch.fail(lost, observed=True) from exc
        finally:
            if timed:
                watchdog.transfer_finished()
