"""The root of the `tests` package.  pytest imports this file as `tests.conftest` and so puts the
repository root on sys.path (its "prepend" import mode), which is how test modules import the shared
helpers as a package: `from tests.connectors._harness import ...`, `from tests import strategies`.
Spawned workers inherit that sys.path.  Our own packages come installed (ci/setup_env.sh)."""
