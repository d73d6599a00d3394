"""`--rebase-report` (scripts/_rebase.py) on synthetic "newer release" trees."""
from __future__ import annotations

import pytest
from tests.patches.patch_helpers import HEADER, VERSION_PY, make_hook_patch, write_series

from afd_patchtool import _diff
from afd_patchtool import _rebase
from afd_patchtool import _series

RENAMED = b"""def f():
    dp_sync = 1
    a = 2
    b = 3
    c = 4
    d = 5
    e = 6
    g = 7
    return dp_sync
"""


def release(tmp_path, files: dict[str, bytes]):
    root = tmp_path / "release"
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "_version.py").write_bytes(VERSION_PY.replace(b"0.30.0", b"0.33.0"))
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root


@pytest.fixture
def series(tmp_path, tree):
    return write_series(tmp_path / "patches", {
        "a-add-hook.patch": make_hook_patch(tree, "vllm/a.py", 5, "a-add-hook"),
        "b-add-hook.patch": make_hook_patch(tree, "vllm/b.py", 7, "b-add-hook"),
    })


def test_offsets_and_conflicts_are_tabled_per_hunk(run, tmp_path, tree, series, pin):
    a = b"# new header\n" * 3 + (tree / "vllm" / "a.py").read_bytes()
    b = (tree / "vllm" / "b.py").read_bytes().replace(b"def f7():\r\n", b"def f7(x):\r\n")
    target = release(tmp_path, {"vllm/a.py": a, "vllm/b.py": b})
    report = tmp_path / "r.md"

    code, out = run("--rebase-report", target, "--patches", series, "--pin", pin, "--out", report)

    text = report.read_text()
    assert code == 1 and "exit 1 (conflicts)" in out
    assert "| a-add-hook | `vllm/a.py` | 1/1 | 14 | 17 | +3 | offset | offset +3 |" in text
    assert "| b-add-hook | `vllm/b.py` | 1/1 | 20 | — | — | none | conflict — nearest candidate" in text
    assert "`b-add-hook.patch`: failed; refresh the patch" in text
    assert (target / "vllm" / "a.py").read_bytes() == a


def test_patch_whose_target_file_was_deleted_says_removed_upstream(run, tmp_path, tree, series, pin):
    target = release(tmp_path, {"vllm/a.py": (tree / "vllm" / "a.py").read_bytes()})  # no vllm/b.py

    code, out = run("--rebase-report", target, "--patches", series, "--pin", pin)

    assert code == 1 and "| b-add-hook | `vllm/b.py` | 1/1 | 1 | — | — | none | conflict — file is absent |" in out
    assert f"- `b-add-hook.patch`: `vllm/b.py` removed upstream in tree {target}: re-home or drop" in out
    assert "`b-add-hook.patch`: failed; refresh the patch" not in out


def test_content_already_upstream_is_recognised(run, tmp_path, tree, series, pin):
    a = (tree / "vllm" / "a.py").read_bytes().replace(
        b"def f5():\n    return 5\n",
        b"def f5():\n    # upstream grew the same hook\n    print( 'hook_5' )\n\n    return 5\n")
    target = release(tmp_path, {"vllm/a.py": a, "vllm/b.py": (tree / "vllm" / "b.py").read_bytes()})

    code, out = run("--rebase-report", target, "--patches", series, "--pin", pin)

    assert code == 3
    assert "| a-add-hook | `vllm/a.py` | 1/1 | 14 | — | — | upstream | already upstream" in out
    assert "drop the patch and set `Applied-Upstream:" in out


