"""A frozen FFN server under a serving attention (docs/failures.md#bounded-waits): every wait of the
attention is bounded, so a peer that stops answering without closing anything is an outage within
``step_timeout_s`` + 10 s, not a hang, and the same attention heals once the FFN answers again.

SIGSTOP stops every process of the FFN server, the rendezvous store's host (FFN rank 0) among them: its
TCP connections stay open and its kernel still accepts connections, so nothing fails on its own; only
the attention's bounds (the watchdog's judgement, each store call's deadline, the transfer bound) can
end its waits.  While it heals, its ``/health`` answers the 503 its requests get (patch
``health-add-health-veto``: it fails readiness, docs/operations.md#probes), and 200 again once it serves.
One 1A1F deployment of the tiny Qwen3-MoE serves both cases: the FFN thawed
(SIGCONT), then the FFN frozen again and replaced (kill, restart).  The checks gate on progress
(chunks streamed, samples scraped), never on fixed sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import requests

from afd_harness.afd import AFDDeployment
from afd_harness.metrics import scrape, wait_for
from afd_harness.server import complete_batch

pytestmark = pytest.mark.e2e

PROMPTS = ["Hello, my name is", "The capital of France is", "In a shocking finding,",
           "1 2 3 4 5", "The experts said"]
MAX_TOKENS = 12
STEP_TIMEOUT_S = 10.0
PEER_TIMEOUT_S = 3.0
# The bound of the brief outage: the failure seen and requests answered 503 within this of the freeze.
DETECTED_WITHIN_S = STEP_TIMEOUT_S + 10.0
STREAM_TOKENS = 480  # as long as the 512-token context allows: decoding for seconds


def greedy_batch(base_url: str) -> list[list[int]]:
    return [g.token_ids for g in complete_batch(base_url, PROMPTS, MAX_TOKENS)]


PLAIN_REQUESTS = (greedy_batch,)  # answered by the session's plain server (conftest.py)


def stream(base_url: str, model: str, chunks: list[int], ended: list[float]) -> None:
    """Stream a long completion, counting its chunks; record when it ended (any way)."""
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": STREAM_TOKENS, "ignore_eos": True,
            "stream": True, "temperature": 0}
    try:
        with requests.post(f"{base_url}/v1/completions", json=body, stream=True, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith(b"data: {") and b'"error"' not in line:
                    chunks[0] += 1
    except requests.RequestException:
        pass
    ended.append(time.monotonic())


def probe(base_url: str, model: str) -> tuple[int, str, float]:
    """One small completion: (status, body, seconds it took); a hang is a read timeout of 60 s (status 0)."""
    started = time.monotonic()
    try:
        response = requests.post(f"{base_url}/v1/completions", timeout=60,
                                 json={"model": model, "prompt": PROMPTS[1], "max_tokens": 2})
    except requests.RequestException as exc:
        return 0, str(exc), time.monotonic() - started
    return response.status_code, response.text, time.monotonic() - started


def health(base_url: str) -> tuple[int, str]:
    """``/health``'s status and body; status 0 when it did not answer within 5 s."""
    try:
        response = requests.get(f"{base_url}/health", timeout=5)
    except requests.RequestException as exc:
        return 0, str(exc)
    return response.status_code, response.text


def freeze_mid_stream(afd: AFDDeployment) -> dict[str, float]:
    """Stop the FFN server while the attention streams; return when the outage was seen and answered.

    The FFN stays stopped on return (the caller thaws or replaces it)."""
    base_url, model = afd.attention.base_url, str(afd.model)
    chunks: list[int] = [0]
    ended: list[float] = []
    streamer = threading.Thread(target=stream, args=(base_url, model, chunks, ended), daemon=True)
    streamer.start()
    assert wait_for(lambda: chunks[0] > 0, timeout_s=60.0), "the stream never started"
    assert scrape(base_url)[("afd_peer_up", "attention")] == 1.0
    frozen_at = time.monotonic()
    os.killpg(afd.ffn.process.pid, signal.SIGSTOP)

    assert wait_for(lambda: scrape(base_url).get(("afd_peer_up", "attention")) == 0.0,
                    timeout_s=DETECTED_WITHIN_S + 30.0, interval_s=0.2), afd.attention.log_tail()
    peer_down_s = time.monotonic() - frozen_at
    status, body, took_s = probe(base_url, model)
    answered_s = time.monotonic() - frozen_at
    health_status, health_body = health(base_url)
    streamer.join(STEP_TIMEOUT_S + 60.0)
    print(f"frozen FFN: afd_peer_up 0 after {peer_down_s:.1f} s, a new request answered {status} in "
          f"{took_s:.1f} s ({answered_s:.1f} s after the freeze), the stream ended after "
          f"{(ended[0] - frozen_at) if ended else float('nan'):.1f} s, /health {health_status}")

    assert peer_down_s < DETECTED_WITHIN_S
    assert status == 503, (status, body, afd.attention.log_tail())
    assert "AFD attention server unavailable" in body and "re-forming" in body, body
    # NOTE: the FFN is still stopped, so the attention still heals: /health fails readiness with the same answer.
    assert (health_status, json.loads(health_body)) == (503, json.loads(body)), health_body
    assert answered_s < DETECTED_WITHIN_S + 5.0
    assert ended and ended[0] - frozen_at < DETECTED_WITHIN_S + 5.0, "the in-flight stream did not end"
    assert afd.attention.process.poll() is None
    return {"peer_down_s": peer_down_s, "answered_s": answered_s}


def serves_plain_again(afd: AFDDeployment, plain: list[list[int]]) -> float:
    """Wait until the attention answers 200 again; its greedy tokens equal plain vLLM's. Returns seconds."""
    base_url, model = afd.attention.base_url, str(afd.model)
    since = time.monotonic()
    assert wait_for(lambda: probe(base_url, model)[0] == 200, timeout_s=240.0, interval_s=1.0), \
        afd.attention.log_tail()
    took_s = time.monotonic() - since
    assert greedy_batch(base_url) == plain
    page = scrape(base_url)
    assert (page[("afd_peer_up", "attention")], page[("afd_peer_lost", "attention")]) == (1.0, 0.0)
    assert health(base_url)[0] == 200
    return took_s


def test_frozen_ffn_is_an_outage_within_the_step_timeout_then_heals(tiny_model_dir, vllm_python, tmp_path,
                                                                     plain_outputs):
    plain = plain_outputs("qwen3_moe", greedy_batch)
    afd = AFDDeployment(tiny_model_dir("qwen3_moe"), python=vllm_python, log_dir=tmp_path,
                        afd_fields={"step_timeout_s": STEP_TIMEOUT_S, "peer_timeout_s": PEER_TIMEOUT_S})
    with afd:
        assert greedy_batch(afd.attention.base_url) == plain
        attention_pid = afd.attention.process.pid

        # Thawed: the same FFN process answers again; both sides re-form.
        try:
            freeze_mid_stream(afd)
        finally:
            os.killpg(afd.ffn.process.pid, signal.SIGCONT)
        thawed_s = serves_plain_again(afd, plain)

        # Replaced: frozen again, then killed and restarted by its supervisor.
        try:
            freeze_mid_stream(afd)
        finally:
            afd.ffn.kill()
        afd.ffn.start()
        replaced_s = serves_plain_again(afd, plain)

        assert afd.attention.process.pid == attention_pid and afd.attention.process.poll() is None
        print(f"frozen FFN: serving again {thawed_s:.1f} s after the thaw, {replaced_s:.1f} s after the "
              "restarted FFN was up")
