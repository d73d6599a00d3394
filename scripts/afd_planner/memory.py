"""The `memory` block of a measured profile (docs/planner.md#memory): the whole model's weights by kind and its KV
bytes per token, counted from the layers `profile` built."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ROUTED_EXPERT_PARAMS", "memory_block"]

ROUTED_EXPERT_PARAMS = ("w13_", "w2_")  # the fused MoE's stacked expert tensors (weights, biases, scales) in vLLM


def memory_block(param_bytes: Mapping[str, int], kv_bytes_per_layer: int, built_moe: Sequence[int],
                 full_moe: Sequence[int], full_layers: int, device_gib: float) -> tuple[dict[str, Any] | None, str]:
    """(the profile's `memory` for the whole model, a note) from the built halves' parameters as loaded (name ->
    bytes, both halves): each built layer's weights by kind (a dense layer; a MoE layer, its routed experts apart)
    multiplied out to the model's layer count, plus what sits outside the layers (embedding, head).  None where a
    layer kind of the model was not built (a dense layer after the first MoE one)."""
    per_layer: dict[int, int] = {}
    routed: dict[int, int] = {}
    outside = 0
    for name, size in param_bytes.items():
        found = re.match(r"model\.layers\.(\d+)\.", name)
        if not found:
            outside += size
            continue
        layer = int(found[1])
        per_layer[layer] = per_layer.get(layer, 0) + size
        if name.rpartition(".")[2].startswith(ROUTED_EXPERT_PARAMS):
            routed[layer] = routed.get(layer, 0) + size
    dense_built = sorted(set(per_layer) - set(built_moe))
    num_dense = full_layers - len(full_moe)
    if num_dense and not dense_built:
        return None, "memory not estimated: the model's dense layers were not built (raise --layers past one)"
    moe = built_moe[0]
    dense_bytes = outside + len(full_moe) * (per_layer[moe] - routed.get(moe, 0))
    if num_dense:
        dense_bytes += num_dense * per_layer[dense_built[-1]]
    block = {"device_gib": round(device_gib, 1), "dense_weights_gib": round(dense_bytes / 2**30, 6),
             "expert_weights_gib": round(len(full_moe) * routed.get(moe, 0) / 2**30, 6),
             "kv_bytes_per_token": full_layers * kv_bytes_per_layer}  # utilization: the schema's default
    return block, (f"memory: {block['dense_weights_gib']} GiB dense, {block['expert_weights_gib']} GiB routed experts "
                   f"({len(full_moe)} MoE of {full_layers} layers), {block['kv_bytes_per_token']} KV bytes per token; "
                   f"device {block['device_gib']} GiB")
