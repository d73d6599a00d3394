"""``AFDConfig``: the fields with their meaning and defaults, and the keys of the mapping it is parsed from."""

from __future__ import annotations

import copy
import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_afd.config.coercion import COERCERS, FrozenMapping
from vllm_afd.config.constants import ALIASES, DEFAULT_MIN_TOKENS_PER_STAGE, RUNTIME_ONLY_FIELDS
from vllm_afd.config.rules import check_values


@dataclass(frozen=True, kw_only=True, slots=True)
class AFDConfig:
    """Validated AFD settings of one process; build it with ``from_mapping`` or ``parse_afd_config``."""

    # Which half of every decoder layer this process runs: "attention" or "ffn".
    role: str = "attention"
    # Transport between the roles: P2pNcclAFDConnector (CUDA, across hosts), P2pIpcAFDConnector (CUDA,
    # one node, graphs too) or P2pGlooAFDConnector (CPU, or one GPU eager).
    connector: str = "P2pNcclAFDConnector"
    # Address of FFN rank 0, which hosts the rendezvous store.
    host: str = "127.0.0.1"
    # The one rendezvous TCP port; FFN rank 0 listens on it.
    port: int = 1239
    # A: attention workers in total (attention DP x TP).
    num_attention_ranks: int = 1
    # F: FFN workers in total (FFN DP x TP); A >= F, no divisibility required.
    num_ffn_ranks: int = 1
    # False: the FFN runs router and experts and every layer crosses; True: only MoE layers cross.
    compute_gate_on_attention: bool = False
    # Micro-batches per step (1, 2 or 3): the attention computes stage k+1 while the FFN computes stage k
    # (docs/pingpong.md); equal on both roles (the handshake compares it). Only 1 runs today.
    num_stages: int = 1
    # Attention only: a step splits only when every stage gets at least this many real tokens; below it the
    # per-stage fixed costs (a round trip, the experts' weight reads, a handoff) outweigh the overlap
    # (docs/pingpong.md#31-stage-count-and-ranges-attentionstagespy, docs/pingpong.md#10-predicted-speed-up;
    # tuned by scripts/bench_afd_cpu.py, docs/benchmarks.md).
    min_tokens_per_stage: int = DEFAULT_MIN_TOKENS_PER_STAGE
    # Options of the selected connector, parsed by it; must be empty for both of ours.
    connector_extra_config: Mapping[Any, Any] = field(default_factory=FrozenMapping, hash=False)
    # Bound on rendezvous plus handshake, in seconds.
    rendezvous_timeout_s: float = 300.0
    # Bound on one step's traffic once serving, in seconds.
    step_timeout_s: float = 120.0
    # A peer whose heartbeat is unchanged this long, in seconds, is lost.
    peer_timeout_s: float = 5.0
    # Bound on one step, transfer or device wait before step timeouts are armed (profile, warm-up, graph
    # capture, the first forwards' compilation), in seconds: generous, since compilation can take minutes.
    startup_timeout_s: float = 1800.0
    # After losing the peer, wait this long, in seconds, for it to return and pair again: the FFN re-forms,
    # an eager attention heals (docs/connection.md#re-forming, #healing-attention); 0 = end on a lost peer.
    reform_timeout_s: float = 600.0
    # Directory each rank appends its per-step timeline to (docs/timeline.md); "" = no timeline files.
    timeline_dir: str = ""
    # File holding the shared secret both roles prove at pairing (docs/security.md); "" = VLLM_AFD_SECRET, or
    # none. Only the path is configuration: the secret is read by the connector, never logged or hashed.
    secret_file: str = ""
    # Seal every data message with a header (step, exchange, stage, rows, bytes) and a CRC-32, checked on receipt
    # (docs/protocol.md#integrity-mode); equal on both roles (the handshake compares it). Gloo, or NCCL eager.
    integrity: bool = False

    def __post_init__(self) -> None:
        # Direct construction obeys the same coercion and rules as parsing (idempotent for parsed input).
        for name in FIELD_NAMES:
            object.__setattr__(self, name, COERCERS[name](name, getattr(self, name)))
        check_values(self.to_mapping(), async_dp=False, expected_role=None)

    @classmethod
    def from_mapping(cls, raw: Any, expected_role: str | None = None) -> AFDConfig:
        """Parse the value of ``additional_config["afd"]`` (docs/config.md#validation-order, 2-12)."""
        if not isinstance(raw, Mapping):
            raise TypeError(
                f"AFD config must be a mapping, got {type(raw).__name__}; pass "
                """--additional-config '{"afd": {"role": "attention", ...}}'"""
            )
        given = _canonical_items(raw)
        coerced = {name: COERCERS[name](name, given[name]) for name in COERCERS if name in given}
        async_dp = coerced.pop("async_dp", False)
        values = {**_DEFAULTS, **coerced}
        check_values(values, async_dp=async_dp, expected_role=expected_role)
        return cls(**values)

    def to_mapping(self) -> dict[str, Any]:
        """Canonical keys only; ``from_mapping(cfg.to_mapping()) == cfg``."""
        values = {name: getattr(self, name) for name in FIELD_NAMES}
        values["connector_extra_config"] = copy.deepcopy(dict(self.connector_extra_config))
        return values

    @property
    def num_role_ranks(self) -> int:
        """Worker count of this process's role (A or F)."""
        return self.num_attention_ranks if self.role == "attention" else self.num_ffn_ranks


FIELD_NAMES = tuple(f.name for f in dataclasses.fields(AFDConfig))
_DEFAULTS = {
    f.name: (f.default_factory() if f.default is dataclasses.MISSING else f.default)  # type: ignore[misc]
    for f in dataclasses.fields(AFDConfig)
}
_INPUT_KEYS = frozenset(COERCERS)


def _canonical_items(raw: Mapping[Any, Any]) -> dict[str, Any]:
    """Validation step 3 (docs/config.md#validation-order): map aliases to canonical keys; reject
    duplicates, then unknown keys."""
    given_as: dict[Any, Any] = {}
    for key in raw:
        canonical = ALIASES.get(key, key) if isinstance(key, str) else key
        if canonical in given_as:
            first, second = sorted((given_as[canonical], key), key=lambda k: k == canonical)
            raise ValueError(
                f"duplicate AFD config field for {canonical!r} (given as {first!r} and {second!r}); "
                "keep only the canonical key"
            )
        given_as[canonical] = key
    for canonical, key in given_as.items():
        if canonical not in _INPUT_KEYS:
            raise ValueError(_unknown_field_message(key))
    return {canonical: raw[key] for canonical, key in given_as.items()}


def _unknown_field_message(key: Any) -> str:
    message = (
        f"unknown AFD config field {key!r}; connector-specific values belong under "
        "connector_extra_config"
    )
    hint = RUNTIME_ONLY_FIELDS.get(key) if isinstance(key, str) else None
    if hint is None:
        close = difflib.get_close_matches(str(key), [*FIELD_NAMES, *ALIASES], n=1)
        hint = f"did you mean {close[0]!r}" if close else None
    if hint is not None:
        message += f"; {hint}"
    aliases = ", ".join(f"{alias} -> {name}" for alias, name in ALIASES.items())
    return f"{message}. Valid fields: {', '.join(FIELD_NAMES)}, async_dp (aliases: {aliases})"
