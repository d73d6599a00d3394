"""pin.py: the constants equal VLLM_PIN, and a replaced or unpatched vLLM is refused."""

import hashlib
import json
from pathlib import Path


from vllm_afd import pin

ROOT = Path(__file__).resolve().parents[2]


def read_vllm_pin() -> dict[str, str]:
    values = {}
    for line in (ROOT / "VLLM_PIN").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            key, value = (part.strip() for part in line.split("=", 1))
            values[key] = value
    return values


def test_constants_equal_vllm_pin():
    values = read_vllm_pin()

    assert pin.PIN_COMMIT == values["commit"]
    assert pin.PIN_VERSION == values["version"]


def make_tree(tmp_path: Path, *, commit=pin.PIN_COMMIT, patches=pin.REQUIRED_PATCHES):
    package = tmp_path / "vllm"
    package.mkdir()
    hooked = package / "forward_context.py"
    hooked.write_bytes(b"# ### PATCH START: x\n")
    stamp = {
        "upstream": {"commit": commit, "version": "0.30.0"},
        "patches": [{"name": f"{name}.patch"} for name in patches],
        "files": {"vllm/forward_context.py": {
            "sha256": hashlib.sha256(hooked.read_bytes()).hexdigest()}},
    }
    (package / pin.STAMP_NAME).write_text(json.dumps(stamp))
    return package, stamp


def test_matching_stamp_has_no_problems(tmp_path):
    package, stamp = make_tree(tmp_path)

    assert pin.stamp_problems(stamp, package) == []


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
