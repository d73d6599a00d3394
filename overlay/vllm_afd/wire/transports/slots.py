"""The IPC transport's slot plan and flag protocol (``ipc.py``): pure functions, no CUDA, no store.

Every receiver owns one device allocation holding its receive *slots*, one per (channel, attention
peer, micro-batch stage, message position within one exchange): on ``a2f`` the FFN owns, per attention
peer, a slot for the hidden states and, with the gate on attention, one for the router logits; on
``f2a`` each attention rank owns one slot for its FFN output. A slot holds the attention rank's largest
step (``max_rows``, published at ``open``). Each slot's *ready flag* is a 32-bit word of the data
subgroup's flag page (``shm.py``).

Protocol, enqueued on the caller's current stream (no host wait, no kernel; capturable):

    send: copy tensor -> the peer's slot ; write(flag, FULL)        (the write fences the copy)
    recv: wait(flag >= FULL) ; copy slot -> tensor ; write(flag, EMPTY)

With one stage, one slot per message position suffices, because an exchange is a request/response
lockstep per (attention rank, FFN rank) pair: attention rank j writes its a2f slots for exchange e+1
only after its stream passed recv_f2a(e), i.e. after the FFN wrote j's f2a flag for e, which the FFN's
stream does after it copied exchange e out of j's a2f slots and reset their flags. Symmetrically, the
FFN writes j's f2a slot for e+1 only after its stream received a2f e+1 from j, which j's stream sends
after it copied f2a e out and reset that flag. With k stages (docs/pingpong.md) the pair is no longer
in lockstep, but each stage is: exchanges run in (layer, stage) order on both sides, and stage s of
layer l+1 is sent only after stage s of layer l was received, so at most k exchanges per direction are
unconsumed at any time. Each (channel, peer) therefore cycles through ``num_stages`` x positions
slots in message order (message n uses slot n mod that; its position is n mod positions, so sizes
match), which also serves a step of fewer stages than ``num_stages``. Both sides count message
positions alike (positional protocol), every step is whole exchanges, so a replayed graph begins and
ends with every flag EMPTY (tests/wire/test_ipc_protocol.py checks this on a simulated device).

A wait is cyclic >= FULL, so ABORT (2^30) releases it like FULL.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from vllm_afd.wire.placement import A2F, F2A
from vllm_afd.wire.transports.cuda_driver import COPY, WAIT, WRITE, Op

__all__ = ["ABORT", "EMPTY", "FLAG_STRIDE", "FULL", "SLOT_ALIGN", "Slot", "check_sizes", "message_row_bytes",
           "plan_slots", "receiver_bytes", "recv_ops", "send_ops"]

NAME = "P2pIpcAFDConnector"
# Flag values: a cyclic >= FULL wait passes on FULL and on ABORT, never on EMPTY.
EMPTY, FULL, ABORT = 0, 1, 1 << 30
FLAG_STRIDE = 16  # words from one flag to the next: a 64-byte line each
SLOT_ALIGN = 256  # bytes; every slot starts aligned for the copy engines
ROUTER_LOGIT_BYTES = 4  # router logits are sized as float32, the widest gate output


def message_row_bytes(hidden_size: int, dtype: torch.dtype,
                      router_logits_width: int | None) -> dict[str, tuple[int, ...]]:
    """Bytes per row of each message position of one exchange: a2f hidden[, router logits]; f2a output."""
    hidden = hidden_size * dtype.itemsize
    a2f = (hidden,) if router_logits_width is None else (hidden, router_logits_width * ROUTER_LOGIT_BYTES)
    return {A2F: a2f, F2A: (hidden,)}


@dataclass(frozen=True, slots=True)
class Slot:
    """One message position of one (channel, attention peer): a receive buffer and its ready flag."""

    channel: str  # A2F or F2A
    peer: int  # the attention rank's group rank in the data subgroup (1..n)
    stage: int  # the slot's turn among the num_stages sets of one (channel, peer): 0..num_stages-1
    position: int  # message position within one exchange (a2f: 0 hidden, 1 router logits)
    receiver: int  # group rank owning the buffer (0, the FFN, for a2f; the peer for f2a)
    sender: int
    rows: int  # the attention peer's max_rows
    limit: int  # bytes of the largest message: rows x bytes per row
    offset: int  # bytes into the receiver's slot allocation
    capacity: int  # bytes reserved: the limit rounded up to SLOT_ALIGN
    flag: int  # word index of its ready flag in the subgroup's flag page


def plan_slots(row_bytes: Mapping[str, Sequence[int]], max_rows: Mapping[int, int],
               num_stages: int = 1) -> tuple[Slot, ...]:
    """Every slot of one data subgroup, from the message widths, each attention peer's max_rows and the
    handshake's ``num_stages``.

    Every member computes the same plan from the same published values: peers ascending, a2f before
    f2a, stages ascending, positions ascending (message order); offsets run per receiver, flags over
    the whole subgroup.
    """
    slots: list[Slot] = []
    used: dict[int, int] = {}
    for peer in sorted(max_rows):
        for channel in (A2F, F2A):
            receiver, sender = (0, peer) if channel == A2F else (peer, 0)
            for stage in range(num_stages):
                for position, per_row in enumerate(row_bytes[channel]):
                    limit = max_rows[peer] * per_row
                    capacity = -(-limit // SLOT_ALIGN) * SLOT_ALIGN
                    offset = used.get(receiver, 0)
                    slots.append(Slot(channel, peer, stage, position, receiver, sender, max_rows[peer], limit, offset,
                                      capacity, len(slots) * FLAG_STRIDE))
                    used[receiver] = offset + capacity
    return tuple(slots)


def check_sizes(row_bytes: Mapping[str, Sequence[int]], max_rows: int, num_stages: int) -> None:
    """Refuse, at construction, sizes no plan can be made of (this rank's own configuration)."""
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows <= 0:
        raise ValueError(f"{NAME}: max_rows must be a positive int, got {max_rows!r}; pass the attention's "
                         "largest step (vLLM's max_num_batched_tokens)")
    if sorted(row_bytes) != sorted((A2F, F2A)) or not all(n > 0 for v in row_bytes.values() for n in v):
        raise ValueError(f"{NAME}: row_bytes {dict(row_bytes)} must give positive bytes per row for "
                         f"'{A2F}' and '{F2A}'; build them with message_row_bytes()")
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages <= 0:
        raise ValueError(f"{NAME}: num_stages must be a positive int, got {num_stages!r}; pass the handshake's "
                         "num_stages (AFDConfig.num_stages)")


def receiver_bytes(plan: Sequence[Slot], receiver: int) -> int:
    """Bytes of ``receiver``'s slot allocation under ``plan``: its slots end to end."""
    return sum(slot.capacity for slot in plan if slot.receiver == receiver)


def send_ops(slot_pointer: int, flag_pointer: int, src: int, nbytes: int) -> tuple[Op, ...]:
    return (Op(COPY, slot_pointer, src, nbytes), Op(WRITE, flag_pointer, value=FULL))


def recv_ops(slot_pointer: int, flag_pointer: int, dst: int, nbytes: int) -> tuple[Op, ...]:
    return (Op(WAIT, flag_pointer, value=FULL), Op(COPY, dst, slot_pointer, nbytes),
            Op(WRITE, flag_pointer, value=EMPTY))
