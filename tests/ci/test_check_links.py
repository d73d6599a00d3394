"""The link gate passes a tree whose links and anchors resolve, names each broken one, and passes the repo."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GATE = ROOT / "ci" / "check_links.py"


def run_gate(*paths, cwd):
    return subprocess.run([sys.executable, str(GATE), *map(str, paths)],
                          capture_output=True, text=True, timeout=60, cwd=cwd)


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))


def test_links_to_files_headings_and_own_anchors_pass(tmp_path):
    write_tree(tmp_path, {
        "README.md": """\
            # Project
            See [the decision](docs/decisions.md#12-one-gpu-runs-eager-over-gloo), the
            [second entry](docs/decisions.md#notes-1), [the log](evidence/log.md),
            [a folder](docs/), [a line](tool.py#L3), [the web](https://example.com/x.md#nothing)
            and [below](#project).
            ```
            [inside a fence](missing.md)
            ```
            Inline code is not a link: `[x](missing.md)`.
            """,
        "docs/decisions.md": """\
            # Decisions
            ## 12. One GPU runs eager (over `gloo`)
            ## Notes
            ## Notes
            Back to the [readme](../README.md), wrapped [over
            two lines](../evidence/log.md).
            """,
        "evidence/log.md": "# Log\n[summary](../docs/decisions.md#decisions)\n",
        "tool.py": "print(1)\n",
    })

    done = run_gate("README.md", "docs", "evidence", cwd=tmp_path)

    assert done.returncode == 0, done.stdout
    assert "3 files, 10 links, 0 broken" in done.stdout


def test_a_missing_file_and_a_missing_anchor_are_named(tmp_path):
    write_tree(tmp_path, {
        "README.md": "# Project\n\n[gone](docs/gpu-evidence.md) and [moved](docs/a.md#12-old-title).\n",
        "docs/a.md": "# A\n## 12. New title\n",
    })

    done = run_gate(cwd=tmp_path)

    assert done.returncode == 1
    assert "README.md:3: link (docs/gpu-evidence.md): no file 'docs/gpu-evidence.md'" in done.stdout
    assert "no heading with anchor #12-old-title in a.md; headings starting alike: #12-new-title" in done.stdout
    assert "2 files, 2 links, 2 broken" in done.stdout


def test_a_path_that_does_not_exist_is_a_usage_error(tmp_path):
    done = run_gate("nowhere", cwd=tmp_path)

    assert done.returncode == 2
    assert "nowhere does not exist" in done.stderr


def test_the_repository_links_resolve():
    done = run_gate(cwd=ROOT)

    assert done.returncode == 0, done.stdout
