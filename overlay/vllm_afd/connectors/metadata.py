"""Messages and per-exchange records of the AFD connectors (AFD_SPEC.md §4.2-4.3, §5.4).

Importable without torch: tensor-valued fields are typed ``Any`` (they hold ``torch.Tensor``), and
the control payload's wire codec is plain JSON over Python ints. The codec never uses pickle (flagged
as a security risk in the reference's first review): an FFN must not execute what a peer sends.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from vllm_afd.errors import AFDProtocolError

__all__ = [
    "AFDA2FTransferPayload",
    "AFDControlPayload",
    "AFDDPMetadata",
    "AFDExpertRoutingSpec",
    "AFDForwardContextMetadata",
    "AFDTransferContext",
    "AFDTransferMetadata",
    "PAYLOAD_FLAGS",
    "next_transaction_id",
]

# Step flags of the control payload; a decoder treats a missing flag as false (§4.3).
PAYLOAD_FLAGS = ("is_graph_capturing", "is_warmup", "is_graph_replaying", "is_profile")


def _integer(value: Any, what: str) -> int:
    """A plain int from any integral value (int, numpy int, 0-d integer tensor); never a bool."""
    if isinstance(value, bool):
        raise TypeError(f"{what}: row counts must be integers, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what}: row counts must be integers, got {value!r}") from None


def _count(value: Any, what: str) -> int:
    """A non-negative row count."""
    count = _integer(value, what)
    if count < 0:
        raise ValueError(f"{what}: row counts must be >= 0, got {count}")
    return count


@dataclass(frozen=True, slots=True)
class AFDDPMetadata:
    """Row counts of one stage across attention DP ranks; a wire object (FFN contexts use DPMetadata)."""

    # [attention DP] rows each attention DP rank runs this stage, as published (padded, maybe 0 = idle).
    num_tokens_across_dp_cpu: Sequence[int]
    # max(num_tokens_across_dp_cpu); derived when None, must agree when given.
    max_tokens_across_dp_cpu: int | None = None

    def __post_init__(self) -> None:
        counts = tuple(_count(n, "AFD DP metadata") for n in self.num_tokens_across_dp_cpu)
        if not counts:
            raise ValueError(
                "AFD DP metadata: num_tokens_across_dp_cpu is empty; expected one entry per attention "
                "DP rank"
            )
        maximum = max(counts)
        given = self.max_tokens_across_dp_cpu
        if given is not None and _count(given, "AFD DP metadata") != maximum:
            raise ValueError(
                f"AFD DP metadata: max_tokens_across_dp_cpu ({given}) is not the max of "
                f"num_tokens_across_dp_cpu {list(counts)}; expected {maximum}. Leave it out to derive it"
            )
        object.__setattr__(self, "num_tokens_across_dp_cpu", counts)
        object.__setattr__(self, "max_tokens_across_dp_cpu", maximum)

    @classmethod
    def from_native(cls, dp_metadata: Any) -> AFDDPMetadata:
        """Convert vLLM's ``DPMetadata`` (its CPU count tensor) into the wire object."""
        return cls(tuple(dp_metadata.num_tokens_across_dp_cpu))


@dataclass(frozen=True, slots=True)
class AFDControlPayload:
    """One attention step as the FFN needs it: per-stage DP row counts plus the step's graph flags."""

    # stage index -> row counts of that stage; vLLM DPMetadata values are converted on construction.
    dp_metadata_list: Mapping[int, AFDDPMetadata] = field(hash=False)
    _: KW_ONLY
    # The attention records this forward into a CUDA graph (nothing executes).
    is_graph_capturing: bool = False
    # Warm-up forward right before a capture; executes with real traffic.
    is_warmup: bool = False
    # FULL CUDA graph replay on the attention (reference fix #270 for #261).
    is_graph_replaying: bool = False
    # vLLM's memory-profile forward.
    is_profile: bool = False
    # Per-sender step counter for logs and timeout messages; None when unknown.
    step_seq: int | None = None

    def __post_init__(self) -> None:
        stages: dict[int, AFDDPMetadata] = {}
        for stage, metadata in self.dp_metadata_list.items():
            stage_idx = _count(stage, "AFD control payload stage index")
            if not isinstance(metadata, AFDDPMetadata):
                metadata = AFDDPMetadata.from_native(metadata)
            stages[stage_idx] = metadata
        object.__setattr__(self, "dp_metadata_list", dict(sorted(stages.items())))
        for flag in PAYLOAD_FLAGS:
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"AFD control payload: {flag} must be a bool, got {getattr(self, flag)!r}")
        if self.step_seq is not None:
            object.__setattr__(self, "step_seq", _count(self.step_seq, "AFD control payload step_seq"))

    @property
    def stages(self) -> tuple[int, ...]:
        """Stage indices in ascending order."""
        return tuple(self.dp_metadata_list)

    def encode(self) -> bytes:
        """Compact, sorted-key UTF-8 JSON; stage keys as decimal strings; no pickle."""
        body: dict[str, Any] = {
            "dp_metadata_list": {
                str(stage): {
                    "max_tokens_across_dp_cpu": metadata.max_tokens_across_dp_cpu,
                    "num_tokens_across_dp_cpu": list(metadata.num_tokens_across_dp_cpu),
                }
                for stage, metadata in self.dp_metadata_list.items()
            },
            **{flag: getattr(self, flag) for flag in PAYLOAD_FLAGS},
        }
        if self.step_seq is not None:
            body["step_seq"] = self.step_seq
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
        return text.encode("utf-8")

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> AFDControlPayload:
        """Inverse of ``encode``; missing flags are false, the max is recomputed, unknown keys ignored.

        Raises ``AFDProtocolError`` for anything that is not such a body.
        """
        try:
            body = json.loads(bytes(data).decode("utf-8"))
        except (TypeError, ValueError, RecursionError) as exc:  # JSON and UTF-8 errors are ValueErrors
            raise _undecodable(data, f"not UTF-8 JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise _undecodable(data, f"top level is {type(body).__name__}, not an object")
        raw_stages = body.get("dp_metadata_list")
        if not isinstance(raw_stages, dict):
            raise _undecodable(data, "'dp_metadata_list' missing or not an object")
        stages = {
            _decode_stage_key(data, key): _decode_counts(data, key, value) for key, value in raw_stages.items()
        }
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
        f"AFD control payload is undecodable ({reason}; first bytes {head!r}); expected the compact "
        "JSON body of AFD_SPEC §4.3. Run the same vllm_afd version on both roles"
    )


