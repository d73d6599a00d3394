"""AFD configuration: ``additional_config["afd"]`` parsed once into a frozen ``AFDConfig``.

The only channel is vLLM's ``additional_config`` (docs/config.md#activation-and-sources): the presence
of ``afd`` activates AFD, and a present config must validate, never silently deactivate. Parsing
follows the fixed order of docs/config.md#validation-order and stops at the first failure, so a user
sees the same message whatever else is wrong. The role worker parses once per process and hands the
result down (``ParsedAdditionalConfig``, ``afd_config_of``). This module imports neither torch nor
vLLM: vLLM's plugin loader imports the overlay in every process, and every check here must finish
before any socket, group or device memory is taken.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import numbers
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "AFD_KEY",
    "ALIASES",
    "AFDConfig",
    "CAM_CONNECTORS",
    "CONNECTORS",
    "CONNECTOR_HINT",
    "FIELD_NAMES",
    "DEFAULT_MIN_TOKENS_PER_STAGE",
    "NUM_STAGES",
    "ROLES",
    "RUNTIME_ONLY_FIELDS",
    "check_p2p_extra_config",
    "get_additional_config",
    "ParsedAdditionalConfig",
    "afd_config_of",
    "parse_afd_config",
    "require_afd_config",
]

AFD_KEY = "afd"
ROLES = ("attention", "ffn")
# NCCL: one GPU per rank, across hosts; IPC: ranks of one node (one GPU or peer GPUs); gloo: CPU, eager.
CONNECTORS = ("P2pNcclAFDConnector", "P2pGlooAFDConnector", "P2pIpcAFDConnector")
# What to use instead, in the messages that refuse a connector name.
CONNECTOR_HINT = ("'P2pNcclAFDConnector' (CUDA, across hosts), 'P2pIpcAFDConnector' (CUDA, one node) or "
                  "'P2pGlooAFDConnector' (CPU, eager)")
# Known names of the Ascend connectors of the reference plugin: rejected with their own message
# (docs/config.md#validation-order, step 7).
CAM_CONNECTORS = ("CAMP2pAFDConnector", "CAMAsyncAFDConnector")

# Input alias (the reference's spelling) -> canonical key. Never both in one config.
ALIASES = {
    "afd_connector": "connector",
    "afd_role": "role",
    "afd_port": "port",
    "afd_host": "host",
    "async": "async_dp",
}

# Names the reference accepted but which are runtime state here; each gets a targeted hint.
RUNTIME_ONLY_FIELDS = {
    # Derived at runtime: a configured role rank double-counted the DP start rank (docs/topology.md#role-rank).
    "afd_role_rank": "role ranks are derived at runtime; remove it",
    "rank": "ranks are derived from vLLM's distributed ranks at runtime; remove it",
    "afd_server_rank": "FFN ranks are derived at runtime; remove it",
    "num_attention_servers": "the attention worker count is 'num_attention_ranks'",
    "num_ffn_servers": "the FFN worker count is 'num_ffn_ranks'",
    "enabled": 'the presence of additional_config["afd"] enables AFD; remove it',
    "afd_extra_config": "connector options go under 'connector_extra_config'",
    "extra_config": "connector options go under 'connector_extra_config'",
}

# Micro-batch stages per step a config may name (docs/pingpong.md).
NUM_STAGES = (1, 2, 3)
# The fewest real tokens per stage before a step splits. NOTE: 4 from the CPU stage benchmark
# (docs/benchmarks.md, "Side by side, settled"): stages of 1-2 tokens ran 0.90-0.96x one stage, 4 and more
# 1.25-1.32x; each stage pays the weight reads and an exchange again.
DEFAULT_MIN_TOKENS_PER_STAGE = 4

_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})


class _FrozenMapping(Mapping):
    """Read-only, picklable, deep-copied mapping; the value of ``connector_extra_config``."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[Any, Any] = ()) -> None:
        self._data = copy.deepcopy(dict(data))

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return repr(self._data)

    # NOTE: a tuple, because pickle skips __setstate__ for a false state such as an empty dict.
    def __getstate__(self) -> tuple[dict[Any, Any]]:
        return (self._data,)

    def __setstate__(self, state: tuple[dict[Any, Any]]) -> None:
        (self._data,) = state


