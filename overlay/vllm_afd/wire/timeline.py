"""Where one rank's step time goes: per-exchange marks, one ``StepRecord`` per step.

The connector stamps a clock (clocks.py) at fixed points of every exchange (docs/timeline.md):

  attention, per (layer, stage)        FFN, per (layer, stage)
    a2f_send_start  a2f_send_end         a2f_recv_start  a2f_recv_end
    f2a_recv_end                         f2a_send_start  f2a_send_end

A step's marks go to fixed *slots*: slot = exchange position x marks per exchange + the mark's
index, so a CUDA graph that recorded the stamps of one step writes the same slots at every replay,
and a replayed step (no Python runs between its stamps) has the same layout as an eager one
(``step_layout``). Host overhead is what the marks do not cover: a step's span minus its layers.

Records are derived from plain values: spans (``round_trips_ns`` ...) are differences of marks of one
rank's clock. Marks of the two roles compare directly only where both roles read one clock (host
clock: one host; device clock: one GPU's global timer); the report (scripts/timeline_report.py)
joins them by step number.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

from vllm_afd.wire.messages import ControlPayload
from vllm_afd.role import Role

__all__ = [
    "ATTENTION_MARKS",
    "FFN_MARKS",
    "NULL_TIMELINE",
    "Mark",
    "NullTimeline",
    "StepRecord",
    "Timeline",
    "make_timeline",
    "step_layout",
]

A2F_SEND_START, A2F_SEND_END, F2A_RECV_END = "a2f_send_start", "a2f_send_end", "f2a_recv_end"
A2F_RECV_START, A2F_RECV_END, F2A_SEND_START, F2A_SEND_END = (
    "a2f_recv_start", "a2f_recv_end", "f2a_send_start", "f2a_send_end")
# Marks of one exchange, in the order they are stamped.
ATTENTION_MARKS = (A2F_SEND_START, A2F_SEND_END, F2A_RECV_END)
FFN_MARKS = (A2F_RECV_START, A2F_RECV_END, F2A_SEND_START, F2A_SEND_END)
MARKS = {Role.ATTENTION: ATTENTION_MARKS, Role.FFN: FFN_MARKS}
# Completed records kept for take_records(); older ones are dropped (a consumer that stopped reading).
MAX_PENDING_RECORDS = 4096
# Stages a step may have for the timeline's slots (micro-batching supports up to 3).
MAX_TIMELINE_STAGES = 4


class Clock(Protocol):
    """Stamps slots of the current step; clocks.py has the host and the device clock."""

    name: str

    def stamp(self, slot: int) -> None: ...

    def seal(self, num_slots: int) -> Any:
        """Freeze the current step's first ``num_slots`` stamps; returns a ticket for ``read``."""

    def read(self, ticket: Any) -> list[int] | None:
        """The sealed stamps in ns, or None while the device has not written them yet."""


@dataclass(frozen=True, slots=True)
class Mark:
    """One stamp: what happened, at which exchange of the step, in which stage, when (ns)."""

    kind: str
    exchange: int
    stage: int
    t_ns: int


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step of one rank, as its marks measured it."""

    role: str
    role_rank: int
    step_seq: int
    # The payload's flags: what kind of step this was.
    graph_replay: bool
    warmup: bool
    profile: bool
    # Rows this rank sent (attention) or received in total (FFN), summed over stages.
    rows: int
    # Host clock (time.perf_counter_ns) when the step opened and when its last exchange returned.
    opened_ns: int
    closed_ns: int
    # "host" or "device": which clock stamped ``marks``.
    clock: str
    marks: tuple[Mark, ...]
    # Host synchronisations AFD's own code made in this step (docs/timeline.md#host-synchronisations).
    host_syncs: int

    def spans_ns(self, start: str, end: str) -> list[int]:
        """``end - start`` per (exchange, stage), in exchange order."""
        starts = {(m.exchange, m.stage): m.t_ns for m in self.marks if m.kind == start}
        return [m.t_ns - starts[(m.exchange, m.stage)] for m in self.marks
                if m.kind == end and (m.exchange, m.stage) in starts]

    def round_trips_ns(self) -> list[int]:
        """Attention: send start to FFN output received, per exchange (transport + FFN + waits)."""
        return self.spans_ns(A2F_SEND_START, F2A_RECV_END)

    def ffn_compute_ns(self) -> list[int]:
        """FFN: all rows received to the first byte sent back, per exchange (the layer's compute)."""
        return self.spans_ns(A2F_RECV_END, F2A_SEND_START)

    def attention_compute_ns(self) -> list[int]:
        """Attention: a stage's FFN output of layer l received to its send of layer l+1 (its own layer).

        NOTE: per stage, not in slot order: with stages, the slot after a receive is the next stage's send.
        """
        ends = {(m.exchange, m.stage): m.t_ns for m in self.marks if m.kind == F2A_RECV_END}
        return [m.t_ns - ends[(m.exchange - 1, m.stage)] for m in self.marks
                if m.kind == A2F_SEND_START and (m.exchange - 1, m.stage) in ends]

    def to_json(self) -> dict[str, Any]:
        # NOTE: field by field, not dataclasses.asdict: asdict deep-copies every mark (~10x slower), and this
        # runs once per step on both roles while the timeline is on.
        body = {name: getattr(self, name) for name in _RECORD_FIELDS}
        body["marks"] = [[m.kind, m.exchange, m.stage, m.t_ns] for m in self.marks]
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> StepRecord:
        marks = tuple(Mark(str(k), int(e), int(s), int(t)) for k, e, s, t in body["marks"])
        return cls(**{**body, "marks": marks})


_RECORD_FIELDS = tuple(f.name for f in fields(StepRecord) if f.name != "marks")


def read_records(path: str | os.PathLike[str]) -> list[StepRecord]:
    """A timeline file (one `StepRecord.to_json` object per line, telemetry.py) back as records.

    Raises ValueError naming the file and line of the first line that is not a record.
    """
    records = []
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            try:
                records.append(StepRecord.from_json(json.loads(line)))
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"{path}:{number} is not a step record ({type(exc).__name__}: {exc}); expected "
                                 "lines written by vllm_afd's timeline (docs/timeline.md). Remove the line or the "
                                 "file") from exc
    return records


