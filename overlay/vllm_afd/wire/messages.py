"""What crosses between the roles besides raw tensors: the control payload, and the FFN's received batch.

The control payload's wire codec is plain JSON over Python ints and never pickle: an FFN must not
execute what a peer sends. Importable without torch: tensor-valued fields are typed ``Any``.
"""

from __future__ import annotations

import json
import operator
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from vllm_afd.wire.errors import AFDProtocolError

__all__ = [
    "CONTROL_HEADER_WORDS", "MAX_CONTROL_BYTES", "A2FBatch", "ControlPayload", "PAYLOAD_FLAGS", "RoutingSpec",
    "control_header", "control_length", "read_control",
]

# Step flags of the control payload; a decoder treats a missing flag as false.
PAYLOAD_FLAGS = ("is_graph_capturing", "is_warmup", "is_graph_replaying", "is_profile")


def _count(value: Any, what: str) -> int:
    """A non-negative integer from any integral value (int, numpy int, 0-d tensor); never a bool."""
    if isinstance(value, bool):
        raise TypeError(f"{what}: row counts must be integers, got {value!r}")
    try:
        count = operator.index(value)
    except TypeError:
        raise TypeError(f"{what}: row counts must be integers, got {value!r}") from None
    if count < 0:
        raise ValueError(f"{what}: row counts must be >= 0, got {count}")
    return count


