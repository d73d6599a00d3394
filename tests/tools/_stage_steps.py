"""Timeline records of one step as the stage model schedules it (tests of scripts/stage_model.py and its users)."""

from __future__ import annotations

from vllm_afd.wire.timeline import Mark, StepRecord

US = 1000  # ns


def staged_step(a_us: int, f_us: int, wire_us: int, layers: int, stages: int) -> tuple[StepRecord, StepRecord]:
    """One step of `stages` stages on one clock, scheduled as the E order runs them (the simulator's schedule)."""
    attention, ffn = [], []
    attention_free = ffn_free = 0
    back = [0] * stages
    for layer in range(layers):
        arrive = []
        for stage in range(stages):
            attention_free = max(attention_free, back[stage]) + a_us * US
            attention += [Mark("a2f_send_start", layer, stage, attention_free),
                          Mark("a2f_send_end", layer, stage, attention_free)]
            arrive.append(attention_free + wire_us * US // 2)
        for stage in range(stages):
            ffn += [Mark("a2f_recv_start", layer, stage, ffn_free)]
            ffn_free = max(ffn_free, arrive[stage])
            ffn += [Mark("a2f_recv_end", layer, stage, ffn_free)]
            ffn_free += f_us * US
            ffn += [Mark("f2a_send_start", layer, stage, ffn_free), Mark("f2a_send_end", layer, stage, ffn_free)]
            back[stage] = ffn_free + wire_us * US // 2
            attention.append(Mark("f2a_recv_end", layer, stage, back[stage]))
    common = dict(step_seq=7, graph_replay=False, warmup=False, profile=False, rows=8, clock="host",
                  host_syncs=0, opened_ns=0, closed_ns=0)
    return (StepRecord("attention", 0, marks=tuple(attention), **common),
            StepRecord("ffn", 0, marks=tuple(ffn), **common))