def _decode_stage_key(data: Any, key: str) -> int:
    if not (key.isascii() and key.isdigit() and str(int(key)) == key):
        raise _undecodable(data, f"stage key {key!r} is not a decimal integer")
    return int(key)


def _decode_counts(data: Any, key: str, value: Any) -> AFDDPMetadata:
    counts = value.get("num_tokens_across_dp_cpu") if isinstance(value, dict) else None
    if not (
        isinstance(counts, list)
        and counts
        and all(type(n) is int and n >= 0 for n in counts)
    ):
        raise _undecodable(data, f"stage {key}: num_tokens_across_dp_cpu is not a non-empty list of counts")
    # NOTE: the wire max is ignored and recomputed, so a sender bug cannot desynchronise the two.
    return AFDDPMetadata(tuple(counts))


@dataclass(slots=True)
class AFDTransferMetadata:
    """Shape of one exchange (one layer, one stage); the FFN runner sets ``layer_idx`` per layer."""

    # Decoder layer index of this exchange.
    layer_idx: int
    # Microbatch stage inside the step (always 0 until DBO).
    stage_idx: int
    # [num_peers] rows per peer: one entry on the attention side, one per peer (subgroup order) on the FFN.
    seq_lens: list[int]

    def __post_init__(self) -> None:
        self.seq_lens = [_integer(n, "AFD transfer metadata") for n in self.seq_lens]
        if not self.seq_lens:
            raise ValueError(
                "AFD transfer metadata: seq_lens cannot be empty; expected one row count per peer"
            )
        if any(n <= 0 for n in self.seq_lens):
            raise ValueError(
                f"AFD transfer metadata: all sequence lengths must be positive, got {self.seq_lens}; "
                "clamp idle ranks to 1 row (rows(count) = max(1, count))"
            )

    @property
    def total_tokens(self) -> int:
        """Rows of the concatenated tensor (sum of ``seq_lens``)."""
        return sum(self.seq_lens)

    def validate_tensor_shape(self, shape: Iterable[int]) -> None:
        """Raise ``ValueError`` unless ``shape`` has rank >= 1 and ``shape[0] == total_tokens``."""
        dims = tuple(shape)
        if not dims:
            raise ValueError(
                f"AFD transfer (layer {self.layer_idx}, stage {self.stage_idx}): tensor has rank 0; "
                f"expected shape [{self.total_tokens}, ...]"
            )
        if dims[0] != self.total_tokens:
            raise ValueError(
                f"AFD transfer (layer {self.layer_idx}, stage {self.stage_idx}): tensor has {dims[0]} "
                f"rows (shape {list(dims)}); expected total_tokens={self.total_tokens} "
                f"(seq_lens={self.seq_lens})"
            )

    @classmethod
    def create_attention_metadata(cls, layer_idx: int, stage_idx: int, seq_len: int) -> AFDTransferMetadata:
        """Metadata of one attention rank's send: its own rows only."""
        return cls(layer_idx, stage_idx, [seq_len])

    @classmethod
    def create_ffn_metadata(
        cls, layer_idx: int, stage_idx: int, seq_lens: Sequence[int]
    ) -> AFDTransferMetadata:
        """Metadata of an FFN fan-in: one entry per peer, in subgroup order."""
        return cls(layer_idx, stage_idx, list(seq_lens))


