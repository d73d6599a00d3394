"""Validation steps 5-13 (docs/config.md#validation-order): the rules on coerced values, first failure wins."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from vllm_afd.config.coercion import FrozenMapping
from vllm_afd.config.constants import CAM_CONNECTORS, CONNECTOR_HINT, CONNECTORS, NUM_STAGES, ROLES
from vllm_afd.config.secret import check_secret_file


def check_values(values: Mapping[str, Any], *, async_dp: bool, expected_role: str | None) -> None:
    """Validation steps 5-13 (docs/config.md#validation-order) on coerced values, stopping at the
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
    for name in ("rendezvous_timeout_s", "step_timeout_s", "peer_timeout_s", "startup_timeout_s"):
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
    if values["integrity"] and connector == "P2pIpcAFDConnector":
        raise ValueError(
            "AFD integrity=true is not supported with P2pIpcAFDConnector (its slots hold no seals); use "
            "P2pNcclAFDConnector or P2pGlooAFDConnector, or leave integrity off"
        )
    if values["secret_file"]:
        check_secret_file(values["secret_file"])  # step 13: readable, regular, non-empty; its content is never shown


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
    return FrozenMapping(raw)
