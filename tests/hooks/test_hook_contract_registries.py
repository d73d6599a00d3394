"""Contract tests of the registry seams, the pin fix and the series itself (AST, no vLLM).

Also checks that the series applies to the pinned release with GNU patch at fuzz 0 and
zero offset (independently of scripts/apply_patches.py), that every patched file still
compiles, and that the markers are balanced and named after their patch.
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest
from hook_series import PATCHES, apply_series_with_gnu_patch, series_names, touched_files
from hook_ast import call_sites, find_def, param_names, parse, returned_name

pytestmark = pytest.mark.wheel

FORWARD_CONTEXT = "vllm/forward_context.py"
CONFIG = "vllm/config/vllm.py"
SERVING = "vllm/entrypoints/serve/engine/serving.py"
FT_SENTINEL = "vllm/v1/fault_tolerance/engine_core_sentinel.py"
CLI_MAIN = "vllm/entrypoints/cli/main.py"
CLI_RUN_BATCH = "vllm/entrypoints/cli/run_batch.py"


def test_series_applies_with_gnu_patch_at_fuzz_zero_and_no_offset(
    tmp_path: Path, pristine_tree: Path
) -> None:
    shutil.copytree(pristine_tree, tmp_path, dirs_exist_ok=True)

    output = apply_series_with_gnu_patch(tmp_path)

    assert output.count("patching file") >= len(series_names())


def test_patched_files_compile(pinned_tree: Path) -> None:
    for relpath in touched_files():
        compile((pinned_tree / relpath).read_text(encoding="utf-8"), relpath, "exec")


def test_markers_are_balanced_and_named_after_their_patch(pinned_tree: Path) -> None:
    stems = {name.removesuffix(".patch") for name in series_names()}
    marker = re.compile(r"^(\s*)# ### PATCH (START|END): (\S+)$")
    seen: set[str] = set()

    for relpath in touched_files():
        open_stem = None
        for line in (pinned_tree / relpath).read_text(encoding="utf-8").splitlines():
            match = marker.match(line)
            if not match:
                continue
            kind, stem = match.group(2), match.group(3)
            assert stem in stems, f"{relpath}: unknown stem {stem}"
            if kind == "START":
                assert open_stem is None, f"{relpath}: nested marker {stem}"
                open_stem = stem
            else:
                assert open_stem == stem, f"{relpath}: END {stem} closes {open_stem}"
                open_stem = None
            seen.add(stem)
        assert open_stem is None, f"{relpath}: unclosed marker {open_stem}"

    assert seen == stems


@pytest.mark.parametrize("name", series_names())
def test_patch_header_has_the_required_fields(name: str) -> None:
    text = (PATCHES / name).read_text(encoding="utf-8")
    header, _, diff = text.partition("\n---\n")
    fields = [line.split(":", 1)[0] for line in header.splitlines()]
    has_deletions = any(
        line.startswith("-") and not line.startswith("---") for line in diff.splitlines()
    )

    for required in ("Subject", "Category", "Why", "How", "Origin", "Upstream", "Forwarded",
                     "Anchor", "Remove-When", "Used-By", "Upstream-Pin", "Last-Update"):
        assert required in fields, f"{name}: missing {required}"
    assert ("Allow-Delete" in fields) == has_deletions
    added = sum(1 for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++"))
    assert added <= 40, f"{name}: {added} added lines; a seam stays within ~40"


@pytest.mark.parametrize(
    ("relpath", "register", "hook_type"),
    [
        (FORWARD_CONTEXT, "register_forward_context_hook", "ForwardContextHook"),
        (CONFIG, "register_vllm_config_hook", "VllmConfigHook"),
        (SERVING, "register_request_veto", "RequestVeto"),
        (FT_SENTINEL, "register_fault_responder", "FaultResponder"),
    ],
)
def test_registries_take_one_callable_and_return_an_unregister_function(
    pinned_tree: Path, relpath: str, register: str, hook_type: str
) -> None:
    func = find_def(parse(pinned_tree, relpath), register)

    assert len(param_names(func)) == 1
    assert ast.unparse(func.args.args[0].annotation) == hook_type
    assert ast.unparse(func.returns) == "Callable[[], None]"
    assert returned_name(func) == "unregister"
    assert ast.get_docstring(func)


def test_create_forward_context_runs_hooks_on_the_context_it_returns(pinned_tree: Path) -> None:
    func = find_def(parse(pinned_tree, FORWARD_CONTEXT), "create_forward_context")

    loop = func.body[-2]

    assert returned_name(func) == "forward_context"
    assert isinstance(loop, ast.For)
    assert ast.unparse(loop.iter) == "_forward_context_hooks"
    assert ast.unparse(loop.body[0]) == f"{ast.unparse(loop.target)}(forward_context)"


def test_config_hooks_run_right_before_the_platform_resolves_auto(pinned_tree: Path) -> None:
    post_init = find_def(parse(pinned_tree, CONFIG), "VllmConfig.__post_init__")
    body = post_init.body
    platform_update = next(
        i for i, stmt in enumerate(body)
        if "current_platform.check_and_update_config(self)" in ast.unparse(stmt)
    )

    loop, load_plugins = body[platform_update - 1], body[platform_update - 2]

    assert isinstance(loop, ast.For)
    assert ast.unparse(loop.iter) == "_vllm_config_hooks"
    assert ast.unparse(load_plugins) == "load_general_plugins()"
    assert len(call_sites(post_init, "check_and_update_config")) == 1


def test_request_vetoes_run_first_in_the_model_check(pinned_tree: Path) -> None:
    check = find_def(parse(pinned_tree, SERVING), "BaseServing._check_model")

    first = check.body[0]

    assert isinstance(first, ast.For)
    assert ast.unparse(first.iter) == "_request_vetoes"
    assert "return self.create_error_response(message)" in ast.unparse(first)


def test_cli_never_asks_metadata_for_vllm_without_a_fallback(pinned_tree: Path) -> None:
    main_module = parse(pinned_tree, CLI_MAIN)
    helper = find_def(main_module, "vllm_version")

    lookups = {
        relpath: [
            ast.unparse(site.call)
            for site in call_sites(parse(pinned_tree, relpath), "version")
            if site.call.args and ast.unparse(site.call.args[0]) == "'vllm'"
        ]
        for relpath in (CLI_MAIN, CLI_RUN_BATCH)
    }

    assert lookups == {CLI_MAIN: ["importlib.metadata.version('vllm')"], CLI_RUN_BATCH: []}
    handler = next(n for n in ast.walk(helper) if isinstance(n, ast.ExceptHandler))
    assert ast.unparse(handler.type) == "importlib.metadata.PackageNotFoundError"
    assert len(call_sites(find_def(main_module, "main"), "vllm_version")) == 1
    run_batch_cmd = find_def(parse(pinned_tree, CLI_RUN_BATCH), "RunBatchSubcommand.cmd")
    assert len(call_sites(run_batch_cmd, "vllm_version")) == 1
