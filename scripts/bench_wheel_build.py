#!/usr/bin/env python3
"""Time the patched-wheel build next to a plain unzip + zip of the same wheel, in one run.

    python scripts/bench_wheel_build.py [--flavor cuda|cpu] [--cache DIR]

The build (`apply_patches.py --flavor F`: sha256 check, in-memory apply, raw-stream repack,
full re-verification) reads the official wheel from the cache; the baseline extracts every
member to a temp dir and re-deflates them all (zipfile, level 6).  Not a test: it prints
wall times and their ratio.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import apply_patches
from afd_patchtool import _series

ROOT = Path(__file__).resolve().parent.parent


def plain_unzip_zip(wheel: Path, work: Path) -> None:
    """The naive repack: extract everything, then deflate everything again."""
    unpacked = work / "unpacked"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(unpacked)
        names = zf.namelist()
    with zipfile.ZipFile(work / wheel.name, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as out:
        for name in names:
            if not name.endswith("/"):
                out.write(unpacked / name, name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flavor", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "afd-vllm-wheels"))
    args = parser.parse_args(argv)
    pin = _series.read_pin(ROOT / "VLLM_PIN")
    wheel = Path(args.cache) / pin[f"{args.flavor}.wheel"]
    if not wheel.is_file():
        print(f"bench: {wheel} missing; expected the cached official wheel. Run "
              f"apply_patches.py --flavor {args.flavor} once to download it.", file=sys.stderr)
        return 5
    with tempfile.TemporaryDirectory(prefix="afd-bench-") as tmp:
        started = time.monotonic()
        code = apply_patches.main(["--flavor", args.flavor, "--cache", args.cache, "--out", tmp, "-q"])
        build_s = time.monotonic() - started
        if code:
            print(f"bench: the build failed (exit {code})", file=sys.stderr)
            return code
        started = time.monotonic()
        plain_unzip_zip(wheel, Path(tmp))
        plain_s = time.monotonic() - started
    size_mb = wheel.stat().st_size / 1e6
    print(f"wheel                      {wheel.name} ({size_mb:.0f} MB)")
    print(f"patched build (+ verify)   {build_s:7.1f} s")
    print(f"plain unzip + zip          {plain_s:7.1f} s")
    print(f"ratio build / plain        {build_s / plain_s:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
