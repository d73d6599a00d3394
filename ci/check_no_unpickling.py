#!/usr/bin/env python3
"""AST gate: nothing in the overlay unpickles, so no bytes from the network can run code.

Why: docs/connection.md#store-values (every value the rendezvous store or a peer sends is parsed
and checked, never unpickled: any client of the store can write any key).

Usage: python ci/check_no_unpickling.py overlay [more dirs]

Flags, per file:
  * importing a module that unpickles or runs bytes as code: `pickle`, `_pickle`, `cPickle`,
    `cloudpickle`, `dill`, `marshal`, `shelve` (`import ...`, `from ... import ...`,
    `__import__(...)`, `importlib.import_module(...)`);
  * `.load` / `.loads` on a name bound to such a module;
  * any use of vLLM's `StatelessProcessGroup` and of the object exchanges that unpickle what they
    receive: `broadcast_obj`, `recv_obj`, `all_gather_obj` (vLLM), `broadcast_object_list`,
    `recv_object_list`, `all_gather_object`, `gather_object`, `scatter_object_list` (torch), also
    through `getattr(..., "<name>")`.
A line may opt out with `# noqa: AFD-UNPICKLE(<reason>)`; the gate prints each one.
Exit status: 0 clean, 1 findings, 2 usage error.
"""

from __future__ import annotations

import ast
import sys
from ast_gate import run_gate  # ci/ast_gate.py, beside this script

PICKLING_MODULES = ("pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve")
UNPICKLING_NAMES = ("StatelessProcessGroup", "broadcast_obj", "recv_obj", "all_gather_obj", "broadcast_object_list",
                    "recv_object_list", "all_gather_object", "gather_object", "scatter_object_list")
NOQA = "# noqa: AFD-UNPICKLE("


def _root(module: str | None) -> str:
    return (module or "").split(".")[0]


def check_tree(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    aliases: set[str] = set()  # local names bound to a pickling module

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _root(alias.name) in PICKLING_MODULES:
                    aliases.add((alias.asname or alias.name).split(".")[0])
                    found.append((node.lineno, f"imports {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            if _root(node.module) in PICKLING_MODULES:
                found.append((node.lineno, f"imports from {node.module}"))
            for alias in node.names:
                if alias.name in UNPICKLING_NAMES:
                    found.append((node.lineno, f"imports {alias.name} (unpickles what it receives)"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr in UNPICKLING_NAMES:
                found.append((node.lineno, f"uses {ast.unparse(node)} (unpickles what it receives)"))
            elif node.attr in ("load", "loads") and isinstance(node.value, ast.Name) and node.value.id in aliases:
                found.append((node.lineno, f"calls {ast.unparse(node)}"))
        elif isinstance(node, ast.Name) and node.id in UNPICKLING_NAMES:
            found.append((node.lineno, f"uses {node.id} (unpickles what it receives)"))
        elif isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            index = 1 if func == "getattr" else 0
            value = node.args[index] if len(node.args) > index else None
            if not (isinstance(value, ast.Constant) and isinstance(value.value, str)):
                continue
            if func in ("__import__", "importlib.import_module") and _root(value.value) in PICKLING_MODULES:
                found.append((node.lineno, f"imports {value.value} ({func})"))
            elif func == "getattr" and value.value in UNPICKLING_NAMES:
                found.append((node.lineno, f"uses {value.value} through getattr (unpickles what it receives)"))
    return sorted(set(found))


def main(argv: list[str]) -> int:
    return run_gate("check_no_unpickling", argv, check_tree, NOQA, usage=__doc__.strip().splitlines()[5],
                    noun="unpickling uses")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
