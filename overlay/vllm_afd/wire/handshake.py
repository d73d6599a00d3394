"""Config-agreement handshake (docs/connection.md#handshake): what a rank publishes, how ranks compare.

Every rank publishes a ``Fingerprint`` to the rendezvous store and compares it with every other rank's
before any data channel exists, so two processes launched with different models or AFD settings fail
at start-up with both values named, instead of exchanging mis-shaped tensors (a hang under NCCL).
Pure Python: the runtime fills the model facts in; nothing here touches torch, vLLM or a socket.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_afd.wire.errors import AFDConfigMismatchError, AFDProtocolError
from vllm_afd.role import Role
from vllm_afd.wire.placement import Placement
from vllm_afd.wire.topology import check_layout

__all__ = [
    "CHECKPOINT_FIELDS",
    "GLOBAL_FIELDS",
    "IDENTITY_FIELDS",
    "PROTOCOL_VERSION",
    "ROLE_FIELDS",
    "Fingerprint",
    "compare_fingerprints",
]

# Bumped on any change of what crosses the wire (payload codec, exchange order, fingerprint fields).
# 2: the control payload carries one row count per attention rank (was: per attention DP rank).
# 3: the fingerprint carries the checkpoint's config and weights digests (and its path, for messages).
# 4: the fingerprint carries num_stages (micro-batches per step, docs/pingpong.md).
# 5: the fingerprint carries max_rows and integrity; the control frame's header carries the body's CRC-32,
#    and with integrity on every data message is followed by its seal (docs/protocol.md#integrity-mode).
PROTOCOL_VERSION = 5

# Compared across all ranks, in report order.
GLOBAL_FIELDS = (
    "protocol_version",
    "overlay_version",
    "vllm_version",
    "architecture",
    "hidden_size",
    "num_hidden_layers",
    "dtype",
    "layer_kinds",
    "num_routed_experts",
    "connector",
    "num_attention_ranks",
    "num_ffn_ranks",
    "compute_gate_on_attention",
    "num_stages",
    "integrity",
    "graph_mode",
    "config_digest",
    "weights_digest",
)
# Checkpoint digests (vllm_afd/checkpoint.py); one that starts with this was not computed and is not compared.
CHECKPOINT_FIELDS = ("config_digest", "weights_digest")
UNKNOWN_DIGEST_PREFIX = "unknown"
NOT_GIVEN = f"{UNKNOWN_DIGEST_PREFIX} (not given)"
# Compared only within one role; across roles the layout rule applies instead.
# max_rows: the FFN bounds every published count by its attention peers' value (docs/protocol.md#bounds).
ROLE_FIELDS = ("dp_size", "tp_size", "max_rows")
# Logged and used in messages only.
IDENTITY_FIELDS = ("role", "role_rank", "hostname", "pid", "device", "checkpoint")

ROLES = tuple(role.value for role in Role)
# Bounds of max_rows; the default is the largest a rank may publish (the IPC slot records' bound too).
DEFAULT_MAX_ROWS = 1 << 20
_FIX = "Launch both roles with the same model, dtype and AFD settings."


@dataclass(frozen=True, kw_only=True, slots=True)
class Fingerprint:
    """What one rank asserts about itself; equal ``GLOBAL_FIELDS`` on all ranks is required."""

    # Wire protocol version (PROTOCOL_VERSION of the publishing overlay).
    protocol_version: int
    # vllm_afd.__version__ of the publishing process.
    overlay_version: str
    # vllm.__version__ of the publishing process.
    vllm_version: str
    # The checkpoint's architecture, e.g. "Qwen3MoeForCausalLM" (not the AFD alias).
    architecture: str
    # Hidden size of hf_text_config; the width of every exchanged row.
    hidden_size: int
    # Decoder layers of the model.
    num_hidden_layers: int
    # Resolved model dtype, e.g. "bfloat16".
    dtype: str
    # One char per layer: "D" dense MLP, "M" MoE (catches mlp_only_layers / first_k_dense_replace drift).
    layer_kinds: str
    # Routed experts per MoE layer (router-logit width).
    num_routed_experts: int
    # AFD connector class name.
    connector: str
    # A: attention DP x TP.
    num_attention_ranks: int
    # F: FFN DP x TP.
    num_ffn_ranks: int
    # Gate placement: router on the attention side when True.
    compute_gate_on_attention: bool
    # Micro-batches per step (AFDConfig.num_stages); both roles size their stage buffers and graphs by it.
    num_stages: int = 1
    # Every data message sealed with a header and a CRC-32 (AFDConfig.integrity, docs/protocol.md#integrity-mode).
    integrity: bool = False
    # "eager" or "FULL_DECODE_ONLY".
    graph_mode: str
    # "sha256:<hex>" of the checkpoint's config.json content, or "unknown (<why>)" (then not compared).
    # NOTE: the defaults serve callers that exchange without a model (wire benchmarks, connector tests).
    config_digest: str = NOT_GIVEN
    # "sha256:<hex>" of the sampled weight files, "dummy" (--load-format dummy) or "unknown (<why>)".
    weights_digest: str = NOT_GIVEN
    # Most rows one exchange of this role's ranks carries (connect.max_exchange_rows); an FFN refuses a
    # published count above its attention peers' value before allocating anything. The default serves
    # callers without a model.
    max_rows: int = DEFAULT_MAX_ROWS
    # DP size of the publishing role.
    dp_size: int
    # TP size of the publishing role.
    tp_size: int
    # Role of the publishing rank: a Role's value ("attention" or "ffn").
    role: str
    # Index of the publishing rank inside its role.
    role_rank: int
    # Host name of the publishing process (messages only).
    hostname: str
    # Process id of the publishing process (messages only).
    pid: int
    # Device of the publishing rank, e.g. "cuda:0" or "cpu" (messages only).
    device: str
    # Where the publishing rank read its checkpoint: a path, or the model id (messages only).
    checkpoint: str = "(no checkpoint given)"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            expected = {"int": int, "str": str, "bool": bool}[str(f.type)]
            if type(value) is not expected:
                raise TypeError(
                    f"AFD fingerprint: {f.name} must be {expected.__name__}, got {value!r}"
                )
        if not 1 <= self.max_rows <= DEFAULT_MAX_ROWS:
            raise ValueError(f"AFD fingerprint: max_rows must be in 1..{DEFAULT_MAX_ROWS}, got {self.max_rows}")
        if self.role not in ROLES:
            raise ValueError(f"AFD fingerprint: role must be one of {ROLES}, got {self.role!r}")
        if len(self.layer_kinds) != self.num_hidden_layers or set(self.layer_kinds) - {"D", "M"}:
            raise ValueError(
                f"AFD fingerprint: layer_kinds {self.layer_kinds!r} must have one 'D' or 'M' per layer "
                f"(num_hidden_layers={self.num_hidden_layers})"
            )

    @property
    def label(self) -> str:
        """``"<role> rank <role_rank>"``, as messages name a rank."""
        return f"{self.role} rank {self.role_rank}"

    @classmethod
    def for_rank(
        cls,
        placement: Placement,
        *,
        connector: str,
        compute_gate_on_attention: bool,
        num_stages: int = 1,
        integrity: bool = False,
        hostname: str | None = None,
        pid: int | None = None,
        **model_facts: Any,
    ) -> Fingerprint:
        """The fingerprint of the rank at ``placement``, identity filled from this process.

        ``model_facts``: overlay_version, vllm_version, architecture, hidden_size, num_hidden_layers,
        dtype, layer_kinds, num_routed_experts, graph_mode, config_digest, weights_digest, device,
        checkpoint, max_rows.
        """
        return cls(
            protocol_version=PROTOCOL_VERSION,
            connector=connector,
            num_attention_ranks=placement.num_attention_ranks,
            num_ffn_ranks=placement.num_ffn_ranks,
            compute_gate_on_attention=compute_gate_on_attention,
            num_stages=num_stages,
            integrity=integrity,
            role=placement.role.value,  # a plain str on the wire (the type check above is exact)
            role_rank=placement.role_rank,
            dp_size=placement.dp_size,
            tp_size=placement.tp_size,
            hostname=socket.gethostname() if hostname is None else hostname,
            pid=os.getpid() if pid is None else pid,
            **model_facts,
        )

    def to_json(self) -> str:
        """Compact, sorted-key JSON for the rendezvous store."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Fingerprint:
        """Inverse of ``to_json``; a body of another protocol version is a mismatch, not garbage."""
        try:
            body = json.loads(text)
        except (TypeError, ValueError, RecursionError) as exc:
            raise AFDProtocolError(
                f"AFD fingerprint is not JSON ({exc}); expected Fingerprint.to_json() output. Run the "
                "same vllm_afd version on every rank"
            ) from exc
        if not isinstance(body, dict):
            raise AFDProtocolError(f"AFD fingerprint is {type(body).__name__}, not a JSON object")
        names = [f.name for f in dataclasses.fields(cls)]
        try:
            return cls(**{name: body[name] for name in names})
        except (KeyError, TypeError, ValueError) as exc:
            version = body.get("protocol_version")
            peer = f"{body.get('role')} rank {body.get('role_rank')}"
            if version != PROTOCOL_VERSION:
                raise AFDConfigMismatchError(
                    f"AFD configuration mismatch between this rank and {peer}: protocol_version "
                    f"(local={PROTOCOL_VERSION}, peer={version!r}). Run the same vllm_afd version on "
                    "every rank"
                ) from exc
            raise AFDProtocolError(
                f"AFD fingerprint of {peer} is malformed ({exc!r}); expected Fingerprint.to_json() "
                "output. Run the same vllm_afd version on every rank"
            ) from exc


