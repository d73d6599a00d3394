"""The root of the `tests` package.  pytest imports this file as `tests.conftest` and so puts the
repository root on sys.path (its "prepend" import mode), which is how test modules import the shared
helpers as a package: `from tests.connectors._harness import ...`, `from tests import strategies`.
Spawned workers inherit that sys.path.  Our own packages come installed (ci/setup_env.sh).

The folders mirror the product (docs/testing.md#where-each-test-lives); fixtures that several of
them use live here."""

import pytest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A config-only tiny Qwen3-MoE (config.json, no weights), for real VllmConfigs built without an engine."""
    from tests.connectors._vllm_configs import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"))