def step_layout(role: Role, exchanges_per_stage: int, stages: Sequence[int]) -> list[tuple[str, int, int]]:
    """(kind, exchange, stage) of every slot of one step: layer-major, stage-minor, marks in order."""
    kinds = MARKS[role]
    return [(kind, exchange, stage) for exchange in range(exchanges_per_stage) for stage in stages
            for kind in kinds]


class Timeline:
    """One rank's marks: opened per payload, stamped per exchange, sealed when the next step opens.

    A step's record completes when its clock can read its stamps (the device clock: once the GPU
    wrote them, checked without waiting). Capture steps are skipped: nothing executed.
    """

    # True: this timeline keeps records (NullTimeline: False).
    enabled = True

    def __init__(self, role: Role, role_rank: int, exchanges_per_stage: int, clock: Clock) -> None:
        self.role = role
        self.role_rank = role_rank
        self.exchanges_per_stage = exchanges_per_stage
        self.clock = clock
        self._marks_per_exchange = len(MARKS[role])
        self._kind_index = {kind: i for i, kind in enumerate(MARKS[role])}
        self._payload: ControlPayload | None = None
        self._rows = 0
        self._opened_ns = 0
        self._closed_ns = 0
        self._host_syncs = 0
        self._sealed: deque[tuple[Any, dict[str, Any], list[tuple[str, int, int]]]] = deque()
        self._records: deque[StepRecord] = deque(maxlen=MAX_PENDING_RECORDS)

    def open_step(self, payload: ControlPayload, rows: int) -> None:
        """A payload was adopted: seal the previous step, start this one."""
        self._seal()
        self._payload, self._rows = payload, rows
        self._opened_ns = self._closed_ns = time.perf_counter_ns()
        self._host_syncs = 0

    def mark(self, kind: str, position: int) -> None:
        """Stamp ``kind`` of the step's exchange number ``position`` (layer-major, stage-minor, from 0)."""
        self.clock.stamp(position * self._marks_per_exchange + self._kind_index[kind])

    def step_closed(self) -> None:
        """The step's last exchange returned (host time)."""
        self._closed_ns = time.perf_counter_ns()

    def count_host_sync(self, count: int = 1) -> None:
        """AFD code waited for the device on the host (a blocking copy, ``item()``, a synchronize)."""
        self._host_syncs += count

    def take_records(self) -> list[StepRecord]:
        """Completed records, oldest first; each is returned once."""
        while self._sealed:
            ticket, fields, layout = self._sealed[0]
            stamps = self.clock.read(ticket)
            if stamps is None:
                break
            self._sealed.popleft()
            marks = tuple(Mark(kind, exchange, stage, t) for (kind, exchange, stage), t in zip(layout, stamps))
            self._records.append(StepRecord(**fields, marks=marks))
        records = list(self._records)
        self._records.clear()
        return records

    def close(self) -> None:
        """Seal the open step (its stamps are read by the next take_records, if the device wrote them)."""
        self._seal()
        self._payload = None

    def _seal(self) -> None:
        payload, self._payload = self._payload, None
        if payload is None or payload.is_graph_capturing:
            return
        layout = step_layout(self.role, self.exchanges_per_stage, payload.stages)
        fields = dict(
            role=self.role, role_rank=self.role_rank,
            step_seq=-1 if payload.step_seq is None else payload.step_seq,
            graph_replay=payload.is_graph_replaying, warmup=payload.is_warmup, profile=payload.is_profile,
            rows=self._rows, opened_ns=self._opened_ns, closed_ns=self._closed_ns, clock=self.clock.name,
            host_syncs=self._host_syncs,
        )
        self._sealed.append((self.clock.seal(len(layout)), fields, layout))


class NullTimeline:
    """The timeline of a rank that keeps none (``timeline_clock`` None): every call does nothing."""

    enabled = False

    def open_step(self, payload: ControlPayload, rows: int) -> None:
        pass

    def mark(self, kind: str, position: int) -> None:
        pass

    def step_closed(self) -> None:
        pass

    def count_host_sync(self, count: int = 1) -> None:
        pass

    def take_records(self) -> list[StepRecord]:
        return []

    def close(self) -> None:
        pass


# Stateless, so one instance serves every connector without a timeline.
NULL_TIMELINE = NullTimeline()


def make_timeline(clock: str | None, role: Role, role_rank: int, exchanges_per_stage: int,
                  device: Any) -> Timeline | NullTimeline:
    """The timeline a connector stamps: on ``clock`` ("host" or "device", on ``device``), or NULL_TIMELINE."""
    if clock is None:
        return NULL_TIMELINE
    from vllm_afd.wire.clocks import DeviceClock, HostClock

    # Slots for up to MAX_TIMELINE_STAGES stages of the widest exchange (4 FFN marks).
    capacity = len(FFN_MARKS) * exchanges_per_stage * MAX_TIMELINE_STAGES
    stamps = DeviceClock(capacity, device) if clock == "device" else HostClock(capacity)
    return Timeline(role, role_rank, exchanges_per_stage, stamps)