# --- coercion (docs/config.md#coercion): every failure is a TypeError naming the field and the value


def _coerce_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
    shown = "async" if name == "async_dp" else name
    raise TypeError(
        f"{shown} must be a boolean, got {value!r}; use true/false (1/0, yes/no and on/off are "
        "accepted too)"
    )


def _coerce_int(name: str, value: Any) -> int:
    problem = isinstance(value, (bool, float))
    if not problem:
        try:
            result = int(value)
        except (TypeError, ValueError):
            problem = True
        else:
            # NOTE: int() truncates Decimal/Fraction silently; a non-whole number is a typo here.
            problem = isinstance(value, numbers.Number) and result != value
    if problem:
        raise TypeError(f"{name} must be an integer, got {value!r}; pass a whole number such as 1")
    return result


def _coerce_seconds(name: str, value: Any) -> float:
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise TypeError(
        f"{name} must be a number of seconds, got {value!r}; pass an int, a float or a numeric string"
    )


def _coerce_str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {value!r}; quote the value in the JSON")
    return str(value)


def _coerce_host(name: str, value: Any) -> str:
    # NOTE: stripped because the emptiness rule (validation step 11) is "after strip" and a hostname with
    # surrounding blanks can only be a typo.
    return _coerce_str(name, value).strip()


def _coerce_mapping(name: str, value: Any) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{name} must be a mapping, got {type(value).__name__}; pass a JSON object or leave it out"
        )
    return _FrozenMapping(value)


# Coercion order = report order of validation step 4 (docs/config.md#coercion: canonical order,
# independent of the input's order).
_COERCERS: dict[str, Callable[[str, Any], Any]] = {
    "role": _coerce_str,
    "connector": _coerce_str,
    "host": _coerce_host,
    "port": _coerce_int,
    "num_attention_ranks": _coerce_int,
    "num_ffn_ranks": _coerce_int,
    "compute_gate_on_attention": _coerce_bool,
    "num_stages": _coerce_int,
    "min_tokens_per_stage": _coerce_int,
    "async_dp": _coerce_bool,
    "connector_extra_config": _coerce_mapping,
    "rendezvous_timeout_s": _coerce_seconds,
    "step_timeout_s": _coerce_seconds,
    "peer_timeout_s": _coerce_seconds,
    "reform_timeout_s": _coerce_seconds,
    "timeline_dir": _coerce_str,
}


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
    connector_extra_config: Mapping[Any, Any] = field(default_factory=_FrozenMapping, hash=False)
    # Bound on rendezvous plus handshake, in seconds.
    rendezvous_timeout_s: float = 300.0
    # Bound on one step's traffic once serving, in seconds.
    step_timeout_s: float = 120.0
    # A peer whose heartbeat is unchanged this long, in seconds, is lost.
    peer_timeout_s: float = 5.0
    # After losing the peer, wait this long, in seconds, for it to return and pair again: the FFN re-forms,
    # an eager attention heals (docs/connection.md#re-forming, #healing-attention); 0 = end on a lost peer.
    reform_timeout_s: float = 600.0
    # Directory each rank appends its per-step timeline to (docs/timeline.md); "" = no timeline files.
    timeline_dir: str = ""

    def __post_init__(self) -> None:
        # Direct construction obeys the same coercion and rules as parsing (idempotent for parsed input).
        for name in FIELD_NAMES:
            object.__setattr__(self, name, _COERCERS[name](name, getattr(self, name)))
        _check_values(self.to_mapping(), async_dp=False, expected_role=None)

    @classmethod
    def from_mapping(cls, raw: Any, expected_role: str | None = None) -> AFDConfig:
        """Parse the value of ``additional_config["afd"]`` (docs/config.md#validation-order, 2-12)."""
        if not isinstance(raw, Mapping):
            raise TypeError(
                f"AFD config must be a mapping, got {type(raw).__name__}; pass "
                """--additional-config '{"afd": {"role": "attention", ...}}'"""
            )
        given = _canonical_items(raw)
        coerced = {name: _COERCERS[name](name, given[name]) for name in _COERCERS if name in given}
        async_dp = coerced.pop("async_dp", False)
        values = {**_DEFAULTS, **coerced}
        _check_values(values, async_dp=async_dp, expected_role=expected_role)
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
_INPUT_KEYS = frozenset(_COERCERS)


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


