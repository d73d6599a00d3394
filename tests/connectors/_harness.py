"""Connector test kit: spec, placement and fingerprint builders, an in-memory transport, a worker pool.

``make_spec``/``make_placement``/``make_connector`` build real connector ends (``AttentionConnector``,
``FFNConnector``) at small sizes (gloo unless a transport is given). ``QueueTransport`` is the
in-memory ``Transport`` of the in-process tests: it records every tensor on the wire. ``WorkerPool``
runs rank bodies in ``spawn``ed processes (torch and threads do not survive ``fork``): a top-level
function of this module or a test module, reporting a picklable result (or the formatted exception)
through a queue. Every wait has a timeout; leftovers are killed by pid.
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import queue
import socket
import time
import traceback
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vllm_afd.wire.attention_end import AttentionConnector
from vllm_afd.wire.auth import Secret
from vllm_afd.wire.connector import AFDConnector
from vllm_afd.wire.ends import make_connector as make_end
from vllm_afd.wire.ffn_end import FFNConnector
from vllm_afd.wire.handshake import Fingerprint
from vllm_afd.wire.placement import CONTROL, Placement
from vllm_afd.wire.spec import ConnectorSpec
from vllm_afd.wire.transport import DONE, SendHandle, Transport
from vllm_afd.wire.transports.gloo import GlooTransport

HIDDEN_SIZE = 64
NUM_EXPERTS = 8
CONNECTOR = "P2pGlooAFDConnector"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_spec(port: int, **overrides: Any) -> ConnectorSpec:
    """A gloo connector spec on CPU: [rows, 64] bf16 rows, 4 exchanges per stage, short liveness bounds."""
    values: dict[str, Any] = dict(
        name=CONNECTOR, hidden_size=HIDDEN_SIZE, dtype=torch.bfloat16, device=torch.device("cpu"),
        host="127.0.0.1", port=port, rendezvous_timeout_s=20.0, step_timeout_s=30.0, peer_timeout_s=2.0,
        exchanges_per_stage=4,
    )
    values.update(overrides)
    return ConnectorSpec(**values)


def make_placement(role: str, rank: int, num_attention: int, num_ffn: int, *, attention_tp: int = 1) -> Placement:
    """The placement of one rank; the attention runs ``attention_tp``-way TP, the FFN DP only."""
    tp_size = attention_tp if role == "attention" else 1
    num_role_ranks = num_attention if role == "attention" else num_ffn
    return Placement(role, rank, num_attention, num_ffn, dp_size=num_role_ranks // tp_size, tp_size=tp_size)


def make_fingerprint(placement: Placement, **overrides: Any) -> Fingerprint:
    """The fingerprint of a 4-layer "DMMM" model at ``placement``; any field may be overridden."""
    fingerprint = Fingerprint.for_rank(
        placement, connector=CONNECTOR, compute_gate_on_attention=False, hostname="localhost", pid=0,
        overlay_version="0.1.0", vllm_version="0.30.0", architecture="Qwen3MoeForCausalLM",
        hidden_size=HIDDEN_SIZE, num_hidden_layers=4, dtype="bfloat16", layer_kinds="DMMM",
        num_routed_experts=NUM_EXPERTS, graph_mode="eager", device="cpu",
    )
    return dataclasses.replace(fingerprint, **overrides)


def make_connector(spec: ConnectorSpec, placement: Placement, *, transport: Transport | None = None,
                   terminate: Callable[[BaseException], None] | None = None, reformable: bool = False,
                   secret: Secret | None = None, **fingerprint_overrides: Any) -> AttentionConnector | FFNConnector:
    """The end for ``placement``'s role (gloo unless told) whose fingerprint agrees with ``spec`` unless overridden;
    ``reformable``: it can ``reform()`` over a fresh gloo transport; ``secret``: the pairing's shared secret."""
    facts = dict(dtype=str(spec.dtype).removeprefix("torch."), hidden_size=spec.hidden_size,
                 compute_gate_on_attention=spec.router_logits_width is not None, connector=spec.name,
                 num_stages=spec.num_stages)
    facts.update(fingerprint_overrides)
    fingerprint = make_fingerprint(placement, **facts)
    return make_end(spec, placement, transport or GlooTransport(spec.device), fingerprint, terminate=terminate,
                    new_transport=(lambda: GlooTransport(spec.device)) if reformable else None, secret=secret)


def new_wire() -> defaultdict[tuple[str, int, int], deque]:
    """The shared medium of a set of ``QueueTransport``s."""
    return defaultdict(deque)


class QueueTransport(Transport):
    """In-memory channels: ``wire[(channel, src AFD rank, dst AFD rank)]`` is a FIFO of sent tensors.

    Every send is a clone, so the sender may reuse its tensor; a receive without a matching send, or
    of another size or dtype, fails the test at once instead of hanging.
    """

    def __init__(self, wire: defaultdict[tuple[str, int, int], deque]) -> None:
        self.wire = wire
        self.placement: Placement | None = None
        self.closed = 0
        self.aborted = 0

    def open(self, store: Any, placement: Placement, timeout_s: float) -> None:
        self.placement = placement

    def _afd(self, channel: str, group_rank: int) -> int:
        # Control group ranks are AFD ranks; data group ranks index the subgroup.
        return group_rank if channel == CONTROL else self.placement.subgroup_members[group_rank]

    def send(self, channel: str, tensor: torch.Tensor, dst: int) -> None:
        self.wire[(channel, self.placement.afd_rank, self._afd(channel, dst))].append(tensor.detach().clone())

    def isend(self, channel: str, tensor: torch.Tensor, dst: int) -> SendHandle:
        self.send(channel, tensor, dst)  # a clone: complete at once
        return DONE

    def recv(self, channel: str, tensor: torch.Tensor, src: int) -> None:
        pending = self.wire[(channel, self._afd(channel, src), self.placement.afd_rank)]
        assert pending, f"{channel} receive from group rank {src} without a matching send"
        sent = pending.popleft()
        assert sent.dtype == tensor.dtype and sent.numel() == tensor.numel(), "sizes disagree on the wire"
        tensor.copy_(sent.view(tensor.shape))

    def abort(self) -> None:
        self.aborted += 1

    def close(self) -> None:
        self.closed += 1


def init_all(connectors: Sequence[AFDConnector], timeout_s: float = 20.0) -> None:
    """Initialise connectors of one deployment together (each rendezvous waits for the others)."""
    import threading

    threads = [threading.Thread(target=c.init) for c in connectors]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    assert all(c.is_initialized for c in connectors), [c.failure for c in connectors]


def pending(wire: dict) -> dict[tuple[str, int, int], int]:
    """How many sent tensors wait on each (channel, src, dst) of ``wire``."""
    return {key: len(sent) for key, sent in wire.items() if sent}


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