def _rank_order(fingerprint: Fingerprint) -> tuple[int, int]:
    # FFN-first, as AFD ranks are ordered.
    return (0 if fingerprint.role == Role.FFN else 1, fingerprint.role_rank)


def _differ(name: str, value_a: Any, value_b: Any) -> bool:
    if name in CHECKPOINT_FIELDS and (
        value_a.startswith(UNKNOWN_DIGEST_PREFIX) or value_b.startswith(UNKNOWN_DIGEST_PREFIX)
    ):
        # NOTE: a digest a rank could not compute (a hub id not on disk yet) is no evidence either way.
        return False
    return value_a != value_b


def _differences(a: Fingerprint, b: Fingerprint, names: Sequence[str]) -> list[tuple[str, Any, Any]]:
    values = [(name, getattr(a, name), getattr(b, name)) for name in names]
    return [(name, value_a, value_b) for name, value_a, value_b in values if _differ(name, value_a, value_b)]


def _mismatch_message(pairs: list[tuple[Fingerprint, Fingerprint, list[tuple[str, Any, Any]]]]) -> str:
    first, second, differences = pairs[0]
    same_role = first.role == second.role
    name_a, name_b = (first.label, second.label) if same_role else (first.role, second.role)
    fields = "; ".join(f"{name} ({name_a}={a}, {name_b}={b})" for name, a, b in differences)
    message = f"AFD configuration mismatch between {first.label} and {second.label}: {fields}."
    if len(pairs) > 1:
        others = ", ".join(sorted({pair[1].label for pair in pairs[1:]} - {second.label}))
        if others:
            message += f" Also differing: {others}."
    fix = _FIX
    if any(name in CHECKPOINT_FIELDS for name, _, _ in differences):
        loaded = " and ".join(
            f"{fp.label} loaded {fp.checkpoint} (weights {fp.weights_digest}, config {fp.config_digest})"
            for fp in (first, second)
        )
        fix = (
            f"The roles loaded different checkpoints: {loaded}. Start both roles on the same checkpoint "
            "(copies on different hosts must hold the same files)."
        )
    ranks = "; ".join(
        f"{fp.label} on {fp.hostname} (pid {fp.pid}, device {fp.device})" for fp in (first, second)
    )
    return f"{message} {fix} ({ranks})"


