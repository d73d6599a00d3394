"""Each micro-batch stage variant's predicted k ÷ 1 tok/s ratio, from its one-stage twin's timeline (issue 13).

With `--timeline`, a round's bench is annotated after its servers stopped: per bench part (one per prompt
length) and stage variant, `stage_prediction[variant]` holds, per batch, the measured tok/s ÷ the twin's,
the ratio docs/pingpong.md#10-predicted-speed-up predicts, and each role's busy share at one stage
(e2e_report.py puts them in the stage table).  The prediction is scripts/stage_model.py's, as in
scripts/bench_afd_cpu.py: the twin's per-exchange a, f, t (median over its decode steps inside the bench's
request windows) fitted over the benched batch sizes, the twin's TPOT kept as the step and its layers
re-simulated at n/k tokens per stage.

On the H200 both roles share one GPU and their kernels time-slice, so the model, which runs the roles side
by side, predicts what two GPUs would give.  Pure apart from reading the timeline files; tests:
tests/tools/test_stage_prediction.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

# stage_model.py sits in scripts/; the timeline records' parser in overlay/ (vllm_afd.wire imports no vLLM).
import repo_paths  # noqa: F401
import serving
import stage_model

COST_NAMES = ("a", "f", "t")


def annotate(bench: dict[str, Any], timeline_root: Path) -> None:
    """Set `stage_prediction` on the bench and on each of its `by_prompt_len` parts (each has its own windows).

    `timeline_root`: the round's logs/timeline/<model>, one folder per AFD variant.  Twin timelines that are
    missing give predictions of None (the table's "—"), not an error.
    """
    staged = [v for v in serving.STAGE_TWINS if v in bench.get("variants", {})]
    if not staged:
        return
    records = {twin: (stage_model.read_steps(timeline_root / twin, "attention"),
                      stage_model.read_steps(timeline_root / twin, "ffn"))
               for twin in {serving.STAGE_TWINS[v] for v in staged}}
    for part in (bench, *bench.get("by_prompt_len", {}).values()):
        if "variants" in part:
            part["stage_prediction"] = {v: predict(part, v, records[serving.STAGE_TWINS[v]]) for v in staged}


def predict(part: Mapping[str, Any], variant: str, twin_records: tuple[list, list]) -> dict[str, Any]:
    """One stage variant of one bench part: its twin's fitted costs, then per batch measured vs predicted.

    `twin_records`: the twin's attention and FFN `StepRecord`s (stage_model.read_steps).
    """
    twin, num_stages = serving.STAGE_TWINS[variant], serving.AFD_VARIANTS[variant][3]
    variants, windows = part["variants"], part.get("windows_ns", {}).get(twin, {})
    costs = {batch: stage_model.batch_costs(*twin_records, batch, windows.get(str(batch), []))
             for batch in part["batches"]}
    measured = [(batch, c) for batch, c in costs.items() if c is not None]
    fits = tuple(stage_model.fit_linear([(b, getattr(c, name)) for b, c in measured])
                 for name in COST_NAMES) if measured else None
    batches = {}
    for batch, c1 in costs.items():
        rate, twin_rate = (variants.get(name, {}).get(str(batch)) for name in (variant, twin))
        ran = stage_model.stages_run(num_stages, batch, serving.MIN_TOKENS_PER_STAGE)
        predicted = None
        if fits is not None and c1 is not None and twin_rate:
            step_1 = twin_rate["tpot_ms"]  # the twin's measured step: its host share kept, its layers re-simulated
            step_k = stage_model.predicted_step_ms(step_1, fits, batch, c1.num_layers, ran)
            # NOTE: a line fitted through two noisy points can go negative at n/k; no prediction then.
            predicted = step_1 / step_k if step_k > 0 else None
        batches[str(batch)] = {"measured": rate["tok_s"] / twin_rate["tok_s"] if rate and twin_rate else None,
                               "predicted": predicted, "stages_run": ran,
                               "attention_busy_1_stage": c1.attention_busy if c1 else None,
                               "ffn_busy_1_stage": c1.ffn_busy if c1 else None}
    result: dict[str, Any] = {"twin": twin, "batches": batches, "fits_ms": None}
    if fits is None:
        result["missing"] = (f"no decode step of {twin} inside the bench's request windows in "
                             f"logs/timeline/<model>/{twin}/{{attention,ffn}}-0.jsonl; expected the files of a "
                             "--timeline round (the table shows —)")
    else:
        result["fits_ms"] = {name: {"fixed": fit.fixed, "per_token": fit.per_token}
                             for name, fit in zip(COST_NAMES, fits)}
    return result
