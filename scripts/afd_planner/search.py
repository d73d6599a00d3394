"""The search: every deployment of N GPUs at its best batch under the TPOT bound, ranked by decode tok/s per GPU."""

from __future__ import annotations

from dataclasses import dataclass

from stage_model import stages_run

from .cost import CostModel
from .profile import Memory

__all__ = ["Candidate", "Plan", "best_batch", "plan"]


@dataclass(frozen=True, slots=True)
class Candidate:
    """One deployment at its best batch."""

    kind: str  # "colocated" or "afd"
    label: str  # "DP x EP 4", "TP 4", "3A:1F"
    attention_ranks: int  # AFD: A (colocated: the GPUs)
    ffn_ranks: int  # AFD: F (colocated: 0)
    num_stages: int
    batch: int  # requests per attention rank (TP: per replica)
    step_ms: float  # = TPOT
    tok_s_per_gpu: float
    meets_tpot: bool
    max_batch: int  # the batch bound of this deployment: --max-batch, or what fits in memory


@dataclass(frozen=True, slots=True)
class Plan:
    gpus: int
    context: int
    tpot_ms: float | None
    baseline: Candidate  # the best colocated deployment
    colocated: tuple[Candidate, ...]
    afd: tuple[Candidate, ...]  # best first

    @property
    def best_afd(self) -> Candidate | None:
        return self.afd[0] if self.afd else None

    def afd_wins(self, margin: float) -> bool:
        """The best AFD split beats the colocated baseline by more than `margin` (e.g. 0.05) and meets the TPOT."""
        best = self.best_afd
        return (best is not None and best.meets_tpot
                and (not self.baseline.meets_tpot or best.tok_s_per_gpu > self.baseline.tok_s_per_gpu * (1 + margin)))


def best_batch(step_ms, tokens_per_step, gpus: int, max_batch: int, tpot_ms: float | None,
               allowed=lambda batch: True) -> tuple[int, float, float, bool]:
    """(batch, step ms, tok/s per GPU, meets TPOT) of the batch in 1..max_batch with the most tok/s per GPU
    whose step stays within `tpot_ms`; when none does, the batch with the shortest step."""
    best = fallback = None
    for batch in range(1, max_batch + 1):
        if not allowed(batch):
            continue
        step = step_ms(batch)
        rate = tokens_per_step(batch) / step * 1e3 / gpus
        if tpot_ms is None or step <= tpot_ms:
            if best is None or rate > best[2]:
                best = (batch, step, rate, True)
        elif fallback is None or step < fallback[1]:
            fallback = (batch, step, rate, False)
    result = best or fallback
    assert result is not None, "no batch evaluated"
    return result


def batch_limits(memory: Memory | None, gpus: int, context: int, max_batch: int) -> dict[str, object]:
    """Batch bounds: per colocated DP x EP rank, per TP replica (`max_batch` per GPU, KV split N ways), per AFD
    attention rank given F (0: the experts do not fit), from `max_batch` and the profile's memory."""
    if memory is None:
        return {"dp_ep": max_batch, "tp": max_batch * gpus, "afd": lambda ffn_ranks: max_batch}
    experts, dense = memory.expert_weights_gib, memory.dense_weights_gib

    def afd(ffn_ranks: int) -> int:
        if memory.batch_limit(experts / ffn_ranks, 1, 0) < 1:
            return 0  # the FFN ranks cannot hold the experts
        return min(max_batch, memory.batch_limit(dense, 1, context))

    return {"dp_ep": min(max_batch, memory.batch_limit(dense + experts / gpus, 1, context)),
            "tp": min(max_batch * gpus, memory.batch_limit((dense + experts) / gpus, 1 / gpus, context)), "afd": afd}


def plan(model: CostModel, gpus: int, context: int, tpot_ms: float | None = None, max_batch: int = 256,
         min_tokens_per_stage: int = 4, max_stages: int = 3, memory: Memory | None = None) -> Plan:
    """Colocated DP x EP and TP on `gpus`, and AFD xA:yF (x + y = gpus, x >= y) at 1..max_stages stages; a
    deployment whose weights do not fit (`memory`) is left out."""
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    limits = batch_limits(memory, gpus, context, max_batch)
    colocated = []
    for label, key, step in ((f"DP x EP {gpus}", "dp_ep", lambda b: model.colocated_dp_ep_ms(gpus, b, context)),
                             (f"TP {gpus}", "tp", lambda b: model.colocated_tp_ms(gpus, b, context))):
        tokens = (lambda b: b * gpus) if key == "dp_ep" else (lambda b: b)
        if limits[key] >= 1:
            batch, step_ms, rate, ok = best_batch(step, tokens, gpus, limits[key], tpot_ms)
            colocated.append(Candidate("colocated", label, gpus, 0, 1, batch, step_ms, rate, ok, limits[key]))
        if gpus == 1:
            break  # DP x EP 1 and TP 1 are the same deployment
    if not colocated:
        raise ValueError(f"the model does not fit on {gpus} GPU(s) colocated at context {context} (profile's memory); "
                         "add GPUs or shorten --context")
    colocated.sort(key=lambda c: (c.meets_tpot, c.tok_s_per_gpu), reverse=True)
    afd = []
    for ffn_ranks in range(1, gpus // 2 + 1):
        attention_ranks = gpus - ffn_ranks
        limit = limits["afd"](ffn_ranks)  # type: ignore[operator]
        if limit < 1:
            continue  # the F ranks cannot hold the experts, or the attention no request
        for stages in range(1, max_stages + 1):
            if stages_run(stages, limit, min_tokens_per_stage) != stages:
                continue  # no batch up to max_batch splits this many ways
            batch, step_ms, rate, ok = best_batch(
                lambda b, x=attention_ranks, y=ffn_ranks, k=stages: model.afd_ms(x, y, k, b, context),
                lambda b, x=attention_ranks: b * x, gpus, limit, tpot_ms,
                allowed=lambda b, k=stages: stages_run(k, b, min_tokens_per_stage) == k)
            afd.append(Candidate("afd", f"{attention_ranks}A:{ffn_ranks}F", attention_ranks, ffn_ranks, stages,
                                 batch, step_ms, rate, ok, limit))
    afd.sort(key=lambda c: (c.meets_tpot, c.tok_s_per_gpu), reverse=True)
    return Plan(gpus, context, tpot_ms, colocated[0], tuple(colocated), tuple(afd))
