"""Properties of the patch engine (scripts/_series.py, _placement.py, _diff.py) on generated files and edits."""
from __future__ import annotations

import subprocess
import shutil

import pytest
import unidiff
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from afd_patchtool import _diff
from afd_patchtool import _placement
from afd_patchtool import _series
from tests import strategies as gen

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PATH = "vllm/x.py"


def patch_for(old: bytes | None, new: bytes | None, path: str = PATH) -> _series.Patch:
    return _series.parse_patch("t.patch", _diff.make_patch(b"Subject: t: t\n", [(path, old, new)]))


def apply(patch: _series.Patch, content: bytes | None, **kw) -> _placement.SeriesResult:
    return _placement.apply_series([patch], {PATH: content}.get, **kw)


@SETTINGS
@given(gen.file_pairs())
@example((b"a\r\nb", b"a\r\nb\r\n"))  # adding the final CRLF
@example((b"a\nb\n", b"a\nb"))  # removing the final newline
@example((b"x\x0cy\n1\n", b"x\x0cy\n2\n"))  # form feed is content, not a line break
def test_apply_then_reverse_is_identity(pair):
    old, new = pair
    patch = patch_for(old, new)

    forward = apply(patch, old)
    backward = apply(patch, new, reverse=True)

    assert forward.outcomes[0].status == "applied"
    assert forward.after[PATH] == new
    assert backward.after[PATH] == old


@SETTINGS
@given(gen.file_pairs())
def test_applying_to_the_patched_file_is_a_no_op(pair):
    old, new = pair
    patch = patch_for(old, new)

    again = apply(patch, new)

    assert again.outcomes[0].status == "already applied"
    assert again.after[PATH] == new


@SETTINGS
@given(gen.file_pairs(), st.integers(1, 30))
def test_lines_inserted_above_give_an_offset_and_the_right_result(pair, num_lines):
    old, new = pair
    eol = b"\r\n" if old.endswith(b"\r\n") or b"\r\n" in old[:200] else b"\n"
    prefix = b"".join(gen.fresh_line("above") + eol for _ in range(num_lines))
    patch = patch_for(old, new)
    first = patch.files[0].hunks[0]
    assume(first.num_lead == max(max(h.num_lead, h.num_trail) for h in patch.files[0].hunks))

    result = apply(patch, prefix + old)

    assert result.after[PATH] == prefix + new
    assert {r.offset for r in result.records} == {num_lines}
    assert {r.status for r in result.records} == {_placement.OFFSET}


@SETTINGS
@given(gen.file_pairs(), st.data())
def test_changed_context_is_refused_at_fuzz_0(pair, data):
    old, new = pair
    patch = patch_for(old, new)
    hunk = data.draw(st.sampled_from(patch.files[0].hunks))
    context = [i for i, (tag, _) in enumerate(hunk.lines) if tag == " "]
    if not context:
        return  # a hunk without context (whole-file rewrite) has nothing to alter
    pick = data.draw(st.sampled_from(context))
    line_no = hunk.source_start - 1 + sum(1 for t, _ in hunk.lines[:pick] if t != "+")
    lines = _series.split_lines(old)
    lines[line_no] = gen.fresh_line("altered") + (b"\n" if lines[line_no].endswith(b"\n") else b"")
    altered = b"".join(lines)

    result = apply(patch, altered)

    assert result.outcomes[0].status == "failed"
    assert result.after[PATH] == altered
    assert any(r.status == _placement.CONFLICT for r in result.records)


@SETTINGS
@given(gen.unique_lines(min_size=1), gen.eol_style())
def test_file_creation_and_deletion_round_trip(lines, style):
    content = gen.join(lines, *style)
    create, delete = patch_for(None, content), patch_for(content, None)

    created = apply(create, None)
    deleted = apply(delete, content)

    assert created.after[PATH] == content and created.outcomes[0].status == "applied"
    assert deleted.after[PATH] is None and deleted.outcomes[0].status == "applied"
    assert apply(create, content).outcomes[0].status == "already applied"
    assert apply(delete, None).outcomes[0].status == "already applied"
    assert apply(create, content, reverse=True).after[PATH] is None
    assert apply(create, b"other\n").outcomes[0].status == "failed"


