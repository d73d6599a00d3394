#!/usr/bin/env python3
"""AST gate: fail on any run-time patch of vLLM, torch or transformers.

The rule and what the gate checks: docs/conventions.md#no-monkeypatching.

Usage: python ci/check_no_monkeypatch.py overlay scripts [more dirs]

Flags, per file, for names bound by importing `vllm`, `torch` or `transformers` (and
anything reached through them by attribute access):
  * assignment / augmented / annotated assignment / `del` of an attribute of such a name;
  * `setattr` / `delattr` / `object.__setattr__` on such a name;
  * writes to `sys.modules` or `builtins`, `importlib.reload`;
  * assignment to `__class__`, `__dict__` or `__code__` of anything;
  * `unittest.mock` imports;
  * `hasattr(...)` / 3-argument `getattr(...)` on such a name (feature probing).
A line may opt out with `# noqa: AFD-MONKEYPATCH(<reason>)`; the gate prints each one.
Exit status: 0 clean, 1 findings, 2 usage error.
"""

from __future__ import annotations

import ast
import sys
from ast_gate import run_gate  # ci/ast_gate.py, beside this script

FOREIGN_ROOTS = ("vllm", "torch", "transformers")
FORBIDDEN_DUNDERS = ("__class__", "__dict__", "__code__")
NOQA = "# noqa: AFD-MONKEYPATCH("


def foreign_names(tree: ast.AST) -> set[str]:
    """Local names bound to vllm/torch/transformers modules or their members."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in FOREIGN_ROOTS:
                    names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in FOREIGN_ROOTS:
                names.update(alias.asname or alias.name for alias in node.names)
    return names


def base_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def check_tree(tree: ast.AST) -> list[tuple[int, str]]:
    foreign = foreign_names(tree)
    found: list[tuple[int, str]] = []

    def flag(node: ast.AST, what: str) -> None:
        found.append((node.lineno, what))

    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        for target in targets:
            for leaf in ast.walk(target):
                if isinstance(leaf, ast.Attribute):
                    if leaf.attr in FORBIDDEN_DUNDERS:
                        flag(node, f"assigns {ast.unparse(leaf)}")
                    elif base_name(leaf) in foreign and leaf.ctx is not ast.Load:
                        flag(node, f"assigns {ast.unparse(leaf)} (a vllm/torch object)")
                if isinstance(leaf, ast.Subscript) and ast.unparse(leaf.value) in (
                        "sys.modules", "builtins.__dict__"):
                    flag(node, f"writes {ast.unparse(leaf.value)}")
        if isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            first = node.args[0] if node.args else None
            if func in ("setattr", "delattr", "object.__setattr__") and first is not None:
                if base_name(first) in foreign:
                    flag(node, f"{func} on {ast.unparse(first)}")
            if func in ("importlib.reload", "reload"):
                flag(node, "importlib.reload")
            if func == "hasattr" and first is not None and base_name(first) in foreign:
                flag(node, f"hasattr probe of {ast.unparse(first)}")
            if func == "getattr" and len(node.args) == 3 and base_name(first) in foreign:
                flag(node, f"getattr-with-default probe of {ast.unparse(first)}")
            if func in ("sys.modules.__setitem__", "sys.modules.update",
                        "sys.modules.setdefault", "sys.modules.pop"):
                flag(node, f"writes sys.modules ({func})")
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            names = [a.name for a in node.names]
            if (module or "").startswith("unittest.mock") or "unittest.mock" in names or (
                    module == "unittest" and "mock" in names):
                flag(node, "imports unittest.mock")
    return found


def main(argv: list[str]) -> int:
    return run_gate("check_no_monkeypatch", argv, check_tree, NOQA, usage=__doc__.strip().splitlines()[2],
                    noun="run-time patches of vllm/torch/transformers")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
