#!/usr/bin/env python3
"""Build (or reuse) the tiny AFD test checkpoints on the machine that will serve them.

`gpu_e2e.py` runs this in a subprocess so that the orchestrator never imports torch or
transformers.  Each arch is built by `afd_harness.tiny_models.build_tiny_model` into
`<out>/<arch>`; with `--prebuilt DIR`, a complete earlier build in `DIR/<arch>` (for
instance one carried from the CPU machine) is used instead when its recorded file hashes
still match, whatever torch/transformers versions built it.  Prints one JSON object:
`{arch: {"path", "source", "recipe_hash", "architecture", "config"}}` or an error per arch.

    python3 scripts/device/build_models.py --out ~/afd-e2e/models --arch qwen3_moe --arch deepseek_v2_mla
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import traceback
from pathlib import Path
from typing import Any

from afd_harness import tiny_models


def prebuilt_is_intact(model_dir: Path, arch: str) -> bool:
    """True when `model_dir` holds a tiny build of `arch` whose files match their recorded hashes."""
    recipe = tiny_models.read_recipe(model_dir)
    if recipe is None or recipe.get("arch") != arch or "files" not in recipe:
        return False
    return all((model_dir / name).is_file()
               and hashlib.sha256((model_dir / name).read_bytes()).hexdigest() == digest
               for name, digest in recipe["files"].items())


def build_one(arch: str, out_dir: Path, prebuilt: Path | None, seed: int) -> dict[str, Any]:
    if prebuilt is not None and prebuilt_is_intact(prebuilt / arch, arch):
        model_dir, source = prebuilt / arch, "prebuilt"
    else:
        model_dir, source = tiny_models.build_tiny_model(arch, out_dir / arch, seed=seed), "built"
    recipe = tiny_models.read_recipe(model_dir)
    assert recipe is not None, f"build_models: {model_dir} has no recipe after the build"
    return {"path": str(model_dir), "source": source, "recipe_hash": recipe["recipe_hash"],
            "architecture": recipe["architecture"], "config": recipe["config"],
            "serve_env": recipe.get("serve_env", {}), "serve_args": recipe.get("serve_args", []),
            "versions": recipe.get("versions", {})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arch", action="append", required=True, choices=sorted(tiny_models.TINY_ARCHS))
    parser.add_argument("--prebuilt", type=Path, help="directory with <arch>/ builds to reuse if intact")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result: dict[str, Any] = {}
    for arch in args.arch:
        try:
            result[arch] = build_one(arch, args.out, args.prebuilt, args.seed)
        except Exception as exc:  # noqa: BLE001 - one arch failing must not lose the others
            result[arch] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    print(json.dumps(result))
    return 0 if all("error" not in value for value in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
