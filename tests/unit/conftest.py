"""Make ``vllm_afd`` importable from the source tree when it is not pip-installed (-e) yet; fixtures
shared by the unit tests."""

import importlib.util
import pathlib
import sys

import pytest

if importlib.util.find_spec("vllm_afd") is None:
    # NOTE: CI installs the package with `pip install -e .`; this only serves a bare checkout.
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "overlay"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A config-only tiny Qwen3-MoE (config.json, no weights), for real VllmConfigs built without an engine."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "connectors"))
    from _vllm_configs import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"))
