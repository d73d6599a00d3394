"""Refuse to run on a vLLM that is not the patched build this overlay was written for.

pip treats `0.30.0+afd.g…` as satisfying `vllm==0.30.0` and warns about nothing, so a
later `pip install -U vllm`, a `--force-reinstall` or an install of the other
distribution silently replaces the hooks.  The patched build carries
`vllm/_afd_provenance.json` (written by scripts/apply_patches.py); this module checks it
names the pinned commit and the hooks the overlay calls, and re-hashes every patched file.

The supported releases and their pins live in `releases.py` (one entry per `VLLM_PIN*`
file); a stamp naming any of them is accepted, with that release's required hooks.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
from pathlib import Path

from vllm_afd.releases import RELEASES, SUPPORTED_VERSIONS, release_for_commit

# The default (oldest supported) release: VLLM_PIN.
PIN_COMMIT = RELEASES[0].commit
PIN_VERSION = RELEASES[0].version
STAMP_NAME = "_afd_provenance.json"
REQUIRED_PATCHES = RELEASES[0].required_patches
_VERSIONS = " or ".join(SUPPORTED_VERSIONS)
_BUILDS = " or ".join(f"--vllm {r.short}" for r in RELEASES)
_CUDA_ONLY = " and ".join(r.version for r in RELEASES if not r.has_cpu_wheel)
BUILD_HINT = (
    f"Build and install it: python scripts/apply_patches.py {_BUILDS} (vLLM {_VERSIONS}) "
    f"--flavor cpu (or cuda; {_CUDA_ONLY or 'none'}: cuda only) && pip install --no-deps "
    "--force-reinstall dist/<the wheel>, or patch the installed tree: python "
    "scripts/apply_patches.py --vllm <version> --apply-to <site-packages>."
)


def vllm_package_dir() -> Path:
    """The installed `vllm/` directory, found without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"vllm_afd: vLLM is not installed; expected the patched vLLM "
                           f"{_VERSIONS}. {BUILD_HINT}")
    return Path(list(spec.submodule_search_locations)[0])


def read_stamp(package_dir: Path) -> dict | None:
    path = package_dir / STAMP_NAME
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


@functools.cache
def installed_patches() -> frozenset[str]:
    """The patches (names without `.patch`) the installed vLLM's stamp lists; empty for an unstamped tree.

    The plugin's `check_installed_vllm` guarantees only a release's `required_patches`; a check that
    needs another patch of the series (validation.py) asks here.
    """
    stamp = read_stamp(vllm_package_dir())
    if stamp is None:
        return frozenset()
    return frozenset(patch["name"].removesuffix(".patch") for patch in stamp["patches"])


def stamp_problems(stamp: dict, package_dir: Path) -> list[str]:
    """Why the stamped tree is not the build this overlay needs (empty: it is)."""
    problems = []
    upstream = stamp["upstream"]
    release = release_for_commit(upstream["commit"])
    if release is None or upstream["version"] != release.version:
        expected = " or ".join(f"{r.version} at {r.short}" for r in RELEASES)
        problems.append(f"stamp names vLLM {upstream['version']} at {upstream['commit'][:7]}, "
                        f"expected {expected}")
        release = RELEASES[0]
    names = {patch["name"].removesuffix(".patch") for patch in stamp["patches"]}
    missing = [name for name in release.required_patches if name not in names]
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
            f"(vllm/{STAMP_NAME} missing); expected vLLM {_VERSIONS} with the AFD hook "
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
