"""Shared Hypothesis strategies: text files as bytes (LF, CRLF, mixed EOL, missing final
newline, non-ASCII) and random insert/delete/replace edits of them.

`unique_lines` draws files whose lines are all distinct, like real code around a seam, so a
hunk has exactly one true place; `pool_lines` draws from a tiny pool so lines repeat and
placement ambiguity is exercised.
"""
from __future__ import annotations

import itertools

from hypothesis import assume
from hypothesis import strategies as st

_counter = itertools.count()

# Content characters: no LF (a line break) and no CR (it would change the EOL); non-ASCII
# and form feed included, since str.splitlines() breaks on them and the engine must not.
CHARS = st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",))
EOLS = st.sampled_from([b"\n", b"\r\n"])


def fresh_line(tag: str = "new") -> bytes:
    """A line that appears nowhere else in any generated file."""
    return f"{tag}_{next(_counter)} = 'ü'".encode()


@st.composite
def unique_lines(draw, min_size: int = 0, max_size: int = 40) -> list[bytes]:
    size = draw(st.integers(min_size, max_size))
    texts = draw(st.lists(st.text(CHARS, max_size=10), min_size=size, max_size=size))
    return [f"l{next(_counter)}:{t}".encode("utf-8", "surrogatepass") for t in texts]


@st.composite
def pool_lines(draw, min_size: int = 0, max_size: int = 30) -> list[bytes]:
    return draw(st.lists(st.sampled_from([b"a", b"b", b"", b"    pass", b"x = 1"]),
                         min_size=min_size, max_size=max_size))


@st.composite
def eol_style(draw) -> tuple[str, bool]:
    """(mode, final_newline) with mode in lf/crlf/mixed."""
    return draw(st.sampled_from(["lf", "crlf", "mixed"])), draw(st.booleans())


def join(lines: list[bytes], mode: str, final_newline: bool, eols: list[bytes] | None = None) -> bytes:
    """Join content lines with the chosen EOLs (mixed: `eols` per line)."""
    out = []
    for i, line in enumerate(lines):
        eol = {"lf": b"\n", "crlf": b"\r\n"}.get(mode) or (eols[i % len(eols)] if eols else b"\n")
        last = i == len(lines) - 1
        out.append(line + (eol if (not last or final_newline) else b""))
    return b"".join(out)


@st.composite
def edited(draw, lines: list[bytes], max_edits: int = 4) -> list[bytes]:
    """Apply random insert/delete/replace edits; inserted lines are fresh (unique)."""
    result = list(lines)
    for _ in range(draw(st.integers(1, max_edits))):
        op = draw(st.sampled_from(["insert", "delete", "replace"]))
        pos = draw(st.integers(0, len(result)))
        if op == "insert" or not result:
            result[pos:pos] = [fresh_line() for _ in range(draw(st.integers(1, 3)))]
        elif op == "delete":
            pos = min(pos, len(result) - 1)
            del result[pos:pos + draw(st.integers(1, 3))]
        else:
            pos = min(pos, len(result) - 1)
            result[pos] = fresh_line("repl")
    return result


@st.composite
def file_pairs(draw, lines=None) -> tuple[bytes, bytes]:
    """(old, new) file bytes with the same EOL style; new is a random edit of old."""
    base = draw(lines if lines is not None else unique_lines(min_size=1))
    mode, final_newline = draw(eol_style())
    eols = draw(st.lists(EOLS, min_size=1, max_size=5))
    new = draw(edited(base))
    new_final = draw(st.booleans()) if draw(st.booleans()) else final_newline
    old_bytes = join(base, mode, final_newline, eols)
    new_bytes = join(new, mode, new_final, eols)
    assume(old_bytes != new_bytes)
    return old_bytes, new_bytes
