"""`apply_patches.py --lint`: every rule has a passing series and a failing case."""
from __future__ import annotations

import pytest
from tests.patches.patch_helpers import HEADER, code_file, hook_edit, write_series

from afd_patchtool import _diff

A = code_file()
GOOD = _diff.make_patch(HEADER.replace(b"vllm/a.py::f\n", b"vllm/a.py::f5\n"),
                     [("vllm/a.py", A, hook_edit(A, 5, "a-add-hook"))])


def lint(run, tmp_path, pin, patches: dict[str, bytes], series: str | None = None):
    pdir = write_series(tmp_path / "p", patches)
    if series is not None:
        (pdir / "series").write_text(series)
    return run("--lint", "--patches", pdir, "--pin", pin)


def test_good_series_passes_without_warnings(run, tmp_path, pin):
    code, out = lint(run, tmp_path, pin, {"a-add-hook.patch": GOOD})

    assert code == 0 and "OK: lint: 1 patches, no violations (0 warnings)" in out


def header_without(field: bytes) -> bytes:
    return b"".join(line + b"\n" for line in GOOD.split(b"\n")
                    if not line.startswith(field + b":"))[:-1]


@pytest.mark.parametrize("field", [b"Subject", b"Why", b"Upstream", b"Remove-When"])
def test_missing_required_field_fails(run, tmp_path, pin, field):
    code, out = lint(run, tmp_path, pin, {"a-add-hook.patch": header_without(field)})

    assert code == 4 and f"header field {field.decode()}: missing; required" in out


@pytest.mark.parametrize("field", [b"Category", b"How", b"Anchor", b"Used-By", b"Upstream-Pin", b"Last-Update"])
def test_missing_recommended_field_only_warns(run, tmp_path, pin, field):
    code, out = lint(run, tmp_path, pin, {"a-add-hook.patch": header_without(field)})

    assert code == 0 and f"warning: patches/a-add-hook.patch: header field {field.decode()}: missing" in out


def test_deleting_lines_needs_allow_delete_and_only_then(run, tmp_path, pin):
    edited = hook_edit(A, 5, "a-rm").replace(b"    return 2\n", b"")
    deleting = _diff.make_patch(HEADER, [("vllm/a.py", A, edited)])
    with_reason = _diff.make_patch(HEADER + b"Allow-Delete: test\n", [("vllm/a.py", A, edited)])

    missing, out_missing = lint(run, tmp_path / "1", pin, {"a-rm.patch": deleting})
    needless, out_needless = lint(run, tmp_path / "2", pin, {
        "a-add-hook.patch": GOOD.replace(b"Remove-When", b"Allow-Delete: x\nRemove-When")})

    assert missing == 4 and "removes lines but has no Allow-Delete" in out_missing
    assert needless == 4 and "Allow-Delete set but the diff removes no line" in out_needless
    assert b"Allow-Delete: test" in with_reason


def test_added_line_outside_a_fence_fails(run, tmp_path, pin):
    edited = hook_edit(A, 5, "a-add-hook").replace(b"def f6():\n", b"def f6():\n    unfenced()\n")
    patch = _diff.make_patch(HEADER, [("vllm/a.py", A, edited)])

    code, out = lint(run, tmp_path, pin, {"a-add-hook.patch": patch})

    assert code == 4 and "added line outside a `# ### PATCH START: a-add-hook` fence" in out


def test_fence_with_another_stem_fails(run, tmp_path, pin):
    patch = _diff.make_patch(HEADER, [("vllm/a.py", A, hook_edit(A, 5, "other-stem"))])

    code, out = lint(run, tmp_path, pin, {"a-add-hook.patch": patch})

    assert code == 4 and "marker carries stem 'other-stem'; expected 'a-add-hook'" in out


