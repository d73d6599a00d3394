"""The planner's PROFILE.json (docs/planner.md#the-profile): a versioned schema, checked field by field.

Every bad value raises `ProfileError` naming the field's path (`attention[2].ms`), the value, what was
expected and how to fix it, before any planning starts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PLATFORMS", "SCHEMA", "VERSION", "AttentionSample", "FfnSample", "Memory", "ModelShape", "Profile",
           "ProfileError", "StepSample", "TransportSample", "load_profile", "parse_profile"]

SCHEMA = "afd-profile"
VERSION = 1
PLATFORMS = ("cuda", "cpu")  # what ran the samples: the printed commands differ (afd_planner/launch.py)


class ProfileError(ValueError):
    """A profile that does not follow the schema; the message names the field."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    hidden_size: int
    num_layers: int  # crossing (MoE) layers of the model planned for, not of the measured checkpoint
    num_experts: int
    top_k: int
    dtype_bytes: int

    def activation_bytes(self, tokens: float) -> float:
        """Bytes of `tokens` hidden states one way ([tokens, hidden] in the model's dtype)."""
        return tokens * self.hidden_size * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class AttentionSample:
    batch: int  # requests decoded by one attention rank
    context: int  # tokens of context per request
    ms: float  # one layer's attention compute


@dataclass(frozen=True, slots=True)
class FfnSample:
    tokens: int  # rows one FFN rank computes (after any gather)
    experts: int  # experts held by that rank
    ms: float  # one layer's FFN / MoE compute


@dataclass(frozen=True, slots=True)
class TransportSample:
    bytes: int  # payload one way ([rows, hidden] in the model's dtype)
    ms: float  # one layer's round trip minus the FFN's compute (both directions)


@dataclass(frozen=True, slots=True)
class StepSample:
    batch: int
    ms: float  # per-step host share: scheduling, sampling, embedding, head (everything outside the layers)


@dataclass(frozen=True, slots=True)
class Memory:
    """Optional: what bounds the batch by memory (GiB of the device; the planned model's weights)."""

    device_gib: float
    dense_weights_gib: float  # everything but the routed experts: held by every attention and colocated rank
    expert_weights_gib: float  # all routed experts of all layers: split over the EP ranks
    kv_bytes_per_token: float  # KV cache of one token of context, all layers
    utilization: float  # share of the device a role may use (vLLM's --gpu-memory-utilization)

    def batch_limit(self, resident_gib: float, kv_share: float, context: int) -> int:
        """Requests of `context` tokens that fit beside `resident_gib` of weights (`kv_share`: KV split N ways)."""
        free = self.device_gib * self.utilization - resident_gib
        if free <= 0:
            return 0
        if context <= 0:
            return 1 << 30
        return int(free * 2**30 / (self.kv_bytes_per_token * kv_share * context))


@dataclass(frozen=True, slots=True)
class Profile:
    device: str
    model: ModelShape
    attention: tuple[AttentionSample, ...]
    ffn: tuple[FfnSample, ...]
    transport: tuple[TransportSample, ...]
    step: tuple[StepSample, ...]
    afd_step_extra_ms: float  # AFD only: the control payload per step
    source: str
    memory: Memory | None = None  # None: only --max-batch bounds the batch
    platform: str = PLATFORMS[0]

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA, "version": VERSION, "device": self.device, "platform": self.platform,
            "source": self.source,
            "model": {name: getattr(self.model, name) for name in ModelShape.__slots__},
            "attention": [{"batch": s.batch, "context": s.context, "ms": s.ms} for s in self.attention],
            "ffn": [{"tokens": s.tokens, "experts": s.experts, "ms": s.ms} for s in self.ffn],
            "transport": [{"bytes": s.bytes, "ms": s.ms} for s in self.transport],
            "step": [{"batch": s.batch, "ms": s.ms} for s in self.step],
            "afd_step_extra_ms": self.afd_step_extra_ms,
            **({} if self.memory is None else {"memory": {n: getattr(self.memory, n) for n in Memory.__slots__}}),
        }


def _field(body: dict[str, Any], key: str, where: str) -> Any:
    if key not in body:
        raise ProfileError(f"profile: {where}{key} is missing; add it (docs/planner.md#the-profile lists every field)")
    return body[key]


