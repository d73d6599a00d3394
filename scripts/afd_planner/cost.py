"""The cost model (docs/planner.md#the-cost-model): per-layer costs fitted from a profile, and the decode step of
colocated vLLM (DP x EP, TP) and of AFD xA:yF with k micro-batch stages.

Per layer, ms:
  attention a(B, L) = a0 + a1 B + a2 B L                      (projections, then KV reads growing with B x L)
  FFN       f(T, e) = f_w touched(T, e) + f0 + f_t T k e / E  (weight reads of the experts touched, plus rows)
            touched(T, e) = e (1 - (1 - k/E)^T): expected experts of a rank's e hit by T tokens' top-k
  wire      the profile's transport samples (latency + bytes x slope), or a `Link`
  EP        colocated DP x EP: vLLM's allgather_reducescatter (two rings), or one-shot all-to-all kernels
            (deepep_low_latency: every row to each rank holding one of its experts, all ranks at once)
All coefficients are non-negative least squares; a fit with fewer samples than terms keeps the first terms
(a flat line from one sample, as stage_model.fit_linear).  Stages overlap as stage_model.simulate_layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stage_model import Linear, fit_linear, simulate_layers

from .links import LINKS, Link
from .profile import ModelShape, Profile

__all__ = ["EP_ALL2ALL", "EP_ALL_TO_ALL", "EP_RINGS", "CostModel", "fit_nonneg", "touched_experts"]

# vLLM's --all2all-backend values the colocated DP x EP is modelled for; the first is vLLM's default and the
# one AFD's FFN pool runs (docs/config.md#ffn-data-parallelism).
EP_RINGS = "allgather_reducescatter"
EP_ALL_TO_ALL = "deepep_low_latency"
EP_ALL2ALL = (EP_RINGS, EP_ALL_TO_ALL)


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(rhs)
    m = [row[:] + [value] for row, value in zip(matrix, rhs)]
    scale = max((abs(v) for row in matrix for v in row), default=0.0) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-12 * scale:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                factor = m[r][col] / m[col][col]
                m[r] = [x - factor * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_nonneg(rows: list[list[float]], y: list[float]) -> list[float]:
    """Least squares y ~ rows . c with every c >= 0; columns are in priority order, the last dropped first."""
    assert rows and len(rows) == len(y)
    active = list(range(len(rows[0])))
    while active:
        normal = [[sum(r[i] * r[j] for r in rows) for j in active] for i in active]
        rhs = [sum(r[i] * v for r, v in zip(rows, y)) for i in active]
        solution = _solve(normal, rhs)
        if solution is None:
            active.pop()
            continue
        if min(solution) < 0:
            active.pop(solution.index(min(solution)))
            continue
        coef = [0.0] * len(rows[0])
        for index, value in zip(active, solution):
            coef[index] = value
        return coef
    return [0.0] * len(rows[0])


def touched_experts(tokens: float, experts: float, num_experts: int, top_k: int) -> float:
    """Expected experts among a rank's `experts` that `tokens` tokens' top-k routing hits (uniform routing)."""
    return experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def _nonneg_line(points: list[tuple[float, float]]) -> Linear:
    line = fit_linear(points)
    return line if line.per_token >= 0 and line.fixed >= 0 else fit_linear([(0.0, max(y for _, y in points))])


@dataclass(frozen=True, slots=True)
class CostModel:
    """Per-layer and per-step costs of one profile over one wire (`link`; None = the profile's own transport)."""

    shape: ModelShape
    attention_coef: tuple[float, float, float]  # a0, a1 (per request), a2 (per request x context token)
    ffn_coef: tuple[float, float, float]  # f_w (per touched expert), f0, f_t (per routed row)
    transport: Linear  # the profile's wire: round trip ms over one-way bytes
    step: Linear  # host share per step over the batch of one rank
    afd_step_extra_ms: float
    link: Link | None
    collective_link: Link  # between FFN ranks (EP) and between colocated ranks (EP, TP)
    # Hosts of this many GPUs (0: one link for everything): a collective among at most this many ranks, and the
    # A<->F exchange of a deployment that fits one host, run on `host_link`; the rest on the links above.
    gpus_per_host: int = 0
    host_link: Link = LINKS["nvlink"]
    ep_all2all: str = EP_RINGS  # the colocated DP x EP's dispatch and combine

    def __post_init__(self) -> None:
        assert self.ep_all2all in EP_ALL2ALL, self.ep_all2all

    @classmethod
    def from_profile(cls, profile: Profile, link: Link | None, collective_link: Link, *, gpus_per_host: int = 0,
                     host_link: Link = LINKS["nvlink"], ep_all2all: str = EP_RINGS) -> CostModel:
        shape = profile.model
        a = fit_nonneg([[1.0, s.batch, s.batch * s.context] for s in profile.attention],
                       [s.ms for s in profile.attention])
        f = fit_nonneg([[touched_experts(s.tokens, s.experts, shape.num_experts, shape.top_k), 1.0,
                         s.tokens * shape.top_k * s.experts / shape.num_experts] for s in profile.ffn],
                       [s.ms for s in profile.ffn])
        return cls(shape=shape, attention_coef=tuple(a), ffn_coef=tuple(f),  # type: ignore[arg-type]
                   transport=_nonneg_line([(s.bytes, s.ms) for s in profile.transport]),
                   step=_nonneg_line([(s.batch, s.ms) for s in profile.step]),
                   afd_step_extra_ms=profile.afd_step_extra_ms, link=link, collective_link=collective_link,
                   gpus_per_host=gpus_per_host, host_link=host_link, ep_all2all=ep_all2all)

    def attention(self, batch: float, context: int) -> float:
        a0, a1, a2 = self.attention_coef
        return a0 + a1 * batch + a2 * batch * context

    def ffn(self, tokens: float, experts: float) -> float:
        f_w, f0, f_t = self.ffn_coef
        s = self.shape
        return (f_w * touched_experts(tokens, experts, s.num_experts, s.top_k) + f0
                + f_t * tokens * s.top_k * experts / s.num_experts)

    def in_one_host(self, ranks: int) -> bool:
        return 0 < ranks <= self.gpus_per_host

    def wire(self, rows: float, gpus: int) -> float:
        """One A<->F exchange of `rows` rows, out and back, in a deployment of `gpus` GPUs: on the host's link
        when they fit one host, else on the link between hosts (whose slowest pair sets the step)."""
        num_bytes = self.shape.activation_bytes(rows)
        if self.link is None:
            return self.transport(num_bytes)
        return (self.host_link if self.in_one_host(gpus) else self.link).round_trip_ms(num_bytes)

    def gather(self, ranks: int, rows_per_rank: float) -> float:
        """One ring all-gather (or reduce-scatter) of `rows_per_rank` rows from each of `ranks` ranks: each of
        its ranks - 1 steps waits for the ring's slowest hop, a link between hosts once the ring spans two."""
        link = self.host_link if self.in_one_host(ranks) else self.collective_link
        return (ranks - 1) * link.one_way_ms(self.shape.activation_bytes(rows_per_rank))

    def all_to_all(self, ranks: int, rows_per_rank: float) -> float:
        """One dispatch (or combine) of `rows_per_rank` rows from each of `ranks` ranks, each row sent once to every
        other rank holding one of its top-k experts (uniform routing), all ranks and peers at once: one message's
        latency and the bytes of the busier of a rank's two links, the host's and (beyond a host) the one between."""
        hit = 1.0 - (1.0 - 1.0 / ranks) ** self.shape.top_k  # a peer holds one of a row's experts
        peers_in_host = min(ranks, self.gpus_per_host or ranks) - 1
        peers_beyond = ranks - 1 - peers_in_host

        def leg(link: Link, peers: int) -> float:
            return link.one_way_ms(self.shape.activation_bytes(rows_per_rank * peers * hit)) if peers else 0.0

        inside = self.host_link if self.gpus_per_host else self.collective_link
        return max(leg(inside, peers_in_host), leg(self.collective_link, peers_beyond))

    def ep_exchange(self, ranks: int, rows_per_rank: float) -> float:
        """The colocated DP x EP's dispatch and combine of one layer over `ranks` ranks (`ep_all2all`)."""
        if ranks == 1:
            return 0.0
        if self.ep_all2all == EP_ALL_TO_ALL:
            return 2 * self.all_to_all(ranks, rows_per_rank)
        return 2 * self.gather(ranks, rows_per_rank)

    def step_fixed(self, batch: float) -> float:
        return self.step(batch)

    # --- the decode step of each deployment, ms (one TPOT) ---

    def colocated_dp_ep_ms(self, gpus: int, batch: int, context: int) -> float:
        """DP x EP over `gpus`: each rank attends its `batch`, exchanges rows (`ep_exchange`), runs its E/N experts."""
        layer = (self.attention(batch, context) + self.ffn(gpus * batch, self.shape.num_experts / gpus)
                 + self.ep_exchange(gpus, batch))
        return self.shape.num_layers * layer + self.step_fixed(batch)

    def colocated_tp_ms(self, gpus: int, batch: int, context: int) -> float:
        """TP over `gpus`: heads and every expert's width split N ways, two all-reduces per layer."""
        layer = (self.attention(batch, context) + self.ffn(batch, self.shape.num_experts)) / gpus
        if gpus > 1:
            layer += 2 * 2 * self.gather(gpus, batch / gpus)  # all-reduce = reduce-scatter + all-gather
        return self.shape.num_layers * layer + self.step_fixed(batch)

    def afd_layer_costs(self, attention_ranks: int, ffn_ranks: int, rows: float, context: int
                        ) -> tuple[float, float, float]:
        """(a, f, t) of one exchange of `rows` rows per attention rank (one stage's share)."""
        block = math.ceil(attention_ranks / ffn_ranks)  # attention ranks behind the busiest FFN rank
        f = self.ffn(attention_ranks * rows, self.shape.num_experts / ffn_ranks)
        if ffn_ranks > 1:
            f += 2 * self.gather(ffn_ranks, block * rows)
        return self.attention(rows, context), f, self.wire(block * rows, attention_ranks + ffn_ranks)

    def afd_ms(self, attention_ranks: int, ffn_ranks: int, num_stages: int, batch: int, context: int, *,
               shared_device: bool = False) -> float:
        """AFD xA:yF: every attention rank decodes `batch` in `num_stages` stages of batch/k rows.

        `shared_device`: both roles on one device that runs one role's kernels at a time (1A1F on one GPU).
        """
        a, f, t = self.afd_layer_costs(attention_ranks, ffn_ranks, batch / num_stages, context)
        layers = simulate_layers(a, f, t, self.shape.num_layers, num_stages, shared_device=shared_device)
        return layers + self.step_fixed(batch) + self.afd_step_extra_ms
