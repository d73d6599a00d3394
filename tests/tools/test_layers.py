"""docs/layers.txt holds the overlay's imports: every import points down (scripts/layers.py)."""

from __future__ import annotations


import pytest

import layers


def test_no_overlay_import_points_up_a_layer():
    problems = layers.upward_imports(layers.read_layers())

    assert problems == []


def test_every_layer_prefix_names_an_existing_module():
    modules = layers.overlay_modules()

    for layer in layers.read_layers():
        for prefix in layer.prefixes:
            assert prefix in modules, f"docs/layers.txt: {prefix} is not a module of overlay/"


def test_the_longest_prefix_decides_a_modules_layer():
    stack = [layers.Layer("top", "", ("pkg.a",)), layers.Layer("bottom", "", ("pkg",))]

    assert layers.layer_of("pkg.a.b", stack) == 0
    assert layers.layer_of("pkg.c", stack) == 1
    assert layers.layer_of("other", stack) is None


def test_relative_and_function_level_imports_are_read(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("from .sibling import x\n\ndef f():\n    import vllm_afd.workers.cpu\n    import torch\n")

    found = layers.imports_of("vllm_afd.wire.mod", source)

    assert found == {"vllm_afd.wire.sibling", "vllm_afd.workers.cpu"}


def test_a_malformed_layer_line_is_refused_with_its_line_number(tmp_path):
    path = tmp_path / "layers.txt"
    path.write_text("# comment\ntop | about\n")

    with pytest.raises(ValueError, match=r"layers.txt:2: expected 'name \| about \| module prefixes'"):
        layers.read_layers(path)


def test_the_wire_layer_is_below_everything_that_imports_vllm():
    stack = layers.read_layers()

    names = [layer.name for layer in stack]

    assert names.index("wire") > names.index("models") > names.index("wiring")
