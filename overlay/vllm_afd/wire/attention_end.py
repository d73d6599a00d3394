"""``AttentionConnector``: the attention's end of the AFD wire (the shared link: connector.py).

Per step the attention ``publish``es the control payload: every attention rank adopts it, ranks < F
also send it to FFN rank k (an int64 header [length, CRC-32], then the bytes;
docs/protocol.md#control-payload), after checking every count against this rank's ``max_rows`` (the
FFN checks them again). Per (layer, stage) it issues its rows with ``send_a2f`` (hidden states, then
router logits with the gate on attention, then their seal in integrity mode, wire/integrity.py)
without blocking, and ``recv_f2a`` waits that stage's send, then receives the FFN output into the
tensor just sent (over a bounded transport, gloo: posted at this rank's ``max_rows`` rows into a buffer per
stage, whose published rows are then copied over; docs/protocol.md#bounds; where the transport pre-posts, gloo
on CPU, ``send_a2f`` posts that receive before its send, docs/protocol.md#receive-order). An exchange that fails
inside a step is deferred to the step gate (``defer_failure`` / ``take_step_failure``, attention/step_gate.py);
``mark_startup_done`` arms the step timeouts once profile, warm-up and capture are over.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vllm_afd.wire.connector import AFDConnector
from vllm_afd.wire.errors import AFDPeerLostError
from vllm_afd.wire.messages import ControlPayload, control_header
from vllm_afd.wire.placement import A2F, CONTROL, F2A
from vllm_afd.wire.store import call_within, store_frozen_error, store_lost_error
from vllm_afd.wire.timeline import A2F_SEND_END, A2F_SEND_START, F2A_RECV_END
from vllm_afd.wire.transport import RecvHandle, SendHandle
from vllm_afd.wire.watchdog import STARTUP_DONE_KEY

__all__ = ["AttentionConnector"]


class AttentionConnector(AFDConnector):
    """One attention rank's end; see the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The first failure an exchange deferred to the step gate in the current step.
        self._deferred: BaseException | None = None
        # Whether this rank counted itself into STARTUP_DONE_KEY (a re-formation counts it again).
        self._startup_flagged = False

    def _new_pairing(self) -> None:
        super()._new_pairing()
        # The issued a2f sends of each stage, waited by that stage's recv_f2a.
        self._pending_a2f: dict[int, list[SendHandle]] = {}
        # Bounded receives: per stage a [max_rows, hidden] buffer each f2a receive is posted into.
        self._bounded: dict[int, torch.Tensor] = {}
        # prepost_receives: per stage the f2a receive (data, then seals) send_a2f posted, waited by recv_f2a.
        self._posted_f2a: dict[int, tuple[RecvHandle, list[RecvHandle]]] = {}

    def _announce(self, store: Any) -> None:
        if self._startup_flagged:  # a re-formation: steps were timed before it, keep timing them
            store.add(STARTUP_DONE_KEY, 1)

    # ---- step gate ------------------------------------------------------------------------------

    def mark_startup_done(self) -> None:
        """Profile, warm-up and capture are over; once all A ranks said so, steps are timed."""
        self._require_ready("mark_startup_done")
        if not self._startup_flagged:
            self._startup_flagged = True
            self._flag_startup_done()

    def _flag_startup_done(self) -> None:
        """Count this rank in ``STARTUP_DONE_KEY`` within ``peer_timeout_s``: a store host that stopped answering
        (torch's client never times out then) or went away is a lost peer, not a start-up that hangs."""
        from torch.distributed import DistNetworkError

        s, p = self.spec, self.placement
        store = self._store
        address = f"{s.host}:{s.port}"
        try:
            call_within(lambda: store.add(STARTUP_DONE_KEY, 1), s.peer_timeout_s,
                        lambda: store_frozen_error(address, p.label, "start-up flag", s.peer_timeout_s))
        except DistNetworkError as exc:
            raise self.fail(store_lost_error(address, p.role, p.role_rank, exc)) from exc
        except AFDPeerLostError as exc:
            raise self.fail(exc) from None

    def defer_failure(self, exc: BaseException) -> None:
        """Inside a step: an exchange failed with ``exc``; the step gate raises it at the step's end."""
        if self._deferred is None:
            self._deferred = exc

    def take_step_failure(self) -> BaseException | None:
        """What the step gate must raise (and forget): a failure deferred in this step, the sticky failure, or
        a pairing that is not ready (a re-formation running in the background)."""
        deferred, self._deferred = self._deferred, None
        if self.is_initialized:
            return deferred
        return self.failure or deferred or AFDPeerLostError(
            f"AFD peer lost: {self.placement.label}'s connector is pairing again after a lost peer; this step "
            "cannot run (docs/connection.md#healing-attention)")

    # ---- control plane --------------------------------------------------------------------------

    def publish(self, counts_dp: Mapping[int, Sequence[int]], **flags: bool) -> ControlPayload:
        """Open the step with each stage's tokens per attention DP rank; ranks < F transmit it."""
        self._require_ready("publish")
        if self._posted_f2a:
            # NOTE: a send_a2f whose recv_f2a never came (a step cut short): its receive, posted ahead, cannot be
            # withdrawn, so the FFN's next answer would land in it, sized by the old step.
            raise self.fail(AFDPeerLostError(
                f"{self.spec.name}: publish on {self.placement.label} with the f2a receives of stages "
                f"{sorted(self._posted_f2a)} still posted: the previous step sent them without receiving the "
                "answers. Expected each send_a2f of a step to meet its recv_f2a (docs/protocol.md#receive-order); "
                "the pairing is dropped and re-formed"))
        payload = self.steps.new_payload(counts_dp, **flags)
        self._check_rows(payload)
        self._adopt(payload)
        p = self.placement
        if p.control_rank is not None:
            body = payload.encode()
            header = torch.tensor(control_header(body), dtype=torch.int64)
            data = torch.frombuffer(bytearray(body), dtype=torch.uint8)
            dst = p.role_rank  # control group ranks are AFD ranks: FFN k is k
            self._call("control send to ffn rank", p.role_rank, self.transport.send, CONTROL, header, dst)
            self._call("control send to ffn rank", p.role_rank, self.transport.send, CONTROL, data, dst)
        return payload

    def _check_rows(self, payload: ControlPayload) -> None:
        """Every published count within this rank's ``max_rows`` (the spec's, never above the handshake's, which
        the FFN enforces and which sizes this rank's bounded receives), else ValueError."""
        bound = min(self.fingerprint.max_rows, self.spec.max_rows or self.fingerprint.max_rows)
        for stage, counts in payload.counts.items():
            if max(counts) > bound:
                raise ValueError(
                    f"{self.spec.name}: stage {stage} publishes {max(counts)} rows (counts {list(counts)}); the most "
                    f"one exchange carries is max_rows={bound} (max_num_batched_tokens or the largest captured graph). "
                    "Publish the step's padded rows, never more"
                )

    # ---- data plane -----------------------------------------------------------------------------

    def send_a2f(self, stage: int, hidden: torch.Tensor, router_logits: torch.Tensor | None = None) -> None:
        """Send this rank's rows of one (layer, stage) to its FFN rank: hidden states, then router logits."""
        self._require_ready("send_a2f")
        s, p = self.spec, self.placement
        own_rows = self.steps.stage(stage).own_rows
        s.check_tensor(hidden, "hidden states", s.hidden_size, s.dtype)
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
            s.check_tensor(router_logits, "router logits", s.router_logits_width, None)
            if router_logits.shape[0] != hidden.shape[0]:
                raise ValueError(
                    f"{s.name}: router logits have {router_logits.shape[0]} rows, hidden states "
                    f"{hidden.shape[0]}; pass this layer's logits"
                )
        label = "a2f send to ffn rank"
        self._wait_sends(self._pending_a2f.pop(stage, []), label, p.subgroup)  # a stage sent twice: misuse, but safe
        if self.transport.bounded_receives and self.transport.preposts(s.device) and stage not in self._posted_f2a:
            # NOTE: the answer's receive is posted before the send that asks for it, so the FFN's f2a send leaves from
            # its own thread (docs/protocol.md#receive-order); it lands in the stage's buffer, not in `hidden`.
            self._posted_f2a[stage] = self._post_f2a(stage, own_rows)
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
        group = (hidden,) if router_logits is None else (hidden, router_logits)
        for seal in self.integrity.seals(self.steps.payload.step_seq, position, stage, group):
            pending.append(self._call(label, p.subgroup, self.transport.isend, A2F, seal, 0, timed=False))
        self._mark(A2F_SEND_END, position)
        self.steps.num_sends += 1

    def recv_f2a(self, stage: int, out: torch.Tensor) -> torch.Tensor:
        """Receive the FFN output of one (layer, stage) into ``out`` when it fits, else a new tensor."""
        self._require_ready("recv_f2a")
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
        label, peer = "f2a receive from ffn rank", self.placement.subgroup
        if self.transport.bounded_receives:
            # NOTE: the FFN's output lands in `out` (the op's contract), which has no room for a longer message:
            # received into this stage's buffer of max_rows rows, its published rows copied over (one memcpy).
            posted = self._posted_f2a.pop(stage, None) or self._post_f2a(stage, own_rows)
            head = self._call(label, peer, posted[0].wait)
            self._check_posted_seal(F2A, posted[1], (head,), stage, label, peer)
            target.copy_(head)
        else:
            self._call(label, peer, self.transport.recv, F2A, target, 0)
            self._check_seal(F2A, 0, (target,), stage, label, peer)
        self._mark(F2A_RECV_END)
        self._count_exchange()
        return target

    def _post_f2a(self, stage: int, own_rows: int) -> tuple[RecvHandle, list[RecvHandle]]:
        """Issue one stage's f2a receive: the data into the stage's buffer, then the seals (the FFN's order)."""
        label, peer = "f2a receive from ffn rank", self.placement.subgroup
        data = self._call(label, peer, self.transport.post_rows, F2A, self._bounded_buffer(stage), own_rows, 0,
                          timed=False)
        return data, [self._call(label, peer, self.transport.post, F2A, blank, 0, timed=False)
                      for blank in self.integrity.blanks()]

    def _bounded_buffer(self, stage: int) -> torch.Tensor:
        """Stage ``stage``'s buffer of bounded receives: the handshake's max_rows rows, made once per pairing."""
        buffer = self._bounded.get(stage)
        if buffer is None:
            s = self.spec
            buffer = self._bounded[stage] = torch.empty((self.fingerprint.max_rows, s.hidden_size), dtype=s.dtype,
                                                        device=s.device)
        return buffer