def compare_fingerprints(local: Fingerprint, others: Iterable[Fingerprint]) -> None:
    """Raise ``AFDConfigMismatchError`` on any disagreement, then check the layout rule
    (docs/topology.md#layout-rule).

    Every rank sees the same set of fingerprints, so comparing all global fields against ``local`` and
    role fields against the lowest rank of each role makes every rank raise on any disagreement.
    """
    everyone = sorted({id(fp): fp for fp in (local, *others)}.values(), key=_rank_order)
    pairs = []
    for role in Role:
        members = [fp for fp in everyone if fp.role == role]
        same_role = local.role == role
        for peer in members:
            differences = _differences(local, peer, GLOBAL_FIELDS + (ROLE_FIELDS if same_role else ()))
            if differences:
                pairs.append((local, peer, differences))
            elif not same_role and _differences(members[0], peer, ROLE_FIELDS):
                pairs.append((members[0], peer, _differences(members[0], peer, ROLE_FIELDS)))
    if pairs:
        raise AFDConfigMismatchError(_mismatch_message(pairs))
    attention = next((fp for fp in everyone if fp.role == Role.ATTENTION), None)
    ffn = next((fp for fp in everyone if fp.role == Role.FFN), None)
    if attention is not None and ffn is not None:
        check_layout(
            attention.dp_size,
            attention.tp_size,
            ffn.dp_size,
            ffn.tp_size,
            local.num_attention_ranks,
            local.num_ffn_ranks,
        )