def _int(value: Any, path: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ProfileError(f"profile: {path} must be an integer >= {minimum}, got {value!r}")
    return value


def _ms(value: Any, path: str, unit: str = "ms") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ProfileError(f"profile: {path} must be a finite number of {unit} >= 0, got {value!r}")
    return float(value)


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ProfileError(f"profile: {path} must be a string, got {value!r}")
    return value


def _samples(body: dict[str, Any], key: str, fields: dict[str, int]) -> list[dict[str, Any]]:
    """The list `key` of objects with the integer `fields` (each >= its minimum) and `ms`."""
    items = _field(body, key, "")
    if not isinstance(items, list) or not items:
        raise ProfileError(f"profile: {key} must be a non-empty list of samples, got {items!r}; "
                           "measure at least one point (docs/planner.md#the-profile)")
    out = []
    for index, item in enumerate(items):
        where = f"{key}[{index}]."
        if not isinstance(item, dict):
            raise ProfileError(f"profile: {key}[{index}] must be an object, got {item!r}")
        unknown = set(item) - set(fields) - {"ms"}
        if unknown:
            raise ProfileError(f"profile: {key}[{index}] has unknown field(s) {sorted(unknown)}; "
                               f"expected {sorted([*fields, 'ms'])}")
        sample = {name: _int(_field(item, name, where), where + name, minimum) for name, minimum in fields.items()}
        sample["ms"] = _ms(_field(item, "ms", where), where + "ms")
        out.append(sample)
    return out


def _positive(value: Any, path: str, upper: float = math.inf) -> float:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or not 0 < value <= upper:
        raise ProfileError(f"profile: {path} must be a number > 0{'' if upper == math.inf else f' and <= {upper:g}'}"
                           f", got {value!r}")
    return float(value)


def _memory(body: Any) -> Memory | None:
    if body is None:
        return None
    if not isinstance(body, dict):
        raise ProfileError(f"profile: memory must be an object, got {body!r}")
    unknown = set(body) - set(Memory.__slots__)
    if unknown:
        raise ProfileError(f"profile: memory has unknown field(s) {sorted(unknown)}; "
                           f"expected {list(Memory.__slots__)}")
    device = _positive(_field(body, "device_gib", "memory."), "memory.device_gib")
    dense, experts = (_ms(_field(body, name, "memory."), f"memory.{name}", "GiB")
                      for name in ("dense_weights_gib", "expert_weights_gib"))
    return Memory(device_gib=device, dense_weights_gib=dense, expert_weights_gib=experts,
                  kv_bytes_per_token=_positive(_field(body, "kv_bytes_per_token", "memory."),
                                               "memory.kv_bytes_per_token"),
                  utilization=_positive(body.get("utilization", 0.9), "memory.utilization", 1.0))


def parse_profile(body: Any) -> Profile:
    """A `Profile` from the decoded JSON, or `ProfileError` naming the first bad field."""
    if not isinstance(body, dict):
        raise ProfileError(f"profile: the top level must be an object, got {type(body).__name__}")
    if body.get("schema") != SCHEMA:
        raise ProfileError(f"profile: schema must be {SCHEMA!r}, got {body.get('schema')!r}; "
                           "is this a planner profile?")
    if body.get("version") != VERSION:
        raise ProfileError(f"profile: version {body.get('version')!r} is not supported; this planner reads version "
                           f"{VERSION} (rebuild the profile with `afd_plan.py profile-from-timeline`)")
    model = _field(body, "model", "")
    if not isinstance(model, dict):
        raise ProfileError(f"profile: model must be an object, got {model!r}")
    shape = ModelShape(
        name=_str(model.get("name", ""), "model.name"),
        hidden_size=_int(_field(model, "hidden_size", "model."), "model.hidden_size", 1),
        num_layers=_int(_field(model, "num_layers", "model."), "model.num_layers", 1),
        num_experts=_int(_field(model, "num_experts", "model."), "model.num_experts", 1),
        top_k=_int(_field(model, "top_k", "model."), "model.top_k", 1),
        dtype_bytes=_int(_field(model, "dtype_bytes", "model."), "model.dtype_bytes", 1))
    if shape.top_k > shape.num_experts:
        raise ProfileError(f"profile: model.top_k ({shape.top_k}) exceeds model.num_experts ({shape.num_experts})")
    ffn = [FfnSample(**s) for s in _samples(body, "ffn", {"tokens": 1, "experts": 1})]
    for index, sample in enumerate(ffn):
        if sample.experts > shape.num_experts:
            raise ProfileError(f"profile: ffn[{index}].experts ({sample.experts}) exceeds model.num_experts "
                               f"({shape.num_experts}); it counts the experts held by the measured FFN rank")
    platform = body.get("platform", PLATFORMS[0])
    if platform not in PLATFORMS:
        raise ProfileError(f"profile: platform must be one of {PLATFORMS} (what ran the samples), got {platform!r}")
    return Profile(
        device=_str(_field(body, "device", ""), "device"), model=shape, platform=platform,
        attention=tuple(AttentionSample(**s) for s in _samples(body, "attention", {"batch": 1, "context": 0})),
        ffn=tuple(ffn),
        transport=tuple(TransportSample(**s) for s in _samples(body, "transport", {"bytes": 0})),
        step=tuple(StepSample(**s) for s in _samples(body, "step", {"batch": 1})),
        afd_step_extra_ms=_ms(body.get("afd_step_extra_ms", 0.0), "afd_step_extra_ms"),
        source=_str(body.get("source", ""), "source"), memory=_memory(body.get("memory")))


def load_profile(path: Path) -> Profile:
    """`path` parsed and checked; an unreadable file or bad JSON is a `ProfileError` naming the file."""
    try:
        body = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ProfileError(f"profile: cannot read {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ProfileError(f"profile: {path} is not JSON ({exc}); "
                           "write it as docs/planner.md#the-profile shows") from exc
    try:
        return parse_profile(body)
    except ProfileError as exc:
        raise ProfileError(f"{path}: {exc}") from None
