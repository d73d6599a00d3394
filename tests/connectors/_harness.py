"""Multi-process harness for connector tests: settings, fingerprints, spawn-and-collect.

Children are started with multiprocessing's ``spawn`` (torch and threads do not survive ``fork``),
run a top-level function of this module or a test module, and report a picklable result (or the
formatted exception) through a queue. Every wait has a timeout; leftovers are killed by pid.
"""

from __future__ import annotations

import itertools
import multiprocessing
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vllm_afd.connectors.gloo import GlooTransport
from vllm_afd.connectors.channels import P2pSettings
from vllm_afd.connectors.protocol import P2pProtocol
from vllm_afd.handshake import PROTOCOL_VERSION, Fingerprint

HIDDEN_SIZE = 64
NUM_EXPERTS = 8


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_fingerprint(role: str, role_rank: int, num_attention: int, num_ffn: int, **overrides: Any) -> Fingerprint:
    """A fingerprint with plain facts (a 4-layer "DMMM" model), as a real rank would publish."""
    dp_size = num_attention if role == "attention" else num_ffn
    values: dict[str, Any] = dict(
        protocol_version=PROTOCOL_VERSION, overlay_version="0.1.0", vllm_version="0.30.0",
        architecture="Qwen3MoeForCausalLM", hidden_size=HIDDEN_SIZE, num_hidden_layers=4, dtype="bfloat16",
        layer_kinds="DMMM", num_routed_experts=NUM_EXPERTS, connector="P2pGlooAFDConnector",
        num_attention_ranks=num_attention, num_ffn_ranks=num_ffn, compute_gate_on_attention=False,
        graph_mode="eager", dp_size=dp_size, tp_size=1, role=role, role_rank=role_rank,
        hostname="localhost", pid=0, device="cpu",
    )
    values.update(overrides)
    return Fingerprint(**values)


def make_settings(role: str, role_rank: int, num_attention: int, num_ffn: int, port: int, **overrides: Any) -> P2pSettings:
    values: dict[str, Any] = dict(
        role=role, role_rank=role_rank, num_attention_ranks=num_attention, num_ffn_ranks=num_ffn,
        hidden_size=HIDDEN_SIZE, dtype=torch.bfloat16, device=torch.device("cpu"), host="127.0.0.1",
        port=port, rendezvous_timeout_s=20.0, step_timeout_s=30.0, peer_timeout_s=2.0,
        dp_size=num_attention if role == "attention" else num_ffn, exchanges_per_stage=4,
        num_routed_experts=NUM_EXPERTS, connector_name="P2pGlooAFDConnector",
    )
    values.update(overrides)
    return P2pSettings(**values)


def make_protocol(settings: P2pSettings, terminate: Callable[[BaseException], None] | None = None,
                  transport_cls: type = GlooTransport, **fingerprint_overrides: Any) -> P2pProtocol:
    """A protocol (gloo unless told) whose fingerprint agrees with ``settings`` unless overridden."""
    facts = dict(dtype=str(settings.dtype).removeprefix("torch."),
                 compute_gate_on_attention=settings.compute_gate_on_attention,
                 connector=settings.connector_name, **fingerprint_overrides)
    fingerprint = make_fingerprint(settings.role, settings.role_rank, settings.num_attention_ranks,
                                   settings.num_ffn_ranks, **facts)
    return P2pProtocol(settings, transport_cls(settings.device), lambda: fingerprint, terminate=terminate)


def _worker_main(tasks: Any, results: Any) -> None:
    """Body of a pool process: run tasks until the None sentinel; report ok/error per task."""
    while True:
        task = tasks.get()
        if task is None:
            return
        run_id, index, target, args = task
        try:
            results.put((run_id, index, "ok", target(*args)))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which asserts
            results.put((run_id, index, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class WorkerPool:
    """Long-lived ``spawn`` processes that run rank bodies, so each test does not pay torch's import.

    A worker that dies (a test kills a rank on purpose) or overruns its deadline is killed by pid and
    replaced; results of earlier runs are told apart by run id.
    """

    def __init__(self, size: int) -> None:
        self._ctx = multiprocessing.get_context("spawn")
        self._results = self._ctx.Queue()
        self._workers: list[tuple[Any, Any]] = []
        self._run_ids = itertools.count()
        self._grow(size)

    def _spawn(self) -> tuple[Any, Any]:
        tasks = self._ctx.Queue()
        proc = self._ctx.Process(target=_worker_main, args=(tasks, self._results), daemon=True)
        proc.start()
        return proc, tasks

    def _grow(self, size: int) -> None:
        while len(self._workers) < size:
            self._workers.append(self._spawn())

    def _replace(self, index: int) -> None:
        proc, _ = self._workers[index]
        if proc.is_alive():
            proc.kill()
        proc.join(5.0)
        self._workers[index] = self._spawn()

    def run(self, target: Callable[..., Any], arg_lists: Sequence[Sequence[Any]],
            timeout_s: float = 60.0) -> list[tuple[str, Any]]:
        """Run ``target(*args)`` on worker i for entry i; returns [(status, value)] in entry order.

        status: "ok" (value = return), "error" (value = traceback text), "exit" (value = exit code,
        the worker died without reporting) or "timeout" (the worker was killed at the deadline).
        """
        self._grow(len(arg_lists))
        for i, (proc, _) in enumerate(self._workers[: len(arg_lists)]):
            if not proc.is_alive():
                self._replace(i)
        run_id = next(self._run_ids)
        for i, args in enumerate(arg_lists):
            self._workers[i][1].put((run_id, i, target, tuple(args)))
        outcome: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(outcome) < len(arg_lists) and time.monotonic() < deadline:
            try:
                got_run, index, status, value = self._results.get(timeout=0.2)
            except queue.Empty:
                for i in range(len(arg_lists)):
                    proc = self._workers[i][0]
                    if i not in outcome and not proc.is_alive():
                        time.sleep(0.3)  # a report may still be in flight
                        outcome.setdefault(i, ("exit", proc.exitcode))
                continue
            if got_run == run_id:
                outcome[index] = (status, value)
        for i in range(len(arg_lists)):
            if i not in outcome:
                outcome[i] = ("timeout", None)
            proc = self._workers[i][0]
            if outcome[i][0] in ("exit", "timeout") and proc.is_alive():
                proc.kill()  # replaced lazily by the next run that needs it
                proc.join(5.0)
        return [outcome[i] for i in range(len(arg_lists))]

    def close(self) -> None:
        for _, tasks in self._workers:
            tasks.put(None)
        for proc, _ in self._workers:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)


def expect_ok(outcomes: list[tuple[str, Any]]) -> list[Any]:
    failures = [f"process {i}: {status}: {value}" for i, (status, value) in enumerate(outcomes) if status != "ok"]
    assert not failures, "\n".join(failures)
    return [value for _, value in outcomes]
