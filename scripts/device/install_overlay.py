#!/usr/bin/env python3
"""Make a source-tree vLLM plugin importable and discoverable without pip or network.

The GPU machine has no package registry and no build backend for our project, so
`pip install -e .` is not available there.  vLLM finds general plugins only through
`importlib.metadata.entry_points(group="vllm.general_plugins")`, which reads
`*.dist-info/entry_points.txt` on `sys.path`.  This script writes a minimal dist-info
(METADATA, entry_points.txt, INSTALLER, RECORD) for a project described by its
`pyproject.toml` into a site directory; with that directory and the project's package
root on PYTHONPATH, every vLLM process (front end, engine core, workers) loads the plugin.

    python3 scripts/device/install_overlay.py --site ~/afd-site            # vllm_afd
    python3 scripts/device/install_overlay.py --site ~/afd-probe-site \\
        --project tests/hook_probe                                          # afd_hook_probe
    export PYTHONPATH=<printed path list>

Stdlib only (Python >= 3.11 for tomllib); works the same on the CPU machine, where the
unit tests check that `importlib.metadata` finds the entry point.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PLUGIN_GROUP = "vllm.general_plugins"
INSTALLER_NAME = "afd-install-overlay"


@dataclass(frozen=True, slots=True)
class ProjectInfo:
    """What a dist-info needs from a pyproject.toml, plus where the packages live."""

    # Distribution name as written in [project] name, e.g. "vllm-afd".
    name: str
    version: str
    # group -> {entry name -> "module:attr"}, from [project.entry-points.<group>].
    entry_points: dict[str, dict[str, str]]
    # The directory to put on PYTHONPATH so the packages import (setuptools package-dir "").
    package_root: Path


def normalized_name(name: str) -> str:
    """The dist-info file-name form of a distribution name (PEP 503 + underscores)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def read_project(project_dir: Path) -> ProjectInfo:
    """Parse `project_dir/pyproject.toml` for name, version, entry points and package root."""
    pyproject = Path(project_dir) / "pyproject.toml"
    if not pyproject.is_file():
        raise FileNotFoundError(
            f"install_overlay: {pyproject} does not exist; expected a project directory with a "
            "pyproject.toml. Pass --project <dir holding pyproject.toml>."
        )
    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    project = data.get("project", {})
    missing = [key for key in ("name", "version") if key not in project]
    if missing:
        raise ValueError(
            f"install_overlay: {pyproject} [project] lacks {', '.join(missing)}; expected a static "
            "name and version. Add them to [project]."
        )
    entry_points = {group: dict(entries) for group, entries in project.get("entry-points", {}).items()}
    package_dir = data.get("tool", {}).get("setuptools", {}).get("package-dir", {})
    package_root = (Path(project_dir) / package_dir.get("", ".")).resolve()
    return ProjectInfo(project["name"], str(project["version"]), entry_points, package_root)


def render_entry_points(entry_points: dict[str, dict[str, str]]) -> str:
    """entry_points.txt text: one INI section per group, entries sorted for stable bytes."""
    blocks = []
    for group in sorted(entry_points):
        lines = [f"[{group}]"] + [f"{name} = {value}" for name, value in sorted(entry_points[group].items())]
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks)


def write_dist_info(site_dir: Path, info: ProjectInfo) -> Path:
    """Write `<name>-<version>.dist-info/` into `site_dir`, replacing any older one of this project."""
    site_dir = Path(site_dir)
    site_dir.mkdir(parents=True, exist_ok=True)
    prefix = normalized_name(info.name)
    for old in site_dir.glob(f"{prefix}-*.dist-info"):
        shutil.rmtree(old)
    dist_info = site_dir / f"{prefix}-{info.version}.dist-info"
    dist_info.mkdir()
    files = {
        "METADATA": f"Metadata-Version: 2.1\nName: {info.name}\nVersion: {info.version}\n",
        "entry_points.txt": render_entry_points(info.entry_points),
        "INSTALLER": f"{INSTALLER_NAME}\n",
    }
    for file_name, text in files.items():
        (dist_info / file_name).write_text(text, encoding="utf-8")
    record = [f"{dist_info.name}/{file_name},," for file_name in [*files, "RECORD"]]
    (dist_info / "RECORD").write_text("\n".join(record) + "\n", encoding="utf-8")
    return dist_info


def install(project_dir: Path, site_dir: Path) -> list[str]:
    """Write the dist-info and return the PYTHONPATH entries that make the plugin load."""
    info = read_project(project_dir)
    if PLUGIN_GROUP not in info.entry_points:
        raise ValueError(
            f"install_overlay: {project_dir}/pyproject.toml declares no [project.entry-points."
            f"\"{PLUGIN_GROUP}\"]; expected a vLLM general plugin. Check --project."
        )
    write_dist_info(site_dir, info)
    return [str(info.package_root), str(Path(site_dir).resolve())]


def join_pythonpath(*groups: list[str] | str | None) -> str:
    """Join path lists (or os.pathsep strings) in order, dropping empties and repeats."""
    seen: list[str] = []
    for group in groups:
        if not group:
            continue
        entries = group.split(os.pathsep) if isinstance(group, str) else group
        for entry in entries:
            if entry and entry not in seen:
                seen.append(entry)
    return os.pathsep.join(seen)


def discover_entry_points(pythonpath: str, group: str = PLUGIN_GROUP, python: str = sys.executable,
                          timeout_s: float = 60.0) -> dict[str, str]:
    """Entry points of `group` as a fresh interpreter with `pythonpath` sees them (name -> value)."""
    code = (
        "import importlib.metadata as m, json, sys\n"
        f"eps = m.entry_points(group={group!r})\n"
        "json.dump({ep.name: ep.value for ep in eps}, sys.stdout)\n"
    )
    env = dict(os.environ, PYTHONPATH=pythonpath)
    done = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(
            f"install_overlay: listing entry points failed (exit {done.returncode}): {done.stderr[-2000:]}; "
            "expected a JSON mapping. Check the interpreter and PYTHONPATH."
        )
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", type=Path, default=REPO_ROOT,
                        help="directory holding the plugin's pyproject.toml (default: the repository)")
    parser.add_argument("--site", type=Path, default=Path.home() / "afd-site",
                        help="directory to write the dist-info into (put it on PYTHONPATH)")
    parser.add_argument("--check", action="store_true",
                        help="afterwards, list the vllm.general_plugins entry points a fresh interpreter sees")
    args = parser.parse_args(argv)
    entries = install(args.project, args.site)
    pythonpath = join_pythonpath(entries, os.environ.get("PYTHONPATH"))
    print(json.dumps({"pythonpath_entries": entries}))
    if args.check:
        found = discover_entry_points(pythonpath)
        print(json.dumps({"entry_points": found}))
        expected = read_project(args.project).entry_points[PLUGIN_GROUP]
        if any(found.get(name) != value for name, value in expected.items()):
            print(f"install_overlay: entry points {expected} not all visible (found {found}); expected "
                  "them after install. Check that nothing earlier on PYTHONPATH shadows the dist-info.",
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