def _check_values(values: Mapping[str, Any], *, async_dp: bool, expected_role: str | None) -> None:
    """Validation steps 5-12 (docs/config.md#validation-order) on coerced values, stopping at the
    first failure."""
    role = values["role"]
    if role not in ROLES:
        raise ValueError(f"AFD role must be one of {ROLES}, got {role!r}; set \"role\" to one of them")
    if expected_role is not None:
        if expected_role not in ROLES:
            raise ValueError(f"expected_role must be one of {ROLES} or None, got {expected_role!r}")
        if role != expected_role:
            raise ValueError(
                f"AFD role mismatch: expected {expected_role!r}, got {role!r}; this worker runs the "
                f"{expected_role} role: set \"role\": {expected_role!r} or remove --worker-cls"
            )
    connector = values["connector"]
    if connector in CAM_CONNECTORS:
        raise ValueError(
            f"AFD connector {connector!r} is an Ascend CAM connector and is not supported; use {CONNECTOR_HINT}"
        )
    if connector not in CONNECTORS:
        raise ValueError(f"AFD connector must be one of {CONNECTORS}, got {connector!r}; use {CONNECTOR_HINT}")
    if async_dp:
        raise ValueError(
            "AFD async mode requires connector='CAMAsyncAFDConnector', which is not supported; "
            "remove 'async_dp' or set it to false"
        )
    for name in ("num_attention_ranks", "num_ffn_ranks"):
        if values[name] <= 0:
            raise ValueError(
                f"{name} must be positive, got {values[name]}; set it to that role's DP x TP"
            )
    num_attention_ranks, num_ffn_ranks = values["num_attention_ranks"], values["num_ffn_ranks"]
    if num_attention_ranks < num_ffn_ranks:
        raise ValueError(
            f"{connector} requires num_attention_ranks >= num_ffn_ranks, got {num_attention_ranks} < "
            f"{num_ffn_ranks}; every FFN rank needs at least one attention peer"
        )
    _check_num_stages(values["num_stages"])
    if values["min_tokens_per_stage"] < 1:
        raise ValueError(
            f"min_tokens_per_stage must be >= 1, got {values['min_tokens_per_stage']}; set the fewest real tokens a "
            "micro-batch stage may hold (docs/pingpong.md#31-stage-count-and-ranges-attentionstagespy), or leave it out"
        )
    if not values["host"].strip():
        raise ValueError(
            f"AFD host must be non-empty, got {values['host']!r}; set \"host\" to FFN rank 0's address"
        )
    if not 1 <= values["port"] <= 65535:
        raise ValueError(
            f"AFD port must be in 1..65535, got {values['port']}; pick a free TCP port on FFN rank 0"
        )
    for name in ("rendezvous_timeout_s", "step_timeout_s", "peer_timeout_s"):
        seconds = values[name]
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"{name} must be positive and finite, got {seconds!r}; pass seconds > 0")
    reform = values["reform_timeout_s"]
    if not (math.isfinite(reform) and reform >= 0):
        raise ValueError(
            f"reform_timeout_s must be finite and >= 0, got {reform!r}; pass the seconds a role waits for its "
            "peer to return after a loss, or 0 to end instead"
        )
    check_p2p_extra_config(connector, values["connector_extra_config"])


def _check_num_stages(num_stages: int) -> None:
    """Validation step 10a (docs/config.md#validation-order): a known stage count."""
    if num_stages not in NUM_STAGES:
        raise ValueError(
            f"num_stages must be one of {NUM_STAGES}, got {num_stages}; set the micro-batches per step "
            "to 1 (no ping-pong), 2 or 3 on both roles"
        )


