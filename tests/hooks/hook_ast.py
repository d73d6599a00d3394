"""AST helpers for the seam contract tests: find functions, calls and enclosing `with`s."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CallSite:
    """One call inside a function, with what encloses it."""

    call: ast.Call
    withs: tuple[str, ...]  # unparsed context expressions of the enclosing `with` blocks
    ifs: tuple[int, ...]  # line numbers of enclosing `if` statements

    @property
    def line(self) -> int:
        return self.call.lineno

    def keyword(self, name: str) -> object:
        """Literal value of a keyword argument (KeyError if absent)."""
        for kw in self.call.keywords:
            if kw.arg == name:
                return ast.literal_eval(kw.value)
        raise KeyError(name)


def parse(tree_root: Path, relpath: str) -> ast.Module:
    return ast.parse((tree_root / relpath).read_text(encoding="utf-8"), filename=relpath)


def find_def(module: ast.Module, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The function `Class.method` or `function` defined in `module`."""
    scope: list[ast.stmt] = module.body
    *outer, name = qualname.split(".")
    for part in outer:
        scope = next(n for n in scope if isinstance(n, ast.ClassDef) and n.name == part).body
    for node in scope:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    raise LookupError(f"{qualname} not found")


def param_names(func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = func.args
    return [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]


def call_name(call: ast.Call) -> str:
    """`f` for `f(...)`, `attr` for `x.y.attr(...)`."""
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


def call_sites(func: ast.AST, name: str) -> list[CallSite]:
    """Every call named `name` inside `func`, in source order, with enclosing with/if."""
    found: list[CallSite] = []

    def visit(node: ast.AST, withs: tuple[str, ...], ifs: tuple[int, ...]) -> None:
        if isinstance(node, ast.Call) and call_name(node) == name:
            found.append(CallSite(node, withs, ifs))
        if isinstance(node, (ast.With, ast.AsyncWith)):
            exprs = tuple(ast.unparse(item.context_expr) for item in node.items)
            for item in node.items:
                visit(item.context_expr, withs, ifs)
            for child in node.body:
                visit(child, withs + exprs, ifs)
            return
        if isinstance(node, ast.If):
            visit(node.test, withs, ifs)
            for child in (*node.body, *node.orelse):
                visit(child, withs, ifs + (node.lineno,))
            return
        for child in ast.iter_child_nodes(node):
            visit(child, withs, ifs)

    visit(func, (), ())
    return sorted(found, key=lambda site: (site.call.lineno, site.call.col_offset))


def returned_name(func: ast.FunctionDef) -> str | None:
    """Name returned by the last statement, if it is `return <name>`."""
    last = func.body[-1]
    if isinstance(last, ast.Return) and isinstance(last.value, ast.Name):
        return last.value.id
    return None
