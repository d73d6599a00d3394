"""The per-step timeline (wire/timeline.py, docs/timeline.md): slot layout, records, sealing, the connector's marks."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_afd.wire.clocks import HostClock
from vllm_afd.wire.messages import ControlPayload
from vllm_afd.role import Role
from vllm_afd.wire.timeline import (
    ATTENTION_MARKS,
    FFN_MARKS,
    NULL_TIMELINE,
    Mark,
    StepRecord,
    Timeline,
    make_timeline,
    step_layout,
)

from tests.connectors._harness import (
    QueueTransport,
    free_port,
    init_all,
    make_connector,
    make_placement,
    make_spec,
    new_wire,
)


class ScriptedClock:
    """A clock whose stamps are the slot numbers x 10 and whose 'device' writes them when told."""

    name = "device"

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}
        self.written: set[int] = set()  # tickets (seal numbers) the device has written
        self.num_sealed = 0

    def stamp(self, slot: int) -> None:
        self.slots[slot] = slot * 10

    def seal(self, num_slots: int) -> tuple[int, list[int]]:
        ticket, self.num_sealed = self.num_sealed, self.num_sealed + 1
        stamps = [self.slots.get(i, -1) for i in range(num_slots)]
        self.slots = {}
        return ticket, stamps

    def read(self, ticket: tuple[int, list[int]]) -> list[int] | None:
        key, stamps = ticket
        return stamps if key in self.written else None


def run_step(timeline: Timeline, payload: ControlPayload, role: str, num_exchanges: int) -> None:
    """Stamp one step in protocol order (layer-major, stage-minor), as the connector does."""
    timeline.open_step(payload, rows=3)
    for position in range(num_exchanges * len(payload.stages)):
        for kind in (ATTENTION_MARKS if role == "attention" else FFN_MARKS):
            timeline.mark(kind, position)
    timeline.step_closed()


@given(role=st.sampled_from(["attention", "ffn"]), num_exchanges=st.integers(1, 6),
       stages=st.sets(st.integers(0, 2), min_size=1), replay=st.booleans())
def test_marks_land_in_layout_order_and_spans_are_per_exchange(role, num_exchanges, stages, replay):
    clock = HostClock(4 * num_exchanges * 4)
    timeline = Timeline(role, 0, num_exchanges, clock)
    payload = ControlPayload({s: (1,) for s in stages}, step_seq=7, is_graph_replaying=replay)

    run_step(timeline, payload, role, num_exchanges)
    timeline.close()
    [record] = timeline.take_records()

    layout = step_layout(role, num_exchanges, sorted(stages))
    assert [(m.kind, m.exchange, m.stage) for m in record.marks] == layout
    assert all(a.t_ns <= b.t_ns for a, b in zip(record.marks, record.marks[1:]))  # stamped in slot order
    assert (record.step_seq, record.graph_replay, record.rows, record.clock) == (7, replay, 3, "host")
    expected = num_exchanges * len(stages)
    if role == "attention":
        assert len(record.round_trips_ns()) == expected and record.ffn_compute_ns() == []
        # One per stage and layer after the first: each stage's own previous receive, never negative.
        assert len(record.attention_compute_ns()) == (num_exchanges - 1) * len(stages)
        assert all(span >= 0 for span in record.attention_compute_ns())
    else:
        assert len(record.ffn_compute_ns()) == expected and record.round_trips_ns() == []
    assert all(span >= 0 for span in record.round_trips_ns() + record.ffn_compute_ns())
    assert StepRecord.from_json(record.to_json()) == record


def test_a_replayed_step_stamps_the_slots_its_capture_recorded():
    """A graph replays the stamps of its capture: same slots, no Python; the record has the same layout."""
    clock = ScriptedClock()
    timeline = Timeline("ffn", 0, 2, clock)
    timeline.open_step(ControlPayload({0: (4,)}, is_graph_capturing=True, step_seq=0), rows=4)
    for position in range(2):
        for kind in FFN_MARKS:
            timeline.mark(kind, position)  # recorded into the graph
    timeline.open_step(ControlPayload({0: (4,)}, is_graph_replaying=True, step_seq=1), rows=4)
    for slot in range(8):
        clock.stamp(slot)  # what the replayed graph does on the device
    timeline.close()

    assert timeline.take_records() == []  # the capture step is skipped; the replay is not written yet
    clock.written.update(range(100))
    [record] = timeline.take_records()
    assert record.step_seq == 1 and record.graph_replay
    assert [m.t_ns for m in record.marks] == [slot * 10 for slot in range(8)]
    assert record.ffn_compute_ns() == [10, 10]  # f2a_send_start (slot 2) - a2f_recv_end (slot 1)


def test_records_wait_for_the_device_in_order():
    clock = ScriptedClock()
    timeline = Timeline("attention", 0, 1, clock)
    for seq in range(3):
        run_step(timeline, ControlPayload({0: (1,)}, step_seq=seq), "attention", 1)
    timeline.close()

    assert timeline.take_records() == []
    clock.written.add(0)  # only the first sealed step is readable
    assert [r.step_seq for r in timeline.take_records()] == [0]
    clock.written.update(range(100))
    assert [r.step_seq for r in timeline.take_records()] == [1, 2]
    assert timeline.take_records() == []


def test_host_syncs_are_counted_per_step():
    timeline = Timeline("attention", 0, 1, HostClock(16))
    run_step(timeline, ControlPayload({0: (1,)}, step_seq=0), "attention", 1)
    timeline.count_host_sync(2)
    run_step(timeline, ControlPayload({0: (1,)}, step_seq=1), "attention", 1)
    timeline.close()

    assert [r.host_syncs for r in timeline.take_records()] == [2, 0]


def test_the_connector_stamps_every_exchange_of_both_roles():
    """Over the in-memory wire with the host clock: one record per step per role, one span per exchange."""
    port, wire = free_port(), new_wire()
    spec = make_spec(port, exchanges_per_stage=3, timeline_clock="host")
    ffn = make_connector(spec, make_placement("ffn", 0, 1, 1), transport=QueueTransport(wire))
    attention = make_connector(spec, make_placement("attention", 0, 1, 1), transport=QueueTransport(wire))
    init_all([ffn, attention])
    try:
        for step in range(2):
            attention.publish({0: [2]})
            ffn.next_step()
            for _ in range(3):
                hidden = torch.full((2, 64), float(step), dtype=torch.bfloat16)
                attention.send_a2f(0, hidden)
                batch = ffn.recv_a2f(0)
                ffn.send_f2a(0, batch.hidden_states)
                attention.recv_f2a(0, hidden)
        attention.publish({0: [2]})  # opening step 2 seals step 1
        ffn.next_step()
        attention_records, ffn_records = attention.take_records(), ffn.take_records()
    finally:
        attention.close()
        ffn.close()

    assert [r.step_seq for r in attention_records] == [0, 1] == [r.step_seq for r in ffn_records]
    assert all(len(r.round_trips_ns()) == 3 for r in attention_records)
    assert all(len(r.ffn_compute_ns()) == 3 for r in ffn_records)
    assert all(r.host_syncs == 0 for r in attention_records + ffn_records)  # CPU: nothing to wait for
    assert attention.rendezvous_s is not None and attention.rendezvous_s > 0


def test_the_timeline_is_off_without_a_clock():
    connector = make_connector(make_spec(free_port()), make_placement("attention", 0, 1, 1))
    assert connector.take_records() == [] and not connector.timeline.enabled


def test_the_null_timeline_takes_every_call_and_keeps_nothing():
    timeline = make_timeline(None, Role.ATTENTION, 0, 3, torch.device("cpu"))

    timeline.open_step(ControlPayload({0: (2,)}, step_seq=0), 2)
    timeline.mark(ATTENTION_MARKS[0], 0)
    timeline.count_host_sync(2)
    timeline.step_closed()
    timeline.close()

    assert timeline is NULL_TIMELINE and not timeline.enabled
    assert timeline.take_records() == []


def test_a_clock_makes_a_real_timeline_with_slots_for_every_stage():
    timeline = make_timeline("host", Role.FFN, 1, 3, torch.device("cpu"))

    assert isinstance(timeline, Timeline) and timeline.enabled
    assert (timeline.role, timeline.role_rank, timeline.clock.name) == (Role.FFN, 1, "host")
    timeline.open_step(ControlPayload({stage: (1,) for stage in range(4)}, step_seq=0), 4)
    for position in range(3 * 4):  # the widest step: 4 stages of 3 exchanges, 4 FFN marks each
        for kind in FFN_MARKS:
            timeline.mark(kind, position)


def test_the_device_clock_refuses_a_cpu_device():
    from vllm_afd.wire.clocks import DeviceClock

    with pytest.raises(ValueError, match="device clock stamps a CUDA GPU's global timer; got device cpu"):
        DeviceClock(8, torch.device("cpu"))


def test_attention_compute_pairs_each_stage_with_its_own_previous_receive():
    """Two stages: the slot after stage 0's receive is stage 1's send; a stage's layer starts at its own receive."""
    us = 1000
    marks = []
    for layer in range(2):
        for stage in range(2):
            sent = (100 * layer + 10 * stage) * us
            marks += [Mark("a2f_send_start", layer, stage, sent), Mark("a2f_send_end", layer, stage, sent + us),
                      Mark("f2a_recv_end", layer, stage, sent + 50 * us)]
    record = StepRecord("attention", 0, step_seq=0, graph_replay=False, warmup=False, profile=False, rows=4,
                        opened_ns=0, closed_ns=0, clock="host", marks=tuple(marks), host_syncs=0)

    assert record.attention_compute_ns() == [50 * us, 50 * us]  # (0, j) received at 50 + 10j, (1, j) sent at 100 + 10j