def check_p2p_extra_config(connector: str, raw: Any) -> Mapping[Any, Any]:
    """Validation step 12 (docs/config.md#validation-order) for our P2P connectors:
    ``connector_extra_config`` must be an empty mapping.
    """
    if not isinstance(raw, Mapping):
        raise TypeError(
            f"P2P connector_extra_config must be a mapping, got {type(raw).__name__}; pass {{}} or "
            "leave it out"
        )
    if raw:
        raise ValueError(
            f"{connector} does not support connector_extra_config (got keys "
            f"{sorted(map(str, raw))}); remove connector_extra_config"
        )
    return _FrozenMapping(raw)


# --- sources (docs/config.md#activation-and-sources): additional_config, its carrier, or None


def get_additional_config(src: Any) -> Mapping[Any, Any] | None:
    """Return ``additional_config`` of ``src`` (a mapping, an object with the attribute, or None)."""
    if src is None:
        return None
    if isinstance(src, Mapping):
        additional = src
    else:
        try:
            additional = src.additional_config
        except AttributeError as exc:
            raise AttributeError(
                f"AFD config source: {type(src).__name__} has no attribute 'additional_config'; "
                "expected a VllmConfig, EngineArgs, the additional_config mapping or None"
            ) from exc
    if additional is None:
        return None
    if not isinstance(additional, Mapping):
        raise TypeError(
            f"additional_config must be a mapping, got {type(additional).__name__}; pass "
            """--additional-config as a JSON object, e.g. '{"afd": {"role": "attention"}}'"""
        )
    return additional


def parse_afd_config(src: Any, expected_role: str | None = None) -> AFDConfig | None:
    """The validated config, or None when ``afd`` is absent; a present invalid config raises."""
    additional = get_additional_config(src)
    if additional is None or AFD_KEY not in additional:
        return None
    return AFDConfig.from_mapping(additional[AFD_KEY], expected_role=expected_role)


class ParsedAdditionalConfig(dict):
    """``additional_config`` of a role runner's own ``VllmConfig`` copy: the user's mapping plus the parse.

    Configuration enters a worker process once: the role worker parses ``additional_config["afd"]``
    and passes the result down. vLLM builds the model from a ``VllmConfig`` alone
    (``get_model(vllm_config=...)``), so the parse reaches the model halves inside the runner's config
    copy (workers/common.py) and ``afd_config_of`` hands it out without parsing again. A ``dict``
    with the same items: vLLM hashes a dict-valued ``additional_config`` as the JSON of its items.
    """

    __slots__ = ("afd_config",)

    def __init__(self, items: Mapping[Any, Any], afd_config: AFDConfig) -> None:
        super().__init__(items)
        self.afd_config = afd_config

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (dict(self), self.afd_config))


def afd_config_of(src: Any, caller: str) -> AFDConfig:
    """The worker's parse carried by a role runner's config; never a second parse."""
    additional = get_additional_config(src)
    if additional is None or AFD_KEY not in additional:
        raise _afd_required(caller)
    assert isinstance(additional, ParsedAdditionalConfig), (
        f"{caller}: additional_config['afd'] is parsed once per worker and reaches the model inside the role "
        "runner's config (workers/common.py, make_role_vllm_config); build the model from that config"
    )
    return additional.afd_config


def require_afd_config(src: Any, caller: str, expected_role: str | None = None) -> AFDConfig:
    """Like ``parse_afd_config`` for code that only makes sense under AFD (e.g. an AFD worker class)."""
    afd_config = parse_afd_config(src, expected_role=expected_role)
    if afd_config is None:
        raise _afd_required(caller)
    return afd_config


def _afd_required(caller: str) -> ValueError:
    return ValueError(
        f'{caller} requires additional_config["afd"]; pass --additional-config '
        """'{"afd": {"role": ...}}' or drop the AFD-specific setting"""
    )