@dataclass(frozen=True, slots=True)
class ControlPayload:
    """One attention step as the FFN needs it: per-stage row counts plus the step's flags.

    ``counts[stage][j]`` is the number of tokens attention rank j runs in that stage, as published
    (padded for graphs and DP; 0 = idle, and an idle rank still sends one row: ``topology.rows``).
    """

    # stage -> [A] tokens per attention rank (attention TP peers repeat their DP rank's count).
    counts: Mapping[int, tuple[int, ...]] = field(hash=False)
    _: KW_ONLY
    # The attention records this forward into a CUDA graph (nothing executes).
    is_graph_capturing: bool = False
    # Warm-up forward right before a capture; executes with real traffic.
    is_warmup: bool = False
    # FULL CUDA-graph replay on the attention: its exchanges run inside the graph.
    is_graph_replaying: bool = False
    # vLLM's memory-profile forward.
    is_profile: bool = False
    # Per-sender step counter for logs and timeout messages; None when unknown.
    step_seq: int | None = None

    def __post_init__(self) -> None:
        stages: dict[int, tuple[int, ...]] = {}
        for stage, counts in self.counts.items():
            stage = _count(stage, "AFD control payload stage")
            stages[stage] = tuple(_count(n, f"AFD control payload stage {stage}") for n in counts)
            if not stages[stage]:
                raise ValueError(
                    f"AFD control payload: stage {stage} has no counts; expected one per attention rank"
                )
        if not stages:
            raise ValueError("AFD control payload: no stages; expected at least stage 0")
        object.__setattr__(self, "counts", dict(sorted(stages.items())))
        for flag in PAYLOAD_FLAGS:
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"AFD control payload: {flag} must be a bool, got {getattr(self, flag)!r}")
        if self.step_seq is not None:
            object.__setattr__(self, "step_seq", _count(self.step_seq, "AFD control payload step_seq"))

    @property
    def stages(self) -> tuple[int, ...]:
        """Stage indices in ascending order."""
        return tuple(self.counts)

    def encode(self) -> bytes:
        """Compact, sorted-key UTF-8 JSON; stage keys as decimal strings; no pickle."""
        body: dict[str, Any] = {
            "counts": {str(stage): list(counts) for stage, counts in self.counts.items()},
            **{flag: getattr(self, flag) for flag in PAYLOAD_FLAGS},
        }
        if self.step_seq is not None:
            body["step_seq"] = self.step_seq
        return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> ControlPayload:
        """Inverse of ``encode``; missing flags are false, unknown keys ignored.

        Raises ``AFDProtocolError`` for anything that is not such a body.
        """
        try:
            body = json.loads(bytes(data).decode("utf-8"))
        except (TypeError, ValueError, RecursionError) as exc:  # JSON and UTF-8 errors are ValueErrors
            raise _undecodable(data, f"not UTF-8 JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise _undecodable(data, f"top level is {type(body).__name__}, not an object")
        raw_stages = body.get("counts")
        if not isinstance(raw_stages, dict) or not raw_stages:
            raise _undecodable(data, "'counts' missing, empty or not an object")
        stages = {_decode_stage(data, key): _decode_counts(data, key, value) for key, value in raw_stages.items()}
        flags = {}
        for flag in PAYLOAD_FLAGS:
            value = body.get(flag, False)
            if not isinstance(value, bool):
                raise _undecodable(data, f"flag {flag!r} is {value!r}, not a boolean")
            flags[flag] = value
        step_seq = body.get("step_seq")
        if step_seq is not None and (type(step_seq) is not int or step_seq < 0):
            raise _undecodable(data, f"'step_seq' is {step_seq!r}, not a non-negative integer")
        return cls(stages, **flags, step_seq=step_seq)


def _undecodable(data: Any, reason: str) -> AFDProtocolError:
    head = bytes(data[:64]) if isinstance(data, (bytes, bytearray, memoryview)) else data
    return AFDProtocolError(
        f"AFD control payload is undecodable ({reason}; first bytes {head!r}); expected the compact JSON "
        "body of docs/protocol.md#control-payload. Run the same vllm_afd version on both roles"
    )


def _decode_stage(data: Any, key: str) -> int:
    # NOTE: the length bound keeps int() away from Python's digit limit (a ValueError, not ours).
    if not (key.isascii() and key.isdigit() and len(key) <= 9 and str(int(key)) == key):
        raise _undecodable(data, f"stage key {key!r} is not a decimal integer")
    return int(key)


def _decode_counts(data: Any, key: str, value: Any) -> tuple[int, ...]:
    if not (isinstance(value, list) and value and all(type(n) is int and n >= 0 for n in value)):
        raise _undecodable(data, f"stage {key}: counts are not a non-empty list of non-negative integers")
    return tuple(value)


# A control body longer than this is garbage, not a payload (a real one is well under 1 KiB per stage).
MAX_CONTROL_BYTES = 1 << 20
# The control frame's header: int64 [length, CRC-32 of the body].
CONTROL_HEADER_WORDS = 2


def control_header(body: bytes) -> list[int]:
    """The control frame's header, sent as int64 ``[2]`` before the body: ``[length, CRC-32 of the body]``."""
    return [len(body), zlib.crc32(body)]


def control_length(header: Sequence[int]) -> int:
    """The body length a received header announces, checked before the body's receive is posted."""
    num_bytes = header[0]
    if not 0 < num_bytes <= MAX_CONTROL_BYTES:
        raise AFDProtocolError(f"control payload length {num_bytes} is not in 1..{MAX_CONTROL_BYTES}; expected the "
                               "int64 header [length, CRC-32] of docs/protocol.md#control-payload")
    return num_bytes


def read_control(header: Sequence[int], body: bytes, *, num_stages: int, max_rows: int) -> ControlPayload:
    """The payload of a received control frame, checked before anything is sized by it: the body's CRC-32, the
    codec, stages below ``num_stages`` and every count at most ``max_rows``. Raises ``AFDProtocolError``."""
    if zlib.crc32(body) != header[1]:
        raise AFDProtocolError(f"control payload of {len(body)} bytes fails its CRC-32 (header {header[1]:#x}, "
                               f"body {zlib.crc32(body):#x}); the peer sent other bytes than it announced")
    payload = ControlPayload.decode(body)
    if payload.stages[-1] >= num_stages:
        raise AFDProtocolError(f"control payload step {payload.step_seq} has stages {list(payload.stages)}; the "
                               f"handshake agreed on num_stages={num_stages} (stages 0..{num_stages - 1})")
    for stage, counts in payload.counts.items():
        if max(counts) > max_rows:
            raise AFDProtocolError(f"control payload step {payload.step_seq} publishes {max(counts)} rows in stage "
                                   f"{stage}; the attention's handshake announced max_rows={max_rows}")
    return payload


@dataclass(frozen=True, slots=True)
class RoutingSpec:
    """Width and dtype of a MoE layer's router logits; sizes their receives and graph buffers."""

    # Number of router-logit columns (routed experts).
    width: int
    # torch.dtype of the router's output.
    dtype: Any

    def __post_init__(self) -> None:
        if _count(self.width, "AFD routing spec") <= 0:
            raise ValueError(
                f"AFD routing spec: width must be positive, got {self.width}; pass the model's number of "
                "routed experts"
            )


@dataclass(frozen=True, slots=True)
class A2FBatch:
    """What the FFN received for one (layer, stage): every peer's rows, concatenated in subgroup order."""

    # torch.Tensor [sum(peer_rows), hidden_size].
    hidden_states: Any
    # torch.Tensor [sum(peer_rows), num_routed_experts] when the gate runs on attention, else None.
    router_logits: Any
    # [num_peers] rows from each attention peer, in subgroup order.
    peer_rows: Sequence[int]
