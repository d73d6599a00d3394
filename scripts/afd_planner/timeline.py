"""A profile from a deployment's timeline files (docs/timeline.md) and its model's config.json.

Per row count of attention rank 0's one-stage steps (graph replays when there are any, else eager), the
medians of scripts/timeline_report.py's breakdown become one sample each: attention compute at (rows, context),
FFN compute at (rows x A, E / F), transport at rows x hidden x dtype bytes, and the step's host share
('other' x crossing layers).  Timeline records carry no context length: the caller names it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import timeline_report

from .profile import SCHEMA, VERSION, ProfileError, parse_profile

__all__ = ["model_shape", "profile_from_timeline"]

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "float8_e4m3fn": 1}


def model_shape(model_dir: Path, num_layers: int | None = None) -> dict[str, Any]:
    """The profile's `model` object from a Hugging Face config.json (Qwen3-MoE or DeepSeek-V2/V3 names)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ProfileError(f"profile-from-timeline: cannot read {path} ({exc}); pass the model's directory") from exc
    experts = config.get("num_experts", config.get("n_routed_experts"))
    missing = [k for k, v in (("hidden_size", config.get("hidden_size")), ("num_hidden_layers",
               config.get("num_hidden_layers")), ("num_experts or n_routed_experts", experts),
               ("num_experts_per_tok", config.get("num_experts_per_tok"))) if v is None]
    if missing:
        raise ProfileError(f"profile-from-timeline: {path} lacks {', '.join(missing)}; is it an MoE model's config?")
    dtype = str(config.get("torch_dtype", config.get("dtype", "bfloat16")))
    return {"name": str(config.get("_name_or_path") or Path(model_dir).name), "hidden_size": config["hidden_size"],
            "num_layers": num_layers or config["num_hidden_layers"], "num_experts": experts,
            "top_k": config["num_experts_per_tok"], "dtype_bytes": DTYPE_BYTES.get(dtype.removeprefix("torch."), 2)}


def _one_stage(records: list) -> list:
    return [r for r in records if all(m.stage == 0 for m in r.marks)]


def profile_from_timeline(timeline_dir: Path, model_dir: Path, context: int, device: str = "",
                          num_layers: int | None = None, platform: str = "cuda") -> tuple[dict[str, Any], list[str]]:
    """(the profile as JSON, notes for the user); the profile passes `parse_profile`."""
    ranks = {stem: _one_stage(records) for stem, records in timeline_report.load(Path(timeline_dir)).items()}
    num_attention = len(timeline_report.role_stems(ranks, "attention"))
    num_ffn = len(timeline_report.role_stems(ranks, "ffn"))
    if not ranks.get("attention-0") or not ranks.get("ffn-0"):
        raise ProfileError(f"profile-from-timeline: {timeline_dir} has no measured one-stage steps of attention-0 "
                           "and ffn-0; record a run with timeline_dir and num_stages 1 (docs/timeline.md)")
    model = model_shape(model_dir, num_layers)
    rows = timeline_report.breakdown(ranks)
    replays = [r for r in rows if r["kind"] == "graph replay"]
    rows = replays or rows
    notes = [f"{len(rows)} batch size(s) from {num_attention}A:{num_ffn}F "
             f"{'graph replays' if replays else 'eager steps'}; context {context} for every attention sample"]
    attention, ffn, transport, step = [], [], [], []
    for row in rows:
        batch = row["rows"]
        if row["attention compute"] is not None:
            attention.append({"batch": batch, "context": context, "ms": row["attention compute"]})
        if row["FFN compute"] is not None:
            ffn.append({"tokens": batch * num_attention, "experts": max(1, model["num_experts"] // num_ffn),
                        "ms": row["FFN compute"]})
        if row.get("transport") is not None:
            transport.append({"bytes": batch * model["hidden_size"] * model["dtype_bytes"],
                              "ms": max(0.0, row["transport"])})
        if row.get("other") is not None:
            step.append({"batch": batch, "ms": max(0.0, row["other"] * row["layers"])})
    if not step:
        notes.append("no consecutive steps to time the host share: step cost set to 0 ms (edit 'step')")
        step = [{"batch": rows[0]["rows"], "ms": 0.0}]
    if len({s["batch"] for s in attention}) < 2:
        notes.append("one batch size only: costs are flat in the batch; record at >= 3 batch sizes")
    body = {"schema": SCHEMA, "version": VERSION, "device": device, "platform": platform,
            "source": f"profile-from-timeline {timeline_dir}", "model": model, "attention": attention,
            "ffn": ffn, "transport": transport, "step": step, "afd_step_extra_ms": 0.0}
    parse_profile(body)  # what we write must read back
    return body, notes
