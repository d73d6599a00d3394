"""The commands `afd_plan.py plan` prints serve: a CPU profile's AFD split, started as printed (HTTP ports aside),
decodes plain vLLM's greedy tokens on the tiny Qwen3-MoE (docs/planner.md#the-printed-commands)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

import afd_plan
from afd_harness.server import VllmServer, complete_batch, free_ports

pytestmark = pytest.mark.e2e

PROFILE = Path(__file__).resolve().parents[2] / "scripts/afd_planner/profiles/cpu-qwen3-moe-1k-4l-amx.json"
PROMPTS = ["Hello, my name is", "The capital of France is", "In a shocking finding,", "1 2 3 4 5"]
MAX_TOKENS = 12


def batched_tokens(base_url: str) -> list[list[int]]:
    return [g.token_ids for g in complete_batch(base_url, PROMPTS, MAX_TOKENS)]


PLAIN_REQUESTS = (batched_tokens,)  # answered by the session's plain server (conftest.py)


def printed_afd_commands(model_dir, rendezvous_port: int, capsys) -> list[list[str]]:
    """The AFD commands of `plan` on two cores, each as its words (environment assignments first)."""
    assert afd_plan.main(["plan", str(PROFILE), "--gpus", "2", "--model", str(model_dir),
                          "--port", str(rendezvous_port)]) == 0
    commands = capsys.readouterr().out.replace("\\\n", " ").splitlines()
    return [shlex.split(c) for c in commands if "vllm serve" in c and "--additional-config" in c]


def test_the_printed_cpu_commands_serve_plain_tokens(tiny_model_dir, vllm_python, plain_outputs, tmp_path, capsys):
    model_dir = tiny_model_dir("qwen3_moe")
    (rendezvous_port,) = free_ports(1)
    commands = printed_afd_commands(model_dir, rendezvous_port, capsys)
    assert len(commands) == 2, commands  # 1A:1F on two cores: the FFN, then the attention
    servers = []
    for words in commands:
        start = words.index("vllm")
        env = dict(w.split("=", 1) for w in words[:start])
        args = words[start + 3:]  # after `vllm serve MODEL`
        port_at = args.index("--port")
        del args[port_at:port_at + 2]  # a free HTTP port instead of 8000 / 8001
        role = "ffn" if '"role": "ffn"' in " ".join(args) else "attention"
        assert words[start + 2] == str(model_dir) and set(env) == {"VLLM_CPU_OMP_THREADS_BIND"}
        servers.append(VllmServer(model_dir, python=vllm_python, launcher="cli", extra_args=args, env=env,
                                  log_path=tmp_path / f"{role}.log"))
    try:
        for server in servers:
            server.spawn()
        for server in servers:
            server.wait_healthy()
        attention = servers[1]
        assert batched_tokens(attention.base_url) == plain_outputs("qwen3_moe", batched_tokens)
    finally:
        for server in reversed(servers):
            server.stop()
