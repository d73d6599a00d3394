"""Diff writer of scripts/apply_patches.py: the bytes of a patch file, byte-stable.

The diff writer (`make_patch`) is what tests use to generate patches and what patch authors
use to regenerate one:

    python scripts/apply_patches.py --make-patch --header HDR.txt \\
        --orig PRISTINE_DIR --new EDITED_DIR --out patches/NAME.patch vllm/a.py vllm/b.py

HDR.txt holds the `Field: value` header (docs/patch-tooling.md#patch-files); the output is the header, a
`---` line and a git-style diff (blob ids computed here, 3 lines of context, files sorted).
"""
from __future__ import annotations

import difflib
import re
from typing import Iterable

from afd_patchtool._series import ZERO_BLOB, blob_id, split_lines

CONTEXT = 3  # context lines per hunk side that the diff writer emits and the lint expects


_DEF_RE = re.compile(rb"^([ \t]*)(async[ \t]+def|def|class)[ \t]+\w")


def _section(lines: list[bytes], start: int) -> bytes:
    """Nearest preceding less-indented def/class line, like git's funcname (ours, stable)."""
    ref = None
    for line in lines[start:]:
        if line.strip():
            ref = len(line) - len(line.lstrip(b" \t"))
            break
    for line in reversed(lines[:start]):
        match = _DEF_RE.match(line)
        if match and (ref is None or ref == 0 or len(match.group(1)) < ref):
            return line.rstrip()[:80]
    return b""


def _range(start: int, stop: int) -> str:
    length = stop - start
    if length == 1:
        return str(start + 1)
    return f"{start + 1 if length else start},{length}"


def _emit(tag: bytes, line: bytes) -> bytes:
    if line.endswith(b"\n"):
        return tag + line
    return tag + line + b"\n\\ No newline at end of file\n"


def diff_file(path: str, old: bytes | None, new: bytes | None, context: int = 3) -> bytes:
    """Git-style diff of one file (`old`/`new` None = absent); b'' when identical."""
    if old == new:
        return b""
    a = split_lines(old or b"")
    b = split_lines(new or b"")
    p = path.encode()
    out = [b"diff --git a/%s b/%s\n" % (p, p)]
    if old is None:
        out.append(b"new file mode 100644\nindex %s..%s\n" % (ZERO_BLOB.encode(), blob_id(new).encode()))
    elif new is None:
        out.append(b"deleted file mode 100644\nindex %s..%s\n" % (blob_id(old).encode(), ZERO_BLOB.encode()))
    else:
        out.append(b"index %s..%s 100644\n" % (blob_id(old).encode(), blob_id(new).encode()))
    if not a and not b:
        return b"".join(out)
    out.append(b"--- %s\n" % (b"/dev/null" if old is None else b"a/" + p))
    out.append(b"+++ %s\n" % (b"/dev/null" if new is None else b"b/" + p))
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    for group in matcher.get_grouped_opcodes(context):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        section = _section(a, i1)
        out.append(b"@@ -%s +%s @@%s\n" % (_range(i1, i2).encode(), _range(j1, j2).encode(),
                                           b" " + section if section else b""))
        for tag, x1, x2, y1, y2 in group:
            if tag == "equal":
                out.extend(_emit(b" ", line) for line in a[x1:x2])
                continue
            out.extend(_emit(b"-", line) for line in a[x1:x2])
            out.extend(_emit(b"+", line) for line in b[y1:y2])
    return b"".join(out)


def make_patch(header: bytes, files: Iterable[tuple[str, bytes | None, bytes | None]]) -> bytes:
    """Header + `---` + the sorted per-file diffs; the bytes a patch file holds."""
    head = header.rstrip(b"\n")
    if head.endswith(b"\n---") or head == b"---":
        head = head[:-3].rstrip(b"\n")
    body = b"".join(diff_file(path, old, new) for path, old, new in sorted(files, key=lambda f: f[0]))
    return (head + b"\n" if head else b"") + b"---\n" + body