def test_unbalanced_and_misindented_fences_fail(run, tmp_path, pin):
    no_end = hook_edit(A, 5, "a-add-hook").replace(b"    # ### PATCH END: a-add-hook\n", b"")
    bad_indent = hook_edit(A, 5, "a-add-hook").replace(b"    # ### PATCH START", b"# ### PATCH START")

    code_end, out_end = lint(run, tmp_path / "1", pin, {
        "a-add-hook.patch": _diff.make_patch(HEADER, [("vllm/a.py", A, no_end)])})
    code_ind, out_ind = lint(run, tmp_path / "2", pin, {
        "a-add-hook.patch": _diff.make_patch(HEADER, [("vllm/a.py", A, bad_indent)])})

    assert code_end == 4 and "START without END" in out_end
    assert code_ind == 4 and "START marker indented 0, the code after it 4" in out_ind


def test_trailing_whitespace_in_added_line_fails(run, tmp_path, pin):
    patch = GOOD.replace(b"    print('hook_5')\n", b"    print('hook_5')  \n")

    code, out = lint(run, tmp_path, pin, {"a-add-hook.patch": patch})

    assert code == 4 and "trailing whitespace in an added line" in out


def test_paths_outside_vllm_fail(run, tmp_path, pin):
    patch = _diff.make_patch(HEADER, [("setup.py", A, hook_edit(A, 5, "a-add-hook"))])

    code, out = lint(run, tmp_path, pin, {"a-add-hook.patch": patch})

    assert code == 4 and "touches setup.py; expected paths under vllm/ only" in out


def test_series_rules_fail(run, tmp_path, pin):
    unlisted, out_unlisted = lint(run, tmp_path / "1", pin, {"a-add-hook.patch": GOOD}, series="")
    twice, out_twice = lint(run, tmp_path / "2", pin, {"a-add-hook.patch": GOOD},
                            series="a-add-hook.patch\na-add-hook.patch\n")
    missing, out_missing = lint(run, tmp_path / "3", pin, {"a-add-hook.patch": GOOD},
                                series="a-add-hook.patch\nghost.patch\n")
    badname, out_badname = lint(run, tmp_path / "4", pin, {"A_Hook.patch": GOOD})

    assert unlisted == 4 and "not listed in series" in out_unlisted
    assert twice == 4 and "listed twice" in out_twice
    assert missing == 4 and "ghost.patch: file missing" in out_missing
    assert badname == 4 and "name does not match" in out_badname


def test_missing_final_newline_and_crlf_header_fail(run, tmp_path, pin):
    no_newline, out_nl = lint(run, tmp_path / "1", pin, {"a-add-hook.patch": GOOD[:-1]})
    crlf, out_crlf = lint(run, tmp_path / "2", pin, {
        "a-add-hook.patch": GOOD.replace(b"Why: test\n", b"Why: test\r\n")})

    assert no_newline == 4 and "no final newline" in out_nl
    assert crlf == 4 and "header lines end in CRLF" in out_crlf


def test_non_field_header_line_fails(run, tmp_path, pin):
    code, out = lint(run, tmp_path, pin, {"a-add-hook.patch": b"just prose\n" + GOOD})

    assert code == 4 and "is not `Field: value`" in out


def test_crlf_content_lines_are_not_trailing_whitespace(run, tmp_path, pin):
    b = code_file(eol=b"\r\n")
    patch = _diff.make_patch(HEADER.replace(b"vllm/a.py::f\n", b"vllm/b.py::f5\n"),
                          [("vllm/b.py", b, hook_edit(b, 5, "b-add-hook", b"\r\n"))])

    code, out = lint(run, tmp_path, pin, {"b-add-hook.patch": patch})

    assert code == 0, out


def test_blank_lines_next_to_a_fence_are_spacing_but_not_elsewhere(run, tmp_path, pin):
    spaced = hook_edit(A, 5, "a-add-hook").replace(b"PATCH END: a-add-hook\n", b"PATCH END: a-add-hook\n\n")
    stray = spaced.replace(b"def f8():\n", b"def f8():\n\n")

    ok, out_ok = lint(run, tmp_path / "1", pin,
                      {"a-add-hook.patch": _diff.make_patch(HEADER, [("vllm/a.py", A, spaced)])})
    bad, out_bad = lint(run, tmp_path / "2", pin,
                        {"a-add-hook.patch": _diff.make_patch(HEADER, [("vllm/a.py", A, stray)])})

    assert ok == 0, out_ok
    assert bad == 4 and "added line outside" in out_bad
