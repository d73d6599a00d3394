"""Fixtures for tests that start real vLLM OpenAI servers on the tiny checkpoints.

* `vllm_python`: the interpreter that runs vLLM (env `AFD_VLLM_PYTHON`, default this one);
  every test using it skips with the import error when `import vllm` fails there.
* `tiny_model_dir(arch)`: builds a tiny checkpoint once (reused across sessions through its
  recipe hash) under env `AFD_TINY_MODELS_DIR`, default `<repo>/models/` (git-ignored).
* `record_timing(line)`: adds a line to the "vLLM server timings" section of the summary.
* `vllm_server_factory(model_dir, ...)`: starts a `VllmServer` with CPU defaults, the model's
  own serving env (`VLLM_MLA_DISABLE=1` for DeepSeek MHA) and a log under the session's tmp
  dir; every server still running is stopped at the end of the session.
* `plain_outputs(arch, requests)`: what `requests(base_url)` returns from plain vLLM (the patched
  build, the overlay plugin loaded, no AFD config) on the tiny `arch`.  One plain server per model
  and session answers every function in the `PLAIN_REQUESTS` of the session's test modules, then
  stops, so it never runs beside an AFD deployment and no module starts a baseline of its own.
  test_plain_vllm runs first (`pytest_collection_modifyitems`) and tests the same servers live
  through `plain_outputs.serving(arch)`.
* `plain_float32`: plain vLLM's float32 tokens on the tiny Qwen3-MoE for `POOL_PROMPTS` (batched, and the
  first two one by one): the one baseline of every FFN pool module (test_afd_pool, test_afd_pool_healing,
  test_afd_netns_pool), which run float32 (test_afd_pool.py says why).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence

import pytest

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]

VLLM_IMPORT_TIMEOUT_S = 300.0
POOL_PROMPTS = ("Hello, my name is", "The capital of France is", "In a shocking finding,", "1 2 3 4 5",
                "The experts said")
POOL_MAX_TOKENS = 12
FLOAT32 = ("--dtype", "float32")
TIMING_LINES = pytest.StashKey[list[str]]()


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The interpreter that runs vLLM servers; skip when it cannot import vllm."""
    python = os.environ.get("AFD_VLLM_PYTHON") or sys.executable
    try:
        done = subprocess.run(
            [python, "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
            capture_output=True, text=True, timeout=VLLM_IMPORT_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"AFD_VLLM_PYTHON={python}: cannot run `import vllm` ({exc})")
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-3:])
        pytest.skip(f"AFD_VLLM_PYTHON={python}: `import vllm` failed:\n{tail}")
    return python


@pytest.fixture(scope="session")
def tiny_models_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("AFD_TINY_MODELS_DIR") or REPO / "models")


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_models_root: pathlib.Path) -> Callable[[str], pathlib.Path]:
    """Build-or-reuse a tiny checkpoint by arch name; returns its directory."""
    pytest.importorskip("transformers")
    from afd_harness.tiny_models import build_tiny_model

    built: dict[str, pathlib.Path] = {}

    def get(arch: str) -> pathlib.Path:
        if arch not in built:
            built[arch] = build_tiny_model(arch, tiny_models_root / arch)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def vllm_server_factory(
    vllm_python: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., object]]:
    """Start servers on tiny models; callers may stop them early, the session stops the rest."""
    from afd_harness.server import VllmServer, cpu_server_env
    from afd_harness.tiny_models import serve_env

    log_dir = tmp_path_factory.mktemp("vllm_logs")
    servers: list[VllmServer] = []

    def start(
        model_dir: pathlib.Path, *, omp_cpus: str | None = "0", extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None, **server_kwargs,
    ) -> VllmServer:
        server_env = {**cpu_server_env(omp_cpus=omp_cpus), **serve_env(model_dir), **(env or {})}
        server = VllmServer(
            model_dir, env=server_env, extra_args=extra_args, python=vllm_python,
            log_path=log_dir / f"{pathlib.Path(model_dir).name}-{len(servers)}.log", **server_kwargs,
        )
        servers.append(server)
        server.start()
        return server

    yield start
    for server in servers:
        server.stop()


