"""``AFDConnector``: one rank's end of the AFD wire, over any ``Transport``.

It owns everything the transports share: rendezvous and handshake, the step state each control
payload sets, the row checks that run before any byte is sent, the positional exchange order
(layer-major, stage-minor; hidden states then router logits on ``a2f``, the FFN output on
``f2a``), the control payload's length+bytes framing, the watchdog and the sticky failure. A
transport only moves tensors (transport.py). Exchanges are positional, without tags
(docs/protocol.md#one-exchange):

  attention (per layer, per stage)        FFN (per layer, per stage)
    send_a2f(stage, hidden[, logits])       recv_a2f(stage) from every peer, in subgroup order
    recv_f2a(stage, out)                    send_f2a(stage, output) split by the peers' rows
                                          FFN (end of the step): wait_sends()

Data sends never block on the peer (``Transport.isend``): the attention keeps one pending send per
stage and waits it in ``recv_f2a`` of that stage (the result lands in the tensor just sent); the FFN
keeps all of a step's and waits them in ``wait_sends``. Only those waits and the receives block, in
(layer, stage) order on both sides, which is what makes k stages deadlock-free over rendezvous
transports (docs/pingpong.md#5-ordering-why-the-receives-cannot-deadlock); the watchdog times them.

Control plane: the attention calls ``publish`` once per step (attention ranks < F transmit, the
others only adopt); the FFN calls ``next_step``, which receives and adopts the payload — the
only place its step state changes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_afd.wire.errors import AFDPeerLostError, AFDProtocolError
from vllm_afd.wire.handshake import Fingerprint
from vllm_afd.wire.messages import A2FBatch, ControlPayload, RoutingSpec
from vllm_afd.wire.placement import A2F, CONTROL, F2A, Placement
from vllm_afd.wire.rendezvous import Rendezvous, RendezvousSpec
from vllm_afd.wire.steps import StepState
from vllm_afd.wire.timeline import (
    A2F_RECV_END,
    A2F_RECV_START,
    A2F_SEND_END,
    A2F_SEND_START,
    F2A_RECV_END,
    F2A_SEND_END,
    F2A_SEND_START,
    StepRecord,
    Timeline,
)
from vllm_afd.wire.transport import SendHandle, Transport
from vllm_afd.wire.watchdog import STARTUP_DONE_KEY, FailureLatch, Watchdog, WatchdogSpec, terminate_process

__all__ = ["AFDConnector", "ConnectorSpec"]

# A control body longer than this is garbage, not a payload (a real one is well under 1 KiB per stage).
MAX_CONTROL_BYTES = 1 << 20
# A data transfer's native bound once steps are timed: step_timeout_s plus this (the watchdog reports the
# late step first, with the ranks' names; the bound then releases the blocked wait).
TRANSFER_TIMEOUT_MARGIN_S = 5.0
# How long close() waits in total (watchdog thread, then the transport letting go), and for the watchdog.
CLOSE_JOIN_S = 5.0
# Stages a step may have for the timeline's slots (micro-batching supports up to 3).
MAX_TIMELINE_STAGES = 4
WATCHDOG_JOIN_S = 1.0
# A claim held by another process is waited on this long beyond peer_timeout_s before it counts as a
# duplicate: long enough for FFN rank 0 to notice a dead holder and re-host the store (reform()).
STALE_CLAIM_MARGIN_S = 3.0
# A re-forming FFN rank 0 retries binding the store's port this long (the old store is still closing).
REBIND_S = 10.0


@dataclass(frozen=True, slots=True)
class ConnectorSpec:
    """What the connector exchanges and its bounds; plain values (vllm_afd/connect.py builds it)."""

    # Registered connector name, used in messages.
    name: str
    # Width and dtype of every exchanged row, and the device tensors live on.
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    # Store address (FFN rank 0) and the three bounds of docs/config.md.
    host: str
    port: int
    rendezvous_timeout_s: float
    step_timeout_s: float
    peer_timeout_s: float
    # Exchanges per stage of one step: the crossing layers (MoE layers only with the gate on attention).
    exchanges_per_stage: int
    # Router-logit width the attention sends with the gate on attention; None when it sends none.
    router_logits_width: int | None = None
    # FFN: persistent receive buffers keyed by (stage, peer, shape), for CUDA-graph replay.
    use_graph_buffers: bool = False
    # Largest rows one exchange carries per attention rank (vLLM's max_num_batched_tokens); sizes the
    # slots of a preallocating transport (P2pIpcAFDConnector). None where nothing is preallocated.
    max_rows: int | None = None
    # Which clock stamps the per-exchange timeline (docs/timeline.md): "host", "device", or None (off).
    timeline_clock: str | None = None
    # Micro-batch stages per step at most (the handshake's num_stages, docs/pingpong.md); a payload with
    # more is refused, and a preallocating transport sizes its slots by it.
    num_stages: int = 1


class AFDConnector:
    """One rank's side of the AFD wire; see the module docstring."""

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
    ) -> None:
        self.spec = spec
        self.placement = placement
        self.transport = transport
        self.fingerprint = fingerprint
        self.steps = StepState(placement, spec.exchanges_per_stage, spec.name)
        self.fingerprints: dict[tuple[str, int], Fingerprint] = {}
        self._terminate = terminate
        # Builds the fresh transport of a re-formation (reform()); None: this connector cannot re-form.
        self._new_transport = new_transport
        # Told each first failure at once, on the failing thread (connect.py: the attention's outage notice).
        self._on_failure = on_failure
        self._latch = FailureLatch(transport.abort, terminate, on_failure=on_failure)
        self._lock = threading.Lock()
        self._initialized = False
        self._initializing = False
        self._closed = False
        self._store: Any = None
        self._watchdog: Watchdog | None = None
        self._startup_flagged = False
        self._routing: set[RoutingSpec] = set()
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        # Built by init() when spec.timeline_clock is set; read through take_records().
        self.timeline: Timeline | None = None
        # Seconds init() took from its start to ready channels (rendezvous, handshake, channels).
        self.rendezvous_s: float | None = None
        # Pairings completed by reform() since construction (the first init() is not one).
        self.reformations = 0
        # True while reform() runs: the lost peer counts as lost until it pairs again (metrics).
        self.reforming = False
        # FFN rank 0: how long init() retries binding the store's port (0 at start-up: a busy port is an
        # error at once; REBIND_S in a re-formation, while the previous store closes).
        self._rebind_s = 0.0
        self._transport_syncs = 0  # transport.host_syncs already counted into the timeline
        # Attention: the issued a2f sends of each stage, waited by that stage's recv_f2a.
        self._pending_a2f: dict[int, list[SendHandle]] = {}
        # FFN: the issued f2a sends of the step, waited by wait_sends().
        self._pending_f2a: list[SendHandle] = []
        # Attention: the first failure an exchange deferred to the step gate in the current step.
        self._deferred: BaseException | None = None

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
                           rebind_s=self._rebind_s),
            cancelled=lambda: self._closed,
        )
        try:
            while True:
                self._store = rendezvous.connect()
                # NOTE: the watchdog's own connection is opened before the fingerprints are published: a
                # new TCPStore connection can stall for seconds, and a stall here delays every rank alike
                # instead of making this rank look silent to peers that already heartbeat.
                watchdog_store = rendezvous.connect_client()
                if rendezvous.claim():
                    break
                # Our claim was held by a dead process whose FFN rank 0 has now restarted the store.
                self._store = watchdog_store = None
            if self._startup_flagged:  # a re-formation: steps were timed before it, keep timing them
                self._store.add(STARTUP_DONE_KEY, 1)
            self.fingerprints = rendezvous.exchange_fingerprints(self.fingerprint)
            self._watchdog = Watchdog(
                watchdog_store, WatchdogSpec(p, s.peer_timeout_s, s.step_timeout_s, f"{s.host}:{s.port}"),
                self._latch,
            )
            self._watchdog.start()
            try:
                self.transport.open(self._store, p, max(rendezvous.remaining_s(), 0.1))
            except RuntimeError as exc:
                if rendezvous.remaining_s() < 0.5:  # group creation ran into the deadline
                    raise rendezvous.timeout_error("creating the data and control channels") from exc
                raise
            self._latch.check()  # a peer lost while the channels were built
            rendezvous.wait_for_channels()
            self.timeline = self._make_timeline()
            with self._lock:
                if self._closed:
                    raise RuntimeError(f"{s.name}: close() was called during init()")
                self._initialized = True
            self.rendezvous_s = time.monotonic() - started
        except BaseException:
            self._latch.close()  # the caller gets this exception: no termination fallback
            # NOTE: the exception's traceback keeps this frame's rendezvous alive; without its store
            # reference FFN rank 0's store closes now, so a re-formation can listen on the port again.
            rendezvous.store = None
            self._release()
            raise
        finally:
            self._initializing = False

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
        self.reforming = True
        try:
            self._reform(timeout_s)
        finally:
            self.reforming = False

    def _reform(self, timeout_s: float) -> None:
        s = self.spec
        with self._lock:
            if self._closed or self._new_transport is None:
                why = "closed" if self._closed else "built without a transport factory"
                raise RuntimeError(f"{s.name}: reform() on a connector that is {why}; build it with "
                                   "vllm_afd.connect.build_connector")
            self._initialized = False
        self._latch.close()  # the old failure is handled here: no termination fallback
        self._release()
        self.transport = self._new_transport()
        self._latch = FailureLatch(self.transport.abort, self._terminate, on_failure=self._on_failure)
        self.steps = StepState(self.placement, s.exchanges_per_stage, s.name)
        self._pending_a2f, self._pending_f2a = {}, []  # sends of the lost pairing
        self.fingerprints = {}
        self._buffers.clear()
        self._transport_syncs = 0
        self.rendezvous_s = None
        self._rebind_s = REBIND_S  # the old store may still be closing
        self.init(timeout_s)
        self.reformations += 1

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
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.stop(WATCHDOG_JOIN_S)
        closer = threading.Thread(target=self.transport.close, name="afd-close", daemon=True)
        closer.start()
        closer.join(max(0.0, CLOSE_JOIN_S - (time.monotonic() - started)))
        # NOTE: dropping the last reference stops FFN rank 0's store server; peers notice at once.
        self._store = None

    def take_records(self) -> list[StepRecord]:
        """Timeline records of the steps completed since the last call; [] with the timeline off."""
        return [] if self.timeline is None else self.timeline.take_records()

    def _make_timeline(self) -> Timeline | None:
        from vllm_afd.wire.clocks import DeviceClock, HostClock

        s, p = self.spec, self.placement
        if s.timeline_clock is None:
            return None
        # Slots for up to MAX_TIMELINE_STAGES stages of the widest exchange (4 FFN marks).
        capacity = 4 * s.exchanges_per_stage * MAX_TIMELINE_STAGES
        clock = DeviceClock(capacity, s.device) if s.timeline_clock == "device" else HostClock(capacity)
        return Timeline(p.role, p.role_rank, s.exchanges_per_stage, clock)

    def check_failed(self) -> None:
        """Raise the sticky failure (lost peer, step timeout, transport error), if any."""
        self._latch.check()

    def fail(self, exc: BaseException) -> BaseException:
        """Record ``exc`` as this connector's failure unless one is recorded; return the sticky one."""
        return self._latch.fail(exc, observed=True)

    def defer_failure(self, exc: BaseException) -> None:
        """Attention, inside a step: an exchange failed with ``exc``; the step gate raises it at the step's end."""
        if self._deferred is None:
            self._deferred = exc

    def take_step_failure(self) -> BaseException | None:
        """What the step gate must raise (and forget): a failure deferred in this step, the sticky failure, or
        a pairing that is not ready (a re-formation running in the background)."""
        deferred, self._deferred = self._deferred, None
        if self.is_initialized:
            return deferred
        return self._latch.failure or deferred or AFDPeerLostError(
            f"AFD peer lost: {self.placement.label}'s connector is pairing again after a lost peer; this step "
            "cannot run (docs/connection.md#healing-attention)")

    @property
    def failure(self) -> BaseException | None:
        return self._latch.failure

    def mark_startup_done(self) -> None:
        """Attention: profile, warm-up and capture are over; once all A ranks said so, steps are timed."""
        self._require_ready("mark_startup_done")
        if self.placement.role == "attention" and not self._startup_flagged:
            self._startup_flagged = True
            self._store.add(STARTUP_DONE_KEY, 1)

    # ---- control plane --------------------------------------------------------------------------

    def publish(self, counts_dp: Mapping[int, Sequence[int]], **flags: bool) -> ControlPayload:
        """Attention: open the step with each stage's tokens per attention DP rank; ranks < F transmit it."""
        self._require_ready("publish", "attention")
        payload = self.steps.new_payload(counts_dp, **flags)
        self._adopt(payload)
        p = self.placement
        if p.control_rank is not None:
            body = payload.encode()
            length = torch.tensor([len(body)], dtype=torch.int64)
            data = torch.frombuffer(bytearray(body), dtype=torch.uint8)
            dst = p.role_rank  # control group ranks are AFD ranks: FFN k is k
            self._call("control send to ffn rank", p.role_rank, self.transport.send, CONTROL, length, dst)
            self._call("control send to ffn rank", p.role_rank, self.transport.send, CONTROL, data, dst)
        return payload

    def next_step(self) -> ControlPayload:
        """FFN: block for the next step's payload and adopt it (an idle attention is legal: untimed)."""
        self._require_ready("next_step", "ffn")
        p = self.placement
        src = p.num_ffn_ranks + p.role_rank  # attention rank k's AFD rank
        length = torch.empty(1, dtype=torch.int64)
        label = "control receive from attention rank"
        self._call(label, p.role_rank, self.transport.recv, CONTROL, length, src, timed=False)
        num_bytes = int(length.item())
        self._require_ready("next_step")  # an abort may have left garbage behind
        if not 0 < num_bytes <= MAX_CONTROL_BYTES:
            raise AFDProtocolError(
                f"{self.spec.name}: control payload length {num_bytes} from attention rank {p.role_rank} is "
                f"not in 1..{MAX_CONTROL_BYTES}; expected the int64 byte length of "
                "docs/protocol.md#control-payload. Run the same vllm_afd version on both roles"
            )
        data = torch.empty(num_bytes, dtype=torch.uint8)
        self._call(label, p.role_rank, self.transport.recv, CONTROL, data, src, timed=False)
        payload = ControlPayload.decode(data.numpy().tobytes())
        if len(payload.stages) > self.spec.num_stages:
            raise AFDProtocolError(
                f"{self.spec.name}: control payload step {payload.step_seq} from attention rank {p.role_rank} has "
                f"{len(payload.stages)} stages {sorted(payload.stages)}; the handshake agreed on num_stages="
                f"{self.spec.num_stages}. Run the same vllm_afd version and num_stages on both roles"
            )
        self._adopt(payload)
        return payload

    def _adopt(self, payload: ControlPayload) -> None:
        self.steps.adopt(payload)
        if self.timeline is not None:
            self.timeline.open_step(payload, sum(stage.own_rows for stage in self.steps.stages.values()))
        if self.spec.use_graph_buffers and self.placement.role == "ffn":
            self._preallocate_buffers()
        watchdog = self._watchdog
        if watchdog is not None:
            # NOTE: a FULL-graph replay runs its exchanges inside the graph: no step to count or time.
            watchdog.step_closed() if payload.is_graph_replaying else watchdog.step_opened(payload.step_seq)
            # Once steps are timed, a transfer that outlives its step is released by the transport itself.
            self.transport.transfer_timeout_s = (
                self.spec.step_timeout_s + TRANSFER_TIMEOUT_MARGIN_S if watchdog.armed else None)

    # ---- data plane: attention ------------------------------------------------------------------

    def send_a2f(self, stage: int, hidden: torch.Tensor, router_logits: torch.Tensor | None = None) -> None:
        """Send this rank's rows of one (layer, stage) to its FFN rank: hidden states, then router logits."""
        self._require_ready("send_a2f", "attention")
        s, p = self.spec, self.placement
        own_rows = self.steps.stage(stage).own_rows
        self._check_tensor(hidden, "hidden states", s.hidden_size, s.dtype)
        if hidden.shape[0] != own_rows:
            raise ValueError(
                f"{s.name}: {p.label} sends {hidden.shape[0]} rows in stage {stage} but published "
                f"{own_rows}; publish the padded, >= 1 row count this rank sends"
            )
        if router_logits is not None:
            if s.router_logits_width is None:
                raise ValueError(
                    f"{s.name}: router logits given with compute_gate_on_attention=false; expected hidden "
                    "states only. Only MoE layers under compute_gate_on_attention=true send them"
                )
            self._check_tensor(router_logits, "router logits", s.router_logits_width, None)
            if router_logits.shape[0] != hidden.shape[0]:
                raise ValueError(
                    f"{s.name}: router logits have {router_logits.shape[0]} rows, hidden states "
                    f"{hidden.shape[0]}; pass this layer's logits"
                )
        label = "a2f send to ffn rank"
        self._wait_sends(self._pending_a2f.pop(stage, []), label, p.subgroup)  # a stage sent twice: misuse, but safe
        # NOTE: sends go out in E order (docs/pingpong.md#5-ordering-why-the-receives-cannot-deadlock), so the
        # n-th send of a step is exchange n; with stages it precedes the previous stage's receive, which is what
        # num_exchanges counts.
        position = self.steps.num_sends
        self._mark(A2F_SEND_START, position)
        pending = self._pending_a2f[stage] = []
        pending.append(self._call(label, p.subgroup, self.transport.isend, A2F, hidden.contiguous(), 0, timed=False))
        if router_logits is not None:
            pending.append(self._call(label, p.subgroup, self.transport.isend, A2F, router_logits.contiguous(), 0,
                                      timed=False))
        self._mark(A2F_SEND_END, position)
        self.steps.num_sends += 1

    def recv_f2a(self, stage: int, out: torch.Tensor) -> torch.Tensor:
        """Receive the FFN output of one (layer, stage) into ``out`` when it fits, else a new tensor."""
        self._require_ready("recv_f2a", "attention")
        s = self.spec
        own_rows = self.steps.stage(stage).own_rows
        if out.shape[0] != own_rows:
            raise ValueError(
                f"{s.name}: receive into {out.shape[0]} rows in stage {stage}; expected the published "
                f"{own_rows}. Pass the tensor just sent"
            )
        shape = (own_rows, s.hidden_size)
        fits = (tuple(out.shape) == shape and out.dtype == s.dtype and out.device == s.device
                and out.is_contiguous())
        target = out if fits else torch.empty(shape, dtype=s.dtype, device=s.device)
        # NOTE: the result lands in the tensor just sent, so that send must be complete first.
        self._wait_sends(self._pending_a2f.pop(stage, []), "a2f send to ffn rank", self.placement.subgroup)
        self._call("f2a receive from ffn rank", self.placement.subgroup, self.transport.recv, F2A, target, 0)
        self._mark(F2A_RECV_END)
        self._count_exchange()
        return target

    # ---- data plane: FFN ------------------------------------------------------------------------

    def recv_a2f(self, stage: int, routing: RoutingSpec | None = None) -> A2FBatch:
        """Receive one (layer, stage) from every attention peer in subgroup order, concatenated."""
        self._require_ready("recv_a2f", "ffn")
        s, p = self.spec, self.placement
        peer_rows = self.steps.stage(stage).peer_rows
        if routing is not None:
            self._routing.add(routing)
        hidden_parts, logit_parts = [], []
        self._mark(A2F_RECV_START)
        for group_rank, (peer, num_rows) in enumerate(zip(p.attention_peers, peer_rows), start=1):
            label = "a2f receive from attention rank"
            hidden = self._recv_buffer(stage, group_rank, num_rows, s.hidden_size, s.dtype)
            self._call(label, peer, self.transport.recv, A2F, hidden, group_rank)
            hidden_parts.append(hidden)
            if routing is not None:
                logits = self._recv_buffer(stage, group_rank, num_rows, routing.width, routing.dtype)
                self._call(label, peer, self.transport.recv, A2F, logits, group_rank)
                logit_parts.append(logits)
        self._mark(A2F_RECV_END)
        return A2FBatch(_concat(hidden_parts), _concat(logit_parts) if logit_parts else None, peer_rows)

    def send_f2a(self, stage: int, output: torch.Tensor) -> None:
        """Send each attention peer its rows of ``output`` (``[sum(peer_rows), hidden]``)."""
        self._require_ready("send_f2a", "ffn")
        s, p = self.spec, self.placement
        peer_rows = self.steps.stage(stage).peer_rows
        self._check_tensor(output, "FFN output", s.hidden_size, s.dtype)
        if output.shape[0] != sum(peer_rows):
            raise ValueError(
                f"{s.name}: FFN output has {output.shape[0]} rows in stage {stage}; expected "
                f"{sum(peer_rows)} (peers' rows {list(peer_rows)}). Pass the rows recv_a2f returned"
            )
        parts = output.split(list(peer_rows))
        self._mark(F2A_SEND_START)
        for group_rank, (peer, part) in enumerate(zip(p.attention_peers, parts), start=1):
            self._pending_f2a.append(self._call("f2a send to attention rank", peer, self.transport.isend, F2A,
                                                part.contiguous(), group_rank, timed=False))
        self._mark(F2A_SEND_END)
        self._count_exchange()

    def wait_sends(self) -> None:
        """FFN, end of a step: wait for every f2a send issued since the last call (its outputs may be reused)."""
        self._require_ready("wait_sends", "ffn")
        pending, self._pending_f2a = self._pending_f2a, []
        self._wait_sends(pending, "f2a send to attention ranks", self.placement.subgroup)

    # ---- helpers --------------------------------------------------------------------------------

    def _require_ready(self, what: str, role: str | None = None) -> None:
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
        if role is not None and p.role != role:
            raise RuntimeError(f"{s.name}.{what} is a {role}-side call, but this is {p.label}")

    def _count_exchange(self) -> None:
        if self.timeline is not None:
            syncs, self._transport_syncs = self.transport.host_syncs - self._transport_syncs, self.transport.host_syncs
            self.timeline.count_host_sync(syncs)
        if self.steps.count_exchange():
            if self._watchdog is not None:
                self._watchdog.step_closed()
            if self.timeline is not None:
                self.timeline.step_closed()

    def _mark(self, kind: str, position: int | None = None) -> None:
        """Stamp the timeline at exchange ``position`` (default: the exchanges finished in this step)."""
        if self.timeline is not None:
            self.timeline.mark(kind, self.steps.num_exchanges if position is None else position)

    def _wait_sends(self, handles: list[SendHandle], label: str, peer: int) -> None:
        """Wait for issued sends, timed as transfers (the peer must post its receives)."""
        for handle in handles:
            self._call(label, peer, handle.wait)

    def _call(self, label: str, peer: int, method: Callable[..., Any], *args: Any, timed: bool = True) -> Any:
        """One transport call; a transport error becomes the sticky AFDPeerLostError naming the peer."""
        watchdog = self._watchdog
        if timed and watchdog is not None:
            watchdog.transfer_started(f"{label} {peer}")
        try:
            return method(*args)
        except RuntimeError as exc:
            raise self._transport_failure(exc, f"{label} {peer}") from exc
        finally:
            if timed and watchdog is not None:
                watchdog.transfer_finished()

    def _transport_failure(self, exc: RuntimeError, what: str) -> BaseException:
        if self._closed:
            return RuntimeError(f"{self.spec.name}: {what} interrupted by close() ({exc})")
        lost = AFDPeerLostError(
            f"AFD peer lost: {what} failed on {self.placement.label} ({exc}); the peer process died or "
            "closed its connections. Check the other role's log; restart the lost role: the other waits for it "
            "(reform_timeout_s, docs/operations.md)"
        )
        return self._latch.fail(lost, observed=True)

    def _check_tensor(self, tensor: torch.Tensor, what: str, width: int | None, dtype: torch.dtype | None) -> None:
        s = self.spec
        problems = []
        if tensor.dim() != 2:
            problems.append(f"rank {tensor.dim()}, expected 2-D [rows, {width or 'width'}]")
        elif width is not None and tensor.shape[1] != width:
            problems.append(f"width {tensor.shape[1]}, expected {width}")
        if tensor.device != s.device:
            problems.append(f"device {tensor.device}, expected {s.device}")
        if dtype is not None and tensor.dtype != dtype:
            problems.append(f"dtype {tensor.dtype}, expected {dtype}")
        if problems:
            raise ValueError(
                f"{s.name}: {what} of shape {list(tensor.shape)} cannot be sent: {'; '.join(problems)}. "
                "Pass the model's [rows, hidden] tensor on the connector's device"
            )

    def _preallocate_buffers(self) -> None:
        """FFN with graph buffers: every receive buffer the adopted stages need, before any capture."""
        s = self.spec
        for stage, state in self.steps.stages.items():
            for group_rank, num_rows in enumerate(state.peer_rows, start=1):
                self._recv_buffer(stage, group_rank, num_rows, s.hidden_size, s.dtype)
                for routing in self._routing:
                    self._recv_buffer(stage, group_rank, num_rows, routing.width, routing.dtype)

    def _recv_buffer(self, stage: int, group_rank: int, num_rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        s = self.spec
        if not s.use_graph_buffers:
            return torch.empty((num_rows, width), dtype=dtype, device=s.device)
        key = (stage, group_rank, num_rows, width, dtype)
        buffer = self._buffers.get(key)
        if buffer is None:  # never evicted: a replayed graph finds the address it recorded
            buffer = self._buffers[key] = torch.empty((num_rows, width), dtype=dtype, device=s.device)
        return buffer


def _concat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
