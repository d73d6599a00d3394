"""The micro-batch stage model of docs/pingpong.md#10-predicted-speed-up, fed by measured timelines (no vLLM import).

`scripts/bench_afd_cpu.py --num-stages` prints, next to every measured k ÷ 1 stage ratio, what the
model predicts from the costs the 1-stage timeline measured, so that a gap between the two points
at a bubble the model does not know about instead of being read as noise:

* `exchange_costs(attention, ffn)`: one joined step's per-exchange spans in ms, stage-aware
  (timeline_report.py pairs marks in slot order, which is right for one stage only): attention
  compute a (FFN output of layer l-1 received -> layer l sent, same stage), FFN compute f,
  transport t (round trip - f; meaningful at one stage only, where nothing else runs), and each
  role's busy share of the step's layers (compute + send issue ÷ the role's span).
* `fit_linear`: a(n) = a0 + a1 n (and f, t) over the batch sizes measured with one stage, so the
  costs of a stage of n/k tokens come from measurements, fixed parts included
  (docs/pingpong.md#10-predicted-speed-up: a0, f0, λ).
* `read_steps(directory, role)`, `batch_costs(attention, ffn, rows, windows)`: a deployment's timeline files
  and the median costs of its decode steps of one batch inside the measured requests' windows; shared by
  bench_afd_cpu.py and the H200 run (scripts/device/stage_prediction.py), so both read the same steps.
* `simulate_layers(a, f, t, num_layers, num_stages)`: the step's layers as two single-core roles
  and a wire of latency t/2 each way, in E order (docs/pingpong.md#5-ordering-why-the-receives-cannot-deadlock),
  fill and drain included;
  with one stage it is L (a + t + f), in steady state max(k a, k f, a + t + f) per layer.

Transport is modelled as latency, not as either role's CPU time; on CPU gloo's copies run on the
roles' own cores, which the measured busy shares show (and the model then over-predicts).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ExchangeCosts", "Linear", "batch_costs", "exchange_costs", "fit_linear", "predicted_step_ms", "read_steps",
           "simulate_layers", "stages_run"]

NS_PER_MS = 1e6


@dataclass(frozen=True, slots=True)
class ExchangeCosts:
    """One step's medians per exchange (one crossing layer of one stage), ms, and the roles' busy shares."""

    num_layers: int
    num_stages: int
    a: float  # attention compute (layers >= 1: layer 0 starts before the first mark)
    f: float  # FFN compute
    t: float  # round trip - FFN compute: the wire both ways plus any wait for the other role
    attention_busy: float  # (compute + send issue) ÷ first send .. last receive, on the attention
    ffn_busy: float  # (compute + send issue) ÷ first rows received .. last send, on the FFN
    layers_ms: float  # attention: first send .. last receive, the step's crossing layers


def _marks(record: object, kind: str) -> dict[tuple[int, int], int]:
    return {(m.exchange, m.stage): m.t_ns for m in record.marks if m.kind == kind}  # type: ignore[attr-defined]


def exchange_costs(attention: object, ffn: object) -> ExchangeCosts:
    """Spans of one step from its attention and FFN `StepRecord`s (wire/timeline.py), joined by step number.

    Stage-aware: attention compute of (layer l, stage j) runs from stage j's FFN output of layer l-1 to its
    send of layer l; the baton does not leave a stage between its receive and its next send, so the span
    is that stage's own work (handoffs fall in the waits).
    """
    sent, sent_end, back = (_marks(attention, k) for k in ("a2f_send_start", "a2f_send_end", "f2a_recv_end"))
    got, ffn_start, ffn_end = (_marks(ffn, k) for k in ("a2f_recv_end", "f2a_send_start", "f2a_send_end"))
    keys = sorted(sent)
    if not keys or set(keys) != set(back):
        raise ValueError(f"stage_model: attention step {attention.step_seq} has sends {len(sent)} and receives "  # type: ignore[attr-defined]
                         f"{len(back)}; expected one of each per exchange (a complete step record)")
    if set(keys) - set(got) or set(keys) - set(ffn_start):
        raise ValueError(f"stage_model: FFN step {ffn.step_seq} lacks exchanges of attention step "  # type: ignore[attr-defined]
                         f"{attention.step_seq}; join records by step_seq and pass complete ones")
    num_layers = 1 + max(layer for layer, _ in keys)
    num_stages = 1 + max(stage for _, stage in keys)
    a = [sent[(layer, j)] - back[(layer - 1, j)] for layer, j in keys if layer > 0]
    f = [ffn_start[key] - got[key] for key in keys]
    t = [back[key] - sent[key] - (ffn_start[key] - got[key]) for key in keys]
    a_busy = sum(a) + sum(sent_end[key] - sent[key] for key in keys)
    a_span = max(back.values()) - min(sent.values())
    f_busy = sum(f) + sum(ffn_end[key] - ffn_start[key] for key in keys if key in ffn_end)
    f_span = max(ffn_end.values()) - min(got.values())
    return ExchangeCosts(
        num_layers=num_layers, num_stages=num_stages,
        a=statistics.median(a) / NS_PER_MS if a else 0.0, f=statistics.median(f) / NS_PER_MS,
        t=statistics.median(t) / NS_PER_MS,
        attention_busy=a_busy / a_span if a_span > 0 else 0.0, ffn_busy=f_busy / f_span if f_span > 0 else 0.0,
        layers_ms=a_span / NS_PER_MS,
    )


def median_costs(costs: Iterable[ExchangeCosts]) -> ExchangeCosts:
    """Field-wise median over steps of one shape."""
    costs = list(costs)
    if not costs:
        raise ValueError("stage_model: no steps to summarise; were the timeline windows empty?")
    return ExchangeCosts(
        num_layers=costs[0].num_layers, num_stages=costs[0].num_stages,
        **{name: statistics.median(getattr(c, name) for c in costs)
           for name in ("a", "f", "t", "attention_busy", "ffn_busy", "layers_ms")})


def read_steps(directory: Path, role: str) -> list:
    """`<directory>/<role>-0.jsonl` as `StepRecord`s (wire/timeline.py); [] when that rank wrote none.

    Needs overlay/ on sys.path (vllm_afd.wire imports no vLLM); imported here, not at the top, so that the
    model itself stays a module of plain arithmetic.
    """
    from vllm_afd.wire.timeline import read_records

    path = directory / f"{role}-0.jsonl"
    return read_records(path) if path.exists() else []


def batch_costs(attention: Iterable[object], ffn: Iterable[object], rows: int,
                windows: Sequence[Sequence[int]]) -> ExchangeCosts | None:
    """Median per-exchange costs of the measured decode steps of `rows` rows opened inside `windows`.

    `windows`: (start, end) host ns (time.perf_counter_ns, one clock for every process of a host) of the
    timed requests; steps outside them (warm-up requests, the prefill-only request, other batches) and
    warm-up, profile and mark-less steps are left out, and each attention step is joined with the FFN's
    record of the same step_seq.  None when no step qualifies.
    """
    by_seq = {r.step_seq: r for r in ffn}  # type: ignore[attr-defined]
    steps = [r for r in attention  # type: ignore[attr-defined]
             if r.rows == rows and r.marks and not (r.warmup or r.profile) and r.step_seq in by_seq
             and any(lo <= r.opened_ns <= hi for lo, hi in windows)]
    if not steps:
        return None
    return median_costs(exchange_costs(r, by_seq[r.step_seq]) for r in steps)


def stages_run(num_stages: int, batch: int, min_tokens_per_stage: int) -> int:
    """The stages a decode step of `batch` requests runs (attention/stages.py:stages_for_step, vLLM-free copy)."""
    return num_stages if batch >= num_stages * min_tokens_per_stage else 1


@dataclass(frozen=True, slots=True)
class Linear:
    """y = fixed + per_token × n (least squares)."""

    fixed: float
    per_token: float

    def __call__(self, n: float) -> float:
        return self.fixed + self.per_token * n


def fit_linear(points: Sequence[tuple[float, float]]) -> Linear:
    """Least-squares line through (n, y); one point gives a flat line (all fixed cost, the pessimistic reading)."""
    if not points:
        raise ValueError("stage_model: no (batch, cost) points to fit; measure one stage at >= 1 batch size")
    if len({n for n, _ in points}) == 1:
        return Linear(statistics.mean(y for _, y in points), 0.0)
    mean_n = statistics.mean(n for n, _ in points)
    mean_y = statistics.mean(y for _, y in points)
    slope = (sum((n - mean_n) * (y - mean_y) for n, y in points)
             / sum((n - mean_n) ** 2 for n, _ in points))
    return Linear(mean_y - slope * mean_n, slope)


def simulate_layers(a: float, f: float, t: float, num_layers: int, num_stages: int, *,
                    shared_device: bool = False) -> float:
    """Time from the first attention compute to the last FFN output back, for one step of k stages.

    Each role is one core working through its exchanges in E order (layer-major, stage-minor); stage j's
    attention of layer l waits for its FFN output of layer l-1, the FFN's (l, j) for its rows; the wire adds
    t/2 each way and occupies neither role.  One stage: L (a + t + f).  `shared_device`: both roles' compute
    runs on one device that does one thing at a time (both roles time-sliced on one GPU): a stage's compute
    overlaps only the other stages' wire, never the other role's compute.
    """
    if num_layers < 1 or num_stages < 1:
        raise ValueError(f"stage_model: need >= 1 layer and stage, got {num_layers} layers, {num_stages} stages")
    attention_free = ffn_free = 0.0
    back = [0.0] * num_stages  # when stage j's FFN output of the previous layer reached the attention
    for _ in range(num_layers):
        arrive = []
        for stage in range(num_stages):
            attention_free = max(attention_free, back[stage]) + a
            arrive.append(attention_free + t / 2)
        if shared_device:
            ffn_free = max(ffn_free, attention_free)  # the device runs the layer's attention first
        for stage in range(num_stages):
            ffn_free = max(ffn_free, arrive[stage]) + f
            back[stage] = ffn_free + t / 2
        if shared_device:
            attention_free = ffn_free  # and the next layer's after the FFN
    return max(back)


def predicted_step_ms(step_1: float, fits: tuple[Linear, Linear, Linear], batch: int, num_layers: int,
                      num_stages: int) -> float:
    """A k-stage step of `batch` tokens: the 1-stage step with its layers re-simulated at n/k tokens per stage.

    `step_1`: the measured 1-stage step at this batch; its host share (everything outside the crossing layers:
    scheduling, sampling, embedding, the head) is taken as unchanged by the split.
    """
    a, f, t = fits
    layers_1 = simulate_layers(a(batch), f(batch), t(batch), num_layers, 1)
    per_stage = batch / num_stages
    layers_k = simulate_layers(a(per_stage), f(per_stage), t(per_stage), num_layers, num_stages)
    return step_1 - layers_1 + layers_k
