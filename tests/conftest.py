"""The root of the `tests` package.  pytest imports this file as `tests.conftest` and so puts the
repository root on sys.path (its "prepend" import mode), which is how test modules import the shared
helpers as a package: `from tests.connectors._harness import ...`, `from tests import strategies`.
Spawned workers inherit that sys.path.  Our own packages come installed (ci/setup_env.sh).

The folders mirror the product (docs/testing.md#where-each-test-lives); fixtures that several of
them use live here."""

import threading

import pytest

from vllm_afd.metrics import WATCHER_THREAD as METRICS_WATCHER


@pytest.fixture(autouse=True)
def _metrics_watchers_end_with_their_test():
    """A test that builds an AFD runner shuts it down, and with it the runner's metrics watcher thread."""
    before = {t.ident for t in threading.enumerate() if t.name == METRICS_WATCHER}
    yield
    leaked = [t for t in threading.enumerate() if t.name == METRICS_WATCHER and t.ident not in before]
    assert not leaked, (f"{len(leaked)} AFD metrics watcher thread(s) outlived the test: shut down the runners it "
                        "built (runner.shutdown() / Telemetry.close())")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A config-only tiny Qwen3-MoE (config.json, no weights), for real VllmConfigs built without an engine."""
    from tests.connectors._vllm_configs import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"))
