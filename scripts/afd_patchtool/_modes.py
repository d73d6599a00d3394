"""Modes of scripts/apply_patches.py: --check, build, --verify-wheel, --apply-to, --list, --make-patch.

Each `run_*` takes the parsed arguments (and the pin and the loaded series where it needs
them), prints through `Out` and returns the mode's exit code; apply_patches.py parses the
command line and dispatches here.  --lint, --rebase-report and --refresh live in _lint.py,
_rebase.py and _refresh.py.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from afd_patchtool import _diff
from afd_patchtool import _placement
from afd_patchtool import _series
from afd_patchtool import _tree
from afd_patchtool import _wheel as wh
from afd_patchtool._report import Out, hunk_summary, report_result, worst
from afd_patchtool._upstream import flavors_of, pristine_sources, read_file, resolve_ref, upstream_wheel

ROOT = Path(__file__).resolve().parents[2]


def run_check(args, pin, patches, out: Out) -> int:
    sources = pristine_sources(args, pin, patches, out, widen=True)
    code, report = 0, []
    for name, read in sources:
        out.info(f"Checking the series against {name}")
        result = _placement.apply_series(patches, read, fuzz=args.fuzz or 0, max_offset=args.max_offset)
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


def _anchor_problems(patches, result: _placement.SeriesResult) -> list[str]:
    from afd_patchtool import _rebase
    return [problem for patch in patches for fp in patch.files if result.after.get(fp.path)
            for problem in _rebase.anchor_problems(patch, fp.path, result.after[fp.path])]


def _strict_drift(patches, result: _placement.SeriesResult, out: Out) -> int:
    code = 0
    for rec in result.records:
        if rec.status in (_placement.OFFSET, _placement.FUZZ):
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
        raise _series.ConfigError("build: a source tree cannot be repacked (--src/--vllm DIR); expected "
                             "the pinned wheel. Use --apply-to DIR to patch a tree in place.")
    if kind == "wheel":
        args.wheel = str(path)
    label, epoch = _series.local_label(pin["commit"], patches), _tree.build_epoch(patches)
    built, code = [], 0
    for flavor in flavors_of(args, pin, patches, widen=False):
        started = time.monotonic()
        wheel = upstream_wheel(args, pin, flavor, out)
        members = wh.read_members(wheel, _series.required_files(patches) + ["vllm/_version.py"])
        target = f"{pin[flavor + '.dist']} {pin['version']}"
        result = _placement.apply_series(patches, members.get)
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
                           stamp=stamp, fmt=_series.FORMAT_VERSION)
        problems = wh.verify_wheel(output, expected_markers=_tree.expected_markers(patches),
                                   series_sha256=_series.series_sha256(patches), against=wheel)
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
    patches = _series.load_series(Path(args.patches)) if (Path(args.patches) / "series").is_file() else []
    problems = wh.verify_wheel(path, expected_markers=_tree.expected_markers(patches) or None,
                               series_sha256=_series.series_sha256(patches) if patches else None,
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
    if args.restore_from_wheel:
        return _restore_from_wheel(args, pin, patches, tree, out)
    verb = "Reverting" if args.reverse else "Applying"
    result = _placement.apply_series(patches, tree.read, reverse=args.reverse)
    code = report_result(result, patches, out, verb=verb, hunks=bool(args.verbose), target=str(tree.root))
    statuses = {o.status for o in result.outcomes}
    if "partial" in statuses or ({"applied", "already applied"} <= statuses):
        done = sum(1 for o in result.outcomes if o.status == "already applied")
        out.error(f"{tree.root}: the tree is partially {'un' if args.reverse else ''}patched ({done} of "
                  f"{len(patches)} patches {'reverted' if args.reverse else 'applied'} or partly so); "
                  "expected none or all. Nothing was written. Restore vllm/ from the pinned wheel "
                  "(pip install --force-reinstall --no-deps) and rerun.")
        return worst(code, 6)
    stamp_now = tree.read(wh.STAMP_PATH)
    _require_same_series(tree, stamp_now, patches, reverse=args.reverse)
    problems = [] if args.reverse else _tree.postconditions(patches, result)
    for problem in problems:
        out.error(f"{tree.root}: {problem}; expected a compiling file with every marker. Fix the patch.")
    if code or problems:
        num_bad = sum(1 for o in result.outcomes if o.status not in ("applied", "already applied"))
        out.error(f"FAILED: {max(num_bad, 1)} of {len(patches)} patches; nothing written; "
                  "rerun with -v for the hunk dump")
        return worst(code, 1)
    if statuses == {"already applied"}:
        pristine = _placement.apply_series(patches, tree.read, reverse=not args.reverse)
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


def _require_same_series(tree: _tree.Tree, raw: bytes | None, patches, *, reverse: bool) -> None:
    """A tree stamped by another series can be neither reversed nor patched again by this one.

    Reversing would find none of this series' hunks ("already reverted") and leave the old
    edits behind; applying would stack this series on the old one.
    """
    if raw is None:
        return
    stamped = json.loads(raw).get("series_sha256")
    if stamped != _series.series_sha256(patches):
        raise _series.PatchApplyError(
            f"{tree.root}: patched by another series (stamp series_sha256 {str(stamped)[:12]}, this series "
            f"{_series.series_sha256(patches)[:12]}); expected the series that patched it. Nothing was written. "
            "Un-patch it first: --apply-to DIR --reverse --restore-from-wheel"
            + ("" if reverse else ", then apply this series"), exit_code=6)


def _restore_from_wheel(args, pin, patches, tree: _tree.Tree, out: Out) -> int:
    """--reverse --restore-from-wheel: put back the files the stamp lists, from the pinned wheel.

    For a tree patched by an older series, which the current series cannot un-apply.  Every
    file must still be what the stamp says was written (else it was edited since: refused),
    and every wheel member must be the stamp's pre-image; then all are written at once.
    """
    raw = tree.read(wh.STAMP_PATH)
    if raw is None:
        raise _series.ConfigError(f"{tree.root}/{wh.STAMP_PATH}: missing; expected the stamp --apply-to "
                                  "writes. Without it the patched files are unknown: reinstall the wheel.")
    stamp = json.loads(raw)
    listed = stamp.get("files", {})
    edited = [path for path, entry in sorted(listed.items()) if _series.blob_id(tree.read(path)) != entry["post"]]
    if edited:
        raise _series.PatchApplyError(
            f"{tree.root}: {', '.join(edited)} changed since the series was applied (blob id differs from the "
            "stamp's post-image); expected the stamped files. Nothing was written. Reinstall the wheel "
            "(pip install --force-reinstall --no-deps).", exit_code=6)
    flavor = tree.variant or ("cpu" if args.flavor == "cpu" else "cuda")
    wheel = upstream_wheel(args, pin, flavor, out)
    members = wh.read_members(wheel, sorted(listed))
    wrong = [path for path, entry in sorted(listed.items()) if _series.blob_id(members[path]) != entry["pre"]]
    if wrong:
        raise wh.ArtifactError(
            f"{wheel.name}: {', '.join(wrong)} differ from the stamp's pre-images; expected the wheel the tree "
            "was installed from. Pass that wheel with --wheel PATH.")
    changes: dict[str, bytes | None] = {path: members[path] for path in sorted(listed)}
    changes[wh.STAMP_PATH] = None
    ordered = list(changes.items())
    record = tree.record_update(changes)
    if record is not None:
        ordered.append(record)
    if args.dry_run:
        out.info(f"OK: {len(listed)} files would be restored from {wheel.name} on {tree.root}; "
                 "--dry-run: nothing written")
        return 0
    _tree.write_tree(tree.root, ordered)
    out.info(f"OK: restored {len(listed)} files from {wheel.name} on {tree.root}; stamp removed")
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
    files = [(f, read_file(Path(args.orig), f), read_file(Path(args.new), f)) for f in args.files]
    same = [f for f, a, b in files if a == b]
    if same:
        raise _series.ConfigError(f"--make-patch: no change in {same}; expected edited files. Drop them.")
    Path(args.out).write_bytes(_diff.make_patch(header, files))
    out.info(f"OK: wrote {args.out} ({len(files)} files)")
    return 0


def _show(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _write_report(args, data: dict) -> None:
    if args.report:
        Path(args.report).write_text(json.dumps(data, indent=1, default=str) + "\n")