@SETTINGS
@given(gen.file_pairs(lines=gen.pool_lines(min_size=1)))
def test_repetitive_files_apply_in_place_exactly(pair):
    old, new = pair
    patch = patch_for(old, new)

    result = apply(patch, old)

    assert result.outcomes[0].status == "applied"
    assert result.after[PATH] == new


@SETTINGS
@given(gen.file_pairs())
def test_unidiff_parses_every_generated_patch_and_blob_ids_match(pair):
    old, new = pair
    data = _diff.make_patch(b"Subject: t: t\n", [(PATH, old, new)])

    parsed = unidiff.PatchSet.from_string(_series.split_patch(data)[1], encoding="utf-8")
    patch = _series.parse_patch("t.patch", data)

    assert len(parsed) == 1 and all(h.is_valid() for h in parsed[0])
    assert (patch.files[0].old_blob, patch.files[0].new_blob) == (_series.blob_id(old), _series.blob_id(new))


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_generated_patch_applies_with_git_including_crlf(tmp_path):
    old = b"def f():\r\n    return 1\r\n\r\ndef g():\r\n    return 2"
    new = b"def f():\r\n    hook()\r\n    return 1\r\n\r\ndef g():\r\n    return 2\r\n"
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "x.py").write_bytes(old)
    diff = _series.split_patch(_diff.make_patch(b"", [(PATH, old, new)]))[1]
    (tmp_path / "p.diff").write_bytes(diff)

    subprocess.run(["git", "apply", "--unsafe-paths", "p.diff"], cwd=tmp_path, check=True)

    assert (tmp_path / "vllm" / "x.py").read_bytes() == new


def test_two_equal_matches_at_equal_distance_are_ambiguous():
    hunk_block = [b"a\n", b"b\n", b"c\n", b"d\n", b"e\n", b"f\n"]
    old = b"".join([b"u%d\n" % i for i in range(10)] + hunk_block + [b"v%d\n" % i for i in range(10)])
    lines = _series.split_lines(old)
    patch = patch_for(old, b"".join(lines[:13] + [b"NEW\n"] + lines[13:]))
    # The expected place now holds other text; two copies sit 5 lines above and below it.
    target = ([b"u%d\n" % i for i in range(5)] + hunk_block + [b"other%d\n" % i for i in range(4)]
              + hunk_block + [b"w\n"] * 10)

    result = apply(patch, b"".join(target))

    assert result.records[0].status == _placement.AMBIGUOUS
    assert result.after[PATH] == b"".join(target)


def test_a_second_copy_away_from_the_expected_line_is_ambiguous():
    block = [b"a\n", b"b\n", b"c\n", b"d\n", b"e\n", b"f\n"]
    old = b"".join([b"u%d\n" % i for i in range(10)] + block + [b"v\n"] * 3)
    lines = _series.split_lines(old)
    patch = patch_for(old, b"".join(lines[:13] + [b"NEW\n"] + lines[13:]))
    target = [b"pad%d\n" % i for i in range(12)] + block + [b"w%d\n" % i for i in range(30)] + block

    result = apply(patch, b"".join(target))

    assert result.records[0].status == _placement.AMBIGUOUS
    assert "refusing to guess" in result.records[0].detail


def test_fuzz_is_only_used_when_asked_and_reported():
    old = b"".join(b"line%d\n" % i for i in range(20))
    lines = _series.split_lines(old)
    patch = patch_for(old, b"".join(lines[:10] + [b"NEW\n"] + lines[10:]))
    drifted = old.replace(b"line7\n", b"line7 changed\n")

    strict = apply(patch, drifted)
    fuzzy = apply(patch, drifted, fuzz=1)

    assert strict.outcomes[0].status == "failed"
    assert fuzzy.outcomes[0].status == "fuzz" and fuzzy.records[0].fuzz == 1
    assert b"NEW\n" in fuzzy.after[PATH]


