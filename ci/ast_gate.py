"""What the AST gates share (check_no_monkeypatch.py, check_no_unpickling.py): walk the given files and
folders, run one gate's ``check_tree`` on each file, honour its noqa marker, print, and exit 1 on a finding."""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

CheckTree = Callable[[ast.AST], Iterator[tuple[int, str]]]


def check_file(path: Path, check_tree: CheckTree, noqa: str) -> tuple[list[str], list[str]]:
    """(findings, suppressed) as printable lines."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    findings, suppressed = [], []
    for lineno, what in check_tree(ast.parse(source, str(path))):
        line = lines[lineno - 1] if lineno <= len(lines) else ""
        entry = f"{path}:{lineno}: {what}"
        (suppressed if noqa in line else findings).append(entry)
    return findings, suppressed


def run_gate(name: str, argv: list[str], check_tree: CheckTree, noqa: str, *, usage: str, noun: str) -> int:
    """The gate's main: 2 on bad arguments, 1 on a finding, 0 otherwise; ``noun`` names what it counts."""
    if not argv:
        print(usage, file=sys.stderr)
        return 2
    findings: list[str] = []
    suppressed: list[str] = []
    num_files = 0
    for root in map(Path, argv):
        if not root.exists():
            print(f"{name}: {root} does not exist", file=sys.stderr)
            return 2
        for path in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
            num_files += 1
            found, allowed = check_file(path, check_tree, noqa)
            findings += found
            suppressed += allowed
    for entry in suppressed:
        print(f"suppressed: {entry}")
    for entry in findings:
        print(entry)
    print(f"{name}: {num_files} files, {len(findings)} {noun}, {len(suppressed)} suppressed")
    return 1 if findings else 0
