"""Fixtures shared by the unit tests."""

import pytest

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A config-only tiny Qwen3-MoE (config.json, no weights), for real VllmConfigs built without an engine."""
    from tests.connectors._vllm_configs import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"))