def test_lf_patch_on_crlf_file_is_eol_normalized():
    crlf = b"a\r\nb\r\nc\r\nd\r\n"
    patch = patch_for(b"a\nb\nc\nd\n", b"a\nb\nNEW\nc\nd\n")

    result = apply(patch, crlf)

    assert result.after[PATH] == b"a\r\nb\r\nNEW\r\nc\r\nd\r\n"
    assert result.records[0].eol_normalized


def test_partial_patch_is_reported_as_partial():
    old = b"".join(b"line%d\n" % i for i in range(40))
    lines = _series.split_lines(old)
    new_lines = lines[:5] + [b"A\n"] + lines[5:30] + [b"B\n"] + lines[30:]
    patch = patch_for(old, b"".join(new_lines))
    half = b"".join(lines[:5] + [b"A\n"] + lines[5:])

    result = apply(patch, half)

    assert result.outcomes[0].status == "partial"
    assert result.after[PATH] == half


def test_series_parser_ignores_comments_and_rejects_duplicates(tmp_path):
    (tmp_path / "series").write_text("# === group\n\na-b.patch  # why\nc.patch\n")
    (tmp_path / "dup").mkdir()
    (tmp_path / "dup" / "series").write_text("a.patch\na.patch\n")
    (tmp_path / "dup" / "a.patch").write_bytes(_diff.make_patch(b"Subject: x\n", [(PATH, b"1\n", b"2\n")]))

    entries = _series.parse_series(tmp_path / "series")

    assert entries == [("a-b.patch", 3), ("c.patch", 4)]
    with pytest.raises(_series.ConfigError, match="listed twice"):
        _series.load_series(tmp_path / "dup")


def test_header_fields_repeat_and_continue():
    data = b"Subject: a: b\nAnchor: vllm/a.py::f\nAnchor: vllm/a.py::g\nWhy: one\n  two\n---\n"
    data += _diff.make_patch(b"", [(PATH, b"1\n", b"2\n")]).split(b"---\n", 1)[1]

    patch = _series.parse_patch("t.patch", data)

    assert patch.header["Anchor"] == ["vllm/a.py::f", "vllm/a.py::g"]
    assert patch.header["Why"] == ["one two"]
    assert patch.header_errors == []


def test_local_label_is_stable_hex_without_cpu():
    patch = patch_for(b"1\n", b"2\n")

    label = _series.local_label("ced6857afa0ea7b2e3f0846a62e1394e90f15607", [patch])

    assert label == _series.local_label("ced6857afa0ea7b2e3f0846a62e1394e90f15607", [patch])
    assert label.startswith("afd.g") and len(label) == 15 and "cpu" not in label
    assert label != _series.local_label("0" * 40, [patch])


@pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch not installed")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(gen.file_pairs(), st.integers(0, 5), st.booleans())
def test_decision_and_output_equal_gnu_patch_at_fuzz_0(tmp_path_factory, pair, num_above, alter):
    old, new = pair
    patch = patch_for(old, new)
    target = b"".join(gen.fresh_line("above") + b"\n" for _ in range(num_above)) + old
    if alter:
        target = target.replace(patch.files[0].hunks[0].old[0], gen.fresh_line("x") + b"\n", 1)
    work = tmp_path_factory.mktemp("gnu")
    (work / "vllm").mkdir()
    (work / "vllm" / "x.py").write_bytes(target)
    (work / "p.diff").write_bytes(_series.split_patch(_diff.make_patch(b"", [(PATH, old, new)]))[1])

    gnu = subprocess.run(["patch", "-p1", "-F0", "-N", "--no-backup-if-mismatch", "-r", "-", "-i", "p.diff"],
                         cwd=work, capture_output=True, timeout=60)
    ours = apply(patch, target)

    assert (gnu.returncode == 0) == (ours.outcomes[0].status == "applied"), gnu.stdout
    if gnu.returncode == 0:
        assert (work / "vllm" / "x.py").read_bytes() == ours.after[PATH]
