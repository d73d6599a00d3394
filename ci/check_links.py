#!/usr/bin/env python3
"""Gate: every relative markdown link resolves to a file, and every #anchor to a heading.

Usage: python ci/check_links.py [FILE_OR_DIR ...]     (default: README.md docs evidence)

Checks inline links and images (`[text](path#anchor)`, `![alt](path)`) and reference
definitions (`[name]: path`) in the given markdown files (directories: every `*.md` below),
outside fenced code blocks and inline code.  A link with a scheme (`https:`, `mailto:`) is
skipped.  The path is taken relative to the linking file and must exist; an anchor into a
markdown file (or `#anchor` alone, into the linking file) must equal the GitHub slug of one of
its headings (lowercase, punctuation other than `-` and `_` dropped, each space a `-`, a
repeated slug numbered `-1`, `-2`) or an `id`/`name` of an HTML tag in it.  Anchors into other
files (`x.py#L10`) are not checked.  Stdlib only.
Exit status: 0 every link resolves, 1 broken links, 2 usage error.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from urllib.parse import unquote

DEFAULT_PATHS = ("README.md", "docs", "evidence")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:.|\n)*?\1")
INLINE_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^()\s<>]*)>?(?:\s+[\"'][^\"']*[\"'])?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ID = re.compile(r"<[a-zA-Z][^>]*\s(?:id|name)=[\"']([^\"']+)[\"']")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def slugify(heading: str) -> str:
    """GitHub's anchor for a heading's text: `## 12. Run 1 — `x` (ok)` -> `12-run-1--x-ok`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def prose_of(markdown: str) -> str:
    """The text with fenced code blocks blanked (line numbers kept)."""
    lines = markdown.split("\n")
    fence = None
    for i, line in enumerate(lines):
        match = FENCE.match(line)
        if fence is None and match:
            fence, lines[i] = match.group(1), ""
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            lines[i] = ""
    return "\n".join(lines)


def anchors_of(markdown: str) -> set[str]:
    """Every anchor a markdown text defines: heading slugs (numbered when repeated) and HTML ids."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    prose = prose_of(markdown)
    for line in prose.split("\n"):
        match = HEADING.match(line)
        if match:
            slug = slugify(match.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    anchors.update(HTML_ID.findall(prose))
    return anchors


def links_of(markdown: str) -> list[tuple[int, str]]:
    """(line number, target) of every inline link, image and reference definition outside code."""
    prose = prose_of(markdown)
    prose = CODE_SPAN.sub(lambda m: "\n" * m.group(0).count("\n"), prose)
    found = [(prose.count("\n", 0, m.start()) + 1, m.group(2)) for m in INLINE_LINK.finditer(prose)]
    found += [(prose.count("\n", 0, m.start()) + 1, m.group(1)) for m in REFERENCE_DEF.finditer(prose)]
    return sorted(found)


def check_link(source: Path, target: str, anchor_cache: dict[Path, set[str]]) -> str | None:
    """What is wrong with one link from `source`, or None when it resolves."""
    if not target or SCHEME.match(target):
        return None
    path_part, _, anchor = target.partition("#")
    dest = (source.parent / unquote(path_part)).resolve() if path_part else source.resolve()
    if not dest.exists():
        return f"no file {unquote(path_part)!r} relative to {source.parent}"
    if not anchor or dest.is_dir() or dest.suffix != ".md":
        return None
    if dest not in anchor_cache:
        anchor_cache[dest] = anchors_of(dest.read_text(encoding="utf-8"))
    if unquote(anchor) in anchor_cache[dest]:
        return None
    near = sorted(a for a in anchor_cache[dest] if a.split("-")[0] == anchor.split("-")[0])[:3]
    hint = f"; headings starting alike: {', '.join('#' + a for a in near)}" if near else ""
    return f"no heading with anchor #{anchor} in {dest.name}{hint}"


def markdown_files(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for name in paths:
        root = Path(name)
        files += sorted(root.rglob("*.md")) if root.is_dir() else [root]
    return files


def main(argv: list[str]) -> int:
    paths = argv or [p for p in DEFAULT_PATHS if Path(p).exists()]
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        print(f"check_links: {', '.join(missing)} does not exist; pass markdown files or folders "
              "(default: README.md docs evidence, from the repository root)", file=sys.stderr)
        return 2
    anchor_cache: dict[Path, set[str]] = {}
    broken: list[str] = []
    num_links = 0
    files = markdown_files(paths)
    for source in files:
        for line, target in links_of(source.read_text(encoding="utf-8")):
            num_links += 1
            problem = check_link(source, target, anchor_cache)
            if problem:
                broken.append(f"{source}:{line}: link ({target}): {problem}. Fix the link or the heading.")
    for entry in broken:
        print(entry)
    print(f"check_links: {len(files)} files, {num_links} links, {len(broken)} broken")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
