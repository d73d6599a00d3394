"""Refuse to run on a vLLM that is not the patched build this overlay was written for.

pip treats `0.30.0+afd.g…` as satisfying `vllm==0.30.0` and warns about nothing, so a
later `pip install -U vllm`, a `--force-reinstall` or an install of the other
distribution silently replaces the hooks.  The patched build carries
`vllm/_afd_provenance.json` (written by scripts/apply_patches.py); this module checks it
names the pinned commit and the hooks the overlay calls, and re-hashes every patched file.

The pin constants below equal `VLLM_PIN` at the repository root (a test keeps them equal).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

PIN_COMMIT = "ced6857afa0ea7b2e3f0846a62e1394e90f15607"
PIN_VERSION = "0.30.0"
STAMP_NAME = "_afd_provenance.json"
# Patches whose hooks the overlay calls on every platform (the MRV2 ones only on CUDA,
# where importing the MRV2 runner fails loudly if they are missing).
REQUIRED_PATCHES = (
    "worker-add-make-model-runner",
    "cpu-worker-add-make-model-runner",
    "forward-context-add-hook-registry",
    "config-add-vllm-config-hooks",
    "serving-add-request-veto",
)
BUILD_HINT = (
    "Build and install it: python scripts/apply_patches.py --vllm ced6857 --flavor cpu "
    "(or cuda) && pip install --no-deps --force-reinstall dist/<the wheel>, or patch the "
    "installed tree: python scripts/apply_patches.py --apply-to <site-packages>."
)


def vllm_package_dir() -> Path:
    """The installed `vllm/` directory, found without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"vllm_afd: vLLM is not installed; expected the patched vLLM "
                           f"{PIN_VERSION}. {BUILD_HINT}")
    return Path(list(spec.submodule_search_locations)[0])


def read_stamp(package_dir: Path) -> dict | None:
    path = package_dir / STAMP_NAME
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def stamp_problems(stamp: dict, package_dir: Path) -> list[str]:
    """Why the stamped tree is not the build this overlay needs (empty: it is)."""
    problems = []
    upstream = stamp["upstream"]
    if upstream["commit"] != PIN_COMMIT or upstream["version"] != PIN_VERSION:
        problems.append(f"stamp names vLLM {upstream['version']} at {upstream['commit'][:7]}, "
                        f"expected {PIN_VERSION} at {PIN_COMMIT[:7]}")
    names = {patch["name"].removesuffix(".patch") for patch in stamp["patches"]}
    missing = [name for name in REQUIRED_PATCHES if name not in names]
    if missing:
        problems.append(f"stamp lacks the patches {', '.join(missing)}")
    root = package_dir.parent
    for rel_path, digests in sorted(stamp["files"].items()):
        if digests["sha256"] is None:
            continue
        path = root / rel_path
        if not path.is_file():
            problems.append(f"{rel_path} is missing")
        elif hashlib.sha256(path.read_bytes()).hexdigest() != digests["sha256"]:
            problems.append(f"{rel_path} differs from the patched build (replaced or edited)")
    return problems


def check_installed_vllm() -> dict:
    """Raise `RuntimeError` unless the installed vLLM is the patched build; return its stamp."""
    package_dir = vllm_package_dir()
    stamp = read_stamp(package_dir)
    if stamp is None:
        raise RuntimeError(
            f"vllm_afd: the installed vLLM at {package_dir} is not the patched build "
            f"(vllm/{STAMP_NAME} missing); expected vLLM {PIN_VERSION} with the AFD hook "
            f"series. {BUILD_HINT} To run this vLLM without AFD, uninstall vllm-afd or set "
            "VLLM_PLUGINS to a list without 'afd'."
        )
    problems = stamp_problems(stamp, package_dir)
    if problems:
        raise RuntimeError(
            f"vllm_afd: the installed vLLM at {package_dir} does not match its AFD stamp: "
            f"{'; '.join(problems)}. {BUILD_HINT}"
        )
    return stamp