@dataclass(slots=True)
class AFDTransferContext:
    """What a receive hands back so the matching send can be routed (split by ``seq_lens``)."""

    # Shape of the exchange.
    metadata: AFDTransferMetadata
    # Connector-private state of the exchange (e.g. pending handles); None when unused.
    states: Any = None


@dataclass(slots=True)
class AFDA2FTransferPayload:
    """One FFN fan-in: the concatenated hidden states of all peers, plus router logits if routed there."""

    # torch.Tensor [total_tokens, hidden_size], peers concatenated in subgroup order.
    hidden_states: Any
    # Context to pass back to send_ffn_output.
    context: AFDTransferContext
    # torch.Tensor [total_tokens, num_routed_experts] when the gate runs on attention, else None.
    router_logits: Any = None


@dataclass(frozen=True, slots=True)
class AFDExpertRoutingSpec:
    """Static, model-owned shape of router logits; sizes their receives and graph buffers."""

    # Number of router-logit columns (routed experts).
    router_logits_width: int
    # torch.dtype of the router's output.
    router_logits_dtype: Any

    def __post_init__(self) -> None:
        if _count(self.router_logits_width, "AFD expert routing spec") <= 0:
            raise ValueError(
                f"AFD expert routing spec: router_logits_width must be positive, got "
                f"{self.router_logits_width}; pass the model's number of routed experts"
            )


_TRANSACTION_IDS = itertools.count(1)


def next_transaction_id() -> str:
    """A process-local id ``afd-<n>`` for one forward context; never sent on the wire."""
    return f"afd-{next(_TRANSACTION_IDS)}"


@dataclass(kw_only=True, slots=True)
class AFDForwardContextMetadata:
    """The sidecar at ``forward_context.additional_kwargs["afd_metadata"]`` (§5.4)."""

    # [num_stages] first token row of each stage.
    tokens_start_loc: list[int]
    # [num_stages] first request of each stage.
    requests_start_loc: list[int]
    # Stage the model is running now.
    stage_idx: int
    # Number of stages in this step (1 until DBO).
    num_stages: int
    # [num_stages] rows each stage sends (padded, >= 1).
    tokens_lens: list[int]
    # [num_stages] real tokens of each stage before padding.
    tokens_unpadded_lens: list[int]
    # "afd-<n>", local to this process, never on the wire.
    transaction_id: str
    # Integer id of the connector in the process registry (custom ops cannot take objects).
    connector_handle: int
    # Whether this forward's payload was sent: created True on V2, False on V1 (the first op sends).
    published: bool
    # vLLM's memory-profile forward; the lazy V1 publish copies it into the payload's flag.
    is_profile: bool = False

    def __post_init__(self) -> None:
        lists = (self.tokens_start_loc, self.requests_start_loc, self.tokens_lens, self.tokens_unpadded_lens)
        if self.num_stages < 1 or any(len(values) != self.num_stages for values in lists):
            raise ValueError(
                f"AFD forward metadata: num_stages={self.num_stages} but per-stage lists have lengths "
                f"{[len(values) for values in lists]}; expected one entry per stage"
            )
        if not 0 <= self.stage_idx < self.num_stages:
            raise ValueError(
                f"AFD forward metadata: stage_idx {self.stage_idx} not in [0, {self.num_stages})"
            )
        if any(n < 1 for n in self.tokens_lens):
            raise ValueError(
                f"AFD forward metadata: tokens_lens {self.tokens_lens} must be >= 1 (idle ranks send 1 row)"
            )

    @classmethod
    def single_stage(
        cls,
        num_tokens: int,
        *,
        connector_handle: int,
        published: bool,
        num_unpadded_tokens: int | None = None,
        transaction_id: str | None = None,
        is_profile: bool = False,
    ) -> AFDForwardContextMetadata:
        """The one-stage sidecar: starts ``[0]``, ``tokens_lens = [max(1, num_tokens)]``."""
        return cls(
            tokens_start_loc=[0],
            requests_start_loc=[0],
            stage_idx=0,
            num_stages=1,
            tokens_lens=[max(1, num_tokens)],
            tokens_unpadded_lens=[num_tokens if num_unpadded_tokens is None else num_unpadded_tokens],
            transaction_id=next_transaction_id() if transaction_id is None else transaction_id,
            connector_handle=connector_handle,
            published=published,
            is_profile=is_profile,
        )

    def clone(self) -> AFDForwardContextMetadata:
        """A copy whose per-stage lists are independent of this one's."""
        return dataclasses.replace(
            self,
            tokens_start_loc=list(self.tokens_start_loc),
            requests_start_loc=list(self.requests_start_loc),
            tokens_lens=list(self.tokens_lens),
            tokens_unpadded_lens=list(self.tokens_unpadded_lens),
        )
