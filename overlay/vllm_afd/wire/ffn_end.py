"""``FFNConnector``: the FFN's end of the AFD wire (the shared link: connector.py).

Per step the FFN blocks in ``next_step`` for the payload of its control peer, attention rank k (an
int64 header [length, CRC-32], then the bytes; docs/protocol.md#control-payload), checks it against
the handshake's bounds and adopts it: the only place its step state changes. Per (layer, stage)
``recv_a2f`` receives from every attention peer in subgroup order (each message's seal checked in
integrity mode, wire/integrity.py) and concatenates; ``send_f2a`` issues each peer its rows without
blocking, and ``wait_sends`` waits them all at the end of the step. With graph buffers every receive
lands in a persistent buffer per (stage, peer, shape), preallocated when a payload is adopted, so a replayed CUDA graph
finds the addresses it recorded (docs/protocol.md#step-state-and-receive-buffers). Over a bounded transport
(gloo) each receive is posted at the attention's ``max_rows`` rows instead, into two buffers per (stage, width,
dtype) of ``num_peers x max_rows`` rows used in turn (docs/protocol.md#bounds). Where the transport pre-posts
(gloo on CPU), an exchange's receives are posted as soon as the previous exchange's have completed, so the
attention's sends find them posted; with more than one peer into disjoint slots, joined by one copy
(docs/protocol.md#receive-order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_afd.wire.connector import AFDConnector
from vllm_afd.role import Role
from vllm_afd.wire.errors import AFDPeerLostError, AFDPeerProtocolError, AFDProtocolError
from vllm_afd.wire.handshake import DEFAULT_MAX_ROWS
from vllm_afd.wire.messages import (
    CONTROL_HEADER_WORDS,
    MAX_CONTROL_BYTES,
    A2FBatch,
    ControlPayload,
    RoutingSpec,
    control_length,
    read_control,
)
from vllm_afd.wire.placement import A2F, CONTROL, F2A
from vllm_afd.wire.timeline import A2F_RECV_END, A2F_RECV_START, F2A_SEND_END, F2A_SEND_START
from vllm_afd.wire.transport import RecvHandle, SendHandle

__all__ = ["CONTROL_HEADER_WORDS", "MAX_CONTROL_BYTES", "FFNConnector"]



class FFNConnector(AFDConnector):
    """One FFN rank's end; see the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Router-logit layouts recv_a2f was asked for: graph buffers are preallocated for them too.
        self._routing: set[RoutingSpec] = set()

    def _new_pairing(self) -> None:
        super()._new_pairing()
        # The issued f2a sends of the step, waited by wait_sends().
        self._pending_f2a: list[SendHandle] = []
        # Graph buffers by (stage, group rank, rows, width, dtype); a new pairing records its graphs anew.
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        # Bounded receives: by (stage, turn, width, dtype) a [num_peers * max_rows, width] buffer; peer j's
        # message is posted at max_rows rows right after the rows of peers < j, so the published rows end up
        # concatenated in place and a surplus is overwritten by the next peer's or lies past the batch.
        self._bounded: dict[tuple[Any, ...], torch.Tensor] = {}
        # Bounded receives: the turn (0 or 1) of each stage's last posted exchange.
        self._turns: dict[int, int] = {}
        # Bounded receives: the exchange whose receives are posted and not yet waited (prepost_receives), or None.
        self._posted_a2f: _PostedA2F | None = None

    # ---- control plane --------------------------------------------------------------------------

    def next_step(self) -> ControlPayload:
        """Block for the next step's payload, check it, adopt it (an idle attention is legal: untimed).

        Nothing from the peer is used before its check: the header's length bounds the body's receive, its
        CRC-32 the body, the handshake's num_stages the stages and the attention's max_rows every count, all
        before any buffer is sized by them. A violation is ``AFDPeerProtocolError``: a lost peer, re-formed.
        """
        self._require_ready("next_step")
        s, p = self.spec, self.placement
        if self._posted_a2f is not None:
            # NOTE: cannot happen while the runner makes every exchange of a step (nothing is posted after the
            # last); a receive posted ahead cannot be withdrawn, so the next step's messages would land in it.
            raise self._latch.fail(AFDPeerLostError(
                f"{s.name}: next_step on {p.label} with the receives of stage {self._posted_a2f.stage} still posted: "
                f"the previous step ended after {self.steps.num_exchanges} of its "
                f"{self.steps.exchanges_per_stage * len(self.steps.stages)} exchanges. Expected every exchange of a "
                "step (docs/protocol.md#receive-order); the pairing is dropped and re-formed"), observed=True)
        src = p.num_ffn_ranks + p.role_rank  # attention rank k's AFD rank
        header = torch.zeros(CONTROL_HEADER_WORDS, dtype=torch.int64)  # zeros: a short header fails the CRC
        label = "control receive from attention rank"
        self._call(label, p.role_rank, self.transport.recv, CONTROL, header, src, timed=False)
        words = header.tolist()
        self._require_ready("next_step")  # an abort may have left garbage behind
        try:
            data = torch.empty(control_length(words), dtype=torch.uint8)
            self._call(label, p.role_rank, self.transport.recv, CONTROL, data, src, timed=False)
            payload = read_control(words, data.numpy().tobytes(), num_stages=s.num_stages,
                                   max_rows=self._peer_max_rows())
            self._adopt(payload)  # refuses a count vector of another deployment, before any buffer
        except AFDProtocolError as exc:
            if isinstance(exc, AFDPeerLostError):
                raise
            raise self._latch.fail(AFDPeerProtocolError(
                f"{s.name}: from attention rank {p.role_rank}: {exc}. Run the same vllm_afd version and settings "
                "on both roles; the pairing is dropped and re-formed (docs/security.md#what-is-validated)"),
                observed=True) from None
        return payload

    def _peer_max_rows(self) -> int:
        """The attention role's max_rows from the handshake (equal on its ranks: a role field)."""
        return max((fp.max_rows for fp in self.fingerprints.values() if fp.role == Role.ATTENTION.value),
                   default=DEFAULT_MAX_ROWS)

    def _adopt(self, payload: ControlPayload) -> None:
        super()._adopt(payload)
        if self.spec.use_graph_buffers:
            self._preallocate_buffers()

    # ---- data plane -----------------------------------------------------------------------------

    def recv_a2f(self, stage: int, routing: RoutingSpec | None = None) -> A2FBatch:
        """Receive one (layer, stage) from every attention peer in subgroup order, concatenated."""
        self._require_ready("recv_a2f")
        s, p = self.spec, self.placement
        peer_rows = self.steps.stage(stage).peer_rows
        if routing is not None:
            self._routing.add(routing)
        if self.transport.bounded_receives:
            return self._recv_bounded(stage, routing)
        widths = [(s.hidden_size, s.dtype)] + ([] if routing is None else [(routing.width, routing.dtype)])
        parts: list[list[torch.Tensor]] = [[] for _ in widths]
        self._mark(A2F_RECV_START)
        for group_rank, (peer, num_rows) in enumerate(zip(p.attention_peers, peer_rows), start=1):
            label = "a2f receive from attention rank"
            for i, (width, dtype) in enumerate(widths):
                buffer = self._recv_buffer(stage, group_rank, num_rows, width, dtype)
                parts[i].append(self._call(label, peer, self.transport.recv_rows, A2F, buffer, num_rows, group_rank))
            self._check_seal(A2F, group_rank, tuple(part[-1] for part in parts), stage, label, peer)
        self._mark(A2F_RECV_END)
        joined = [_concat(part) for part in parts]
        return A2FBatch(joined[0], joined[1] if routing is not None else None, peer_rows)

    def _recv_bounded(self, stage: int, routing: RoutingSpec | None) -> A2FBatch:
        """recv_a2f over a bounded transport: wait the exchange's receives (posted by the previous exchange with
        ``prepost_receives``, else now), then post the next exchange's before handing this one out."""
        self._mark(A2F_RECV_START)
        posted, self._posted_a2f = self._posted_a2f, None
        if posted is None:
            posted = self._post_a2f(stage, routing)
        elif (posted.stage, posted.routing) != (stage, routing):
            # NOTE: the posted receives would take this exchange's messages in the wrong layout; only dropping the
            # groups (a re-formation) cancels them.
            raise self._latch.fail(AFDPeerLostError(
                f"{self.spec.name}: recv_a2f(stage={stage}, routing={routing}) on {self.placement.label}, but the "
                f"receives posted ahead expect stage {posted.stage}, routing {posted.routing}; expected the step's "
                "exchanges in layer-major, stage-minor order with one routing layout (docs/protocol.md#receive-order). "
                "The pairing is dropped and re-formed"), observed=True)
        label = "a2f receive from attention rank"
        for peer, messages, seals in posted.peers:
            received = tuple(self._call(label, peer, handle.wait) for handle in messages)
            self._check_posted_seal(A2F, seals, received, stage, label, peer)
        if posted.slots:
            # NOTE: receives posted together land in disjoint slots (a peer's surplus must not reach another peer's
            # rows): one copy joins them, the cost of the torch.cat that in-place receives save.
            for lane, joined in zip(posted.lanes, posted.joined):
                torch.cat([lane[j * posted.max_rows:j * posted.max_rows + n] for j, n in enumerate(posted.peer_rows)],
                          out=joined)
        self._mark(A2F_RECV_END)
        if self.transport.preposts(self.spec.device):
            self._post_next(stage, routing)
        joined = posted.joined
        return A2FBatch(joined[0], joined[1] if routing is not None else None, posted.peer_rows)

    def _post_next(self, stage: int, routing: RoutingSpec | None) -> None:
        """Post the receives of the exchange after the current one (the next stage of this layer, or the first stage
        of the next layer), unless the current one is the step's last: the next message is the control payload."""
        steps = self.steps
        if steps.num_exchanges + 1 >= steps.exchanges_per_stage * len(steps.stages):
            return
        order = tuple(steps.stages)
        self._posted_a2f = self._post_a2f(order[(order.index(stage) + 1) % len(order)], routing)

    def _post_a2f(self, stage: int, routing: RoutingSpec | None) -> _PostedA2F:
        """Issue one (layer, stage)'s receives from every peer into the stage's next buffer turn: per peer in subgroup
        order its hidden states, router logits, seal (the order it sends them, docs/protocol.md#receive-order)."""
        s, p = self.spec, self.placement
        peer_rows = self.steps.stage(stage).peer_rows
        widths = [(s.hidden_size, s.dtype)] + ([] if routing is None else [(routing.width, routing.dtype)])
        # NOTE: two turns per stage: a batch (and an FFN output that aliases it, still being sent) stays intact
        # through the stage's next receive; the one after needs every peer's next rows, which an attention
        # rank computes from its output of this batch, so all of this batch's sends have completed by then.
        # Posting one exchange ahead keeps this: the next exchange is posted once the current one completed.
        turn = self._turns[stage] = 1 - self._turns.get(stage, 1)
        max_rows = self._peer_max_rows()
        lanes = [self._bounded_buffer(stage, turn, len(peer_rows) * max_rows, *w) for w in widths]
        # Posted at once with more than one peer: disjoint slots of max_rows rows, joined by one copy.
        slots = len(peer_rows) > 1 and self.transport.preposts(self.spec.device)
        joined = ([self._bounded_buffer(("joined", stage), turn, len(peer_rows) * max_rows, *w)[:sum(peer_rows)]
                   for w in widths] if slots else [lane[:sum(peer_rows)] for lane in lanes])
        label = "a2f receive from attention rank"
        peers, offset = [], 0  # offset: where the next peer's receive is posted in a lane
        for j, (peer, num_rows) in enumerate(zip(p.attention_peers, peer_rows)):
            start = j * max_rows if slots else offset
            messages = [self._call(label, peer, self.transport.post_rows, A2F, lane[start:start + max_rows], num_rows,
                                   j + 1, timed=False) for lane in lanes]
            seals = [self._call(label, peer, self.transport.post, A2F, blank, j + 1, timed=False)
                     for blank in self.integrity.blanks()]
            peers.append((peer, messages, seals))
            offset += num_rows
        return _PostedA2F(stage, routing, peer_rows, peers, lanes, joined, max_rows, slots)

    def send_f2a(self, stage: int, output: torch.Tensor) -> None:
        """Send each attention peer its rows of ``output`` (``[sum(peer_rows), hidden]``)."""
        self._require_ready("send_f2a")
        s, p = self.spec, self.placement
        peer_rows = self.steps.stage(stage).peer_rows
        s.check_tensor(output, "FFN output", s.hidden_size, s.dtype)
        if output.shape[0] != sum(peer_rows):
            raise ValueError(
                f"{s.name}: FFN output has {output.shape[0]} rows in stage {stage}; expected "
                f"{sum(peer_rows)} (peers' rows {list(peer_rows)}). Pass the rows recv_a2f returned"
            )
        parts = output.split(list(peer_rows))
        self._mark(F2A_SEND_START)
        exchange = self.integrity.next_position("send f2a")
        for group_rank, (peer, part) in enumerate(zip(p.attention_peers, parts), start=1):
            part = part.contiguous()
            for tensor in (part, *self.integrity.seals(self.steps.payload.step_seq, exchange, stage, (part,))):
                self._pending_f2a.append(self._call("f2a send to attention rank", peer, self.transport.isend, F2A,
                                                    tensor, group_rank, timed=False))
        self._mark(F2A_SEND_END)
        self._count_exchange()

    def wait_sends(self) -> None:
        """End of a step: wait for every f2a send issued since the last call (its outputs may be reused)."""
        self._require_ready("wait_sends")
        pending, self._pending_f2a = self._pending_f2a, []
        self._wait_sends(pending, "f2a send to attention ranks", self.placement.subgroup)

    # ---- receive buffers ------------------------------------------------------------------------

    def _preallocate_buffers(self) -> None:
        """With graph buffers: every receive buffer the adopted stages need, before any capture."""
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

    def _bounded_buffer(self, stage: Any, turn: int, num_rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """The bounded receives' buffer of (stage, turn, width, dtype), made once per pairing from checked values
        (the handshake's max_rows, the subgroup's size, the spec's or the model's widths)."""
        key = (stage, turn, width, dtype)
        buffer = self._bounded.get(key)
        if buffer is None:
            buffer = self._bounded[key] = torch.empty((num_rows, width), dtype=dtype, device=self.spec.device)
        return buffer


@dataclass(frozen=True, slots=True)
class _PostedA2F:
    """One exchange's issued receives: per peer in subgroup order (attention rank, message handles, seal handles)."""

    stage: int
    routing: RoutingSpec | None
    peer_rows: tuple[int, ...]
    peers: list[tuple[int, list[RecvHandle], list[RecvHandle]]]
    lanes: list[torch.Tensor]
    # What the batch is: the lanes' heads (peers posted in place), or the joined buffers the slots are copied into.
    joined: list[torch.Tensor]
    max_rows: int
    slots: bool


def _concat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