class PlainBaseline:
    """The session's plain vLLM: one server per model, started when first asked, answers every
    request function in `requests` at once, then stops (or stays up while `serving` holds it)."""

    def __init__(self, requests: Sequence[Callable[[str], object]], start_server: Callable[[str], object],
                 record_timing: Callable[[str], None]) -> None:
        self.requests = requests  # every PLAIN_REQUESTS function of the session's modules
        self.start_server = start_server  # arch -> a started VllmServer
        self.record_timing = record_timing
        self.answers: dict[tuple[str, Callable[[str], object]], object] = {}

    def __call__(self, arch: str, requests: Callable[[str], object]) -> object:
        """`requests(base_url)` as the plain server of `arch` answered it."""
        if requests not in self.requests:
            raise ValueError(
                f"plain_outputs: {requests.__module__}.{requests.__qualname__} is not in its module's "
                f"PLAIN_REQUESTS; expected one of {[f.__qualname__ for f in self.requests]}. List it "
                "there, so the one plain server per model answers it before it stops."
            )
        if (arch, requests) not in self.answers:
            with self.serving(arch):
                pass
        return self.answers[(arch, requests)]

    @contextlib.contextmanager
    def serving(self, arch: str) -> Iterator[object]:
        """The plain server of `arch`, up until the block ends; every request set is answered first."""
        server = self.start_server(arch)
        try:
            for fn in self.requests:
                self.answers[(arch, fn)] = fn(server.base_url)
            self.record_timing(f"plain vLLM {arch}: startup {server.startup_s:.1f} s, "
                               f"{len(self.requests)} baseline request sets answered")
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="session")
def plain_outputs(
    request: pytest.FixtureRequest, tiny_model_dir: Callable[[str], pathlib.Path],
    vllm_server_factory: Callable[..., object], record_timing: Callable[[str], None],
) -> PlainBaseline:
    """`plain_outputs(arch, requests)`; `plain_outputs.serving(arch)` for tests of plain vLLM itself."""
    modules = {item.module: None for item in request.session.items}  # collection order, once each
    requests = {fn: None for module in modules for fn in getattr(module, "PLAIN_REQUESTS", ())}
    return PlainBaseline(
        list(requests), lambda arch: vllm_server_factory(tiny_model_dir(arch), launcher="cli"), record_timing
    )


@pytest.fixture(scope="session")
def plain_float32(tiny_model_dir: Callable[[str], pathlib.Path], vllm_server_factory: Callable[..., object],
                  record_timing: Callable[[str], None]) -> object:
    """The FFN pool modules' one float32 baseline: a plain server started when first asked, stopped at once."""
    from afd_harness.server import greedy_tokens

    plain = vllm_server_factory(tiny_model_dir("qwen3_moe"), launcher="cli", extra_args=list(FLOAT32))
    try:
        record_timing(f"plain vLLM qwen3_moe float32: startup {plain.startup_s:.1f} s")
        return greedy_tokens(plain.base_url, POOL_PROMPTS, POOL_MAX_TOKENS)  # a GreedyTokens
    finally:
        plain.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """test_plain_vllm first among the e2e tests: its live plain servers answer every baseline."""
    e2e = [i for i, item in enumerate(items) if item.path.parent == HERE]
    if e2e:
        first = [item for item in items if item.path.name == "test_plain_vllm.py"]
        rest = [item for item in items[e2e[0]:] if item.path.name != "test_plain_vllm.py"]
        items[e2e[0]:] = first + rest


@pytest.fixture(scope="session")
def record_timing(pytestconfig: pytest.Config) -> Callable[[str], None]:
    """Collect one-line timings (startup, generation) for the end-of-run summary."""
    lines = pytestconfig.stash.setdefault(TIMING_LINES, [])
    return lines.append


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    lines = config.stash.get(TIMING_LINES, [])
    if lines:
        terminalreporter.section("vLLM server timings")
        for line in lines:
            terminalreporter.write_line(line)