def test_renamed_local_is_caught_by_the_pyflakes_diff(run, tmp_path, pin):
    pinned = tmp_path / "pinned"
    (pinned / "vllm").mkdir(parents=True)
    (pinned / "vllm" / "r.py").write_bytes(RENAMED)
    hooked = RENAMED.replace(b"    c = 4\n", b"    c = 4\n    # ### PATCH START: r-add-hook\n"
                                             b"    print(dp_sync)\n    # ### PATCH END: r-add-hook\n")
    header = HEADER.replace(b"vllm/a.py::f", b"vllm/r.py::f")
    patches = write_series(tmp_path / "p",
                           {"r-add-hook.patch": _diff.make_patch(header, [("vllm/r.py", RENAMED, hooked)])})
    renamed = RENAMED.replace(b"dp_sync", b"dp_sync_state")
    target = release(tmp_path, {"vllm/r.py": renamed})

    code, out = run("--rebase-report", target, "--patches", patches, "--pin", pin)

    assert code == 3
    assert "| r-add-hook | `vllm/r.py` | 1/1 | 3 | 3 | +0 | exact | clean |" in out
    assert ("undefined-name: `r-add-hook.patch` `vllm/r.py`: `dp_sync` is undefined after patching "
            f"tree {target} (close names there: dp_sync_state); the patch still places") in out
    assert "Patches: 1 applied (1 of them with semantic findings)." in out
    assert "- `r-add-hook.patch`: use the name tree" in out and "(dp_sync_state) in the new series' hunk" in out


def test_fuzz_is_a_flagged_diagnostic_only(run, tmp_path, tree, series, pin):
    a = (tree / "vllm" / "a.py").read_bytes().replace(b"    return 4\n", b"    return 44\n")
    target = release(tmp_path, {"vllm/a.py": a, "vllm/b.py": (tree / "vllm" / "b.py").read_bytes()})

    code, out = run("--rebase-report", target, "--patches", series, "--pin", pin)
    no_fuzz, out_no_fuzz = run("--rebase-report", target, "--patches", series, "--pin", pin, "--fuzz", "0")

    assert code == 3 and "needs fuzz 1 ⚠ fuzz" in out and "places only with fuzz" in out
    assert no_fuzz == 1 and "conflict" in out_no_fuzz


def test_fence_outside_its_anchor_is_reported(run, tmp_path, tree, pin):
    wrong_anchor = make_hook_patch(tree, "vllm/a.py", 5, "a-add-hook",
                                   header=HEADER.replace(b"vllm/a.py::f\n", b"vllm/a.py::f9\n"))
    patches = write_series(tmp_path / "p", {"a-add-hook.patch": wrong_anchor})
    target = release(tmp_path, {"vllm/a.py": (tree / "vllm" / "a.py").read_bytes()})

    code, out = run("--rebase-report", target, "--patches", patches, "--pin", pin)
    check, out_check = run("--check", "--src", tree, "--patches", patches, "--pin", pin)

    assert code == 3
    assert "anchor: `a-add-hook.patch` `vllm/a.py`: fence at vllm/a.py:17 sits in ['vllm/a.py::f5']" in out
    assert "- `a-add-hook.patch`: update its `Anchor:` lines or move the fence." in out
    assert check == 4 and "no declared Anchor" in out_check


def test_report_header_names_target_date_and_series(run, tmp_path, tree, series, pin):
    target = release(tmp_path, {"vllm/a.py": (tree / "vllm" / "a.py").read_bytes(),
                                "vllm/b.py": (tree / "vllm" / "b.py").read_bytes()})

    code, out = run("--rebase-report", target, "--patches", series, "--pin", pin)

    assert code == 0 and "exit 0 (no drift)" in out
    assert f"## tree {target}" in out
    assert f"series sha256 `{_series.series_sha256(_series.load_series(series))[:16]}`" in out
    assert "Semantic checks" in out and "- no findings" in out


def test_fence_scopes_cover_new_defs_inside_the_fence():
    source = (b"class W:\n    def old(self):\n        pass\n\n    # ### PATCH START: s\n"
              b"    def new(self):\n        pass\n    # ### PATCH END: s\n")

    scopes = _rebase.fence_scopes(source, "s")

    assert scopes == [(5, {"W", "W.new"})]
