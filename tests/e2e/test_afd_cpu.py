"""AFD end to end on CPU: real `vllm serve` processes (FFN + attention) on loopback.

The baseline is the same patched vLLM without AFD config; greedy tokens must be equal.
Each deployment costs two server start-ups (~40 s each here), so one deployment per model
serves several checks, the last of which kills its FFN, and the order of roles alternates
between the two models.  The plain tokens come from the session's one plain server per model
(`plain_outputs`, conftest.py).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
import requests

from vllm_afd.plugin import FFN_VETO_MESSAGE
from afd_harness.afd import AFDDeployment
from afd_harness.metrics import scrape, scrape_ranks, wait_for
from afd_harness.server import ServerStartError, chat, complete, complete_batch

pytestmark = pytest.mark.e2e

PROMPTS = ["Hello, my name is", "The capital of France is", "In a shocking finding,",
           "1 2 3 4 5", "The experts said"]
MAX_TOKENS = 12
MODELS = {"qwen3_moe": False, "deepseek_v2": True}  # arch -> start the attention first


def greedy_outputs(base_url: str) -> dict[str, list]:
    """Token ids for the prompts: batched, one by one streaming, and one chat turn."""
    batched = complete_batch(base_url, PROMPTS, MAX_TOKENS)
    streamed = [complete(base_url, prompt, MAX_TOKENS, stream=True) for prompt in PROMPTS[:3]]
    reply = chat(base_url, "Tell me about experts.", MAX_TOKENS)
    return {
        "batched": [g.token_ids for g in batched],
        "streamed": [g.text for g in streamed],
        "chat": [reply.text],
    }


@pytest.fixture(scope="module", params=sorted(MODELS))
def arch(request):
    return request.param


PLAIN_REQUESTS = (greedy_outputs,)  # answered by the session's plain server (conftest.py)


@pytest.fixture(scope="module")
def plain(arch, plain_outputs):
    return plain_outputs(arch, greedy_outputs)


@pytest.fixture(scope="module")
def module_deployment(arch, tiny_model_dir, vllm_python, tmp_path_factory):
    from afd_harness.tiny_models import serve_env

    log_dir = tmp_path_factory.mktemp(f"afd-{arch}")
    afd = AFDDeployment(tiny_model_dir(arch), python=vllm_python, log_dir=log_dir,
                        attention_first=MODELS[arch], env=serve_env(tiny_model_dir(arch)),
                        afd_fields={"timeline_dir": str(log_dir / "timeline")})
    with afd:
        yield afd


@pytest.fixture
def deployment(module_deployment):
    """The module's deployment of `arch`, both roles still up (the FFN-kill test ends it: it runs last)."""
    for server in module_deployment.servers:
        assert server.is_running(), (
            f"test_afd_cpu: the {module_deployment.model.name} deployment is down ({server.log_path}); "
            "expected test_ffn_killed_mid_stream_then_restarted_under_the_same_attention, which ends it, to run "
            "last on it. Run the module in file order."
        )
    return module_deployment


def test_afd_tokens_equal_plain_vllm(plain, deployment):
    outputs = greedy_outputs(deployment.attention.base_url)

    assert outputs == plain


def test_the_timeline_has_every_crossing_layer_of_both_roles(deployment):
    """timeline_dir on both roles: one record per step and rank, joined by the report (docs/timeline.md)."""
    import json

    import timeline_report  # scripts/timeline_report.py (the afd-scripts distribution)

    complete(deployment.attention.base_url, PROMPTS[0], 4)
    directory = deployment.log_dir / "timeline"
    config = json.loads((deployment.model / "config.json").read_text())
    ranks = timeline_report.load(directory)

    assert sorted(ranks) == ["attention-0", "ffn-0"]
    rows = timeline_report.breakdown(ranks)
    assert rows and all(row["layers"] == config["num_hidden_layers"] and row["kind"] == "eager" for row in rows)
    for row in rows:
        assert row["round trip"] >= row["FFN compute"] > 0 and row["attention compute"] > 0
        assert row["host syncs"] == 0 and row["FFN host syncs"] == 0  # CPU: nothing to wait for
    steps = {name: [r.step_seq for r in records] for name, records in ranks.items()}
    assert set(steps["attention-0"]) & set(steps["ffn-0"])  # the same steps, seen from both roles


def test_ffn_server_refuses_generation_and_points_to_attention(deployment):
    url = deployment.ffn.base_url

    completion = requests.post(f"{url}/v1/completions", timeout=60, json={
        "model": deployment.ffn.model, "prompt": "Hi", "max_tokens": 4})
    chat_reply = requests.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": deployment.ffn.model, "messages": [{"role": "user", "content": "Hi"}]})

    for response in (completion, chat_reply):
        assert response.status_code == 400
        assert FFN_VETO_MESSAGE in response.json()["error"]["message"]
    assert requests.get(f"{url}/health", timeout=10).status_code == 200
    assert requests.get(f"{url}/v1/models", timeout=10).status_code == 200


def test_attention_fails_at_startup_when_the_ffn_never_starts(tiny_model_dir, vllm_python,
                                                              tmp_path):
    afd = AFDDeployment(tiny_model_dir("qwen3_moe"), python=vllm_python, log_dir=tmp_path,
                        afd_fields={"rendezvous_timeout_s": 8})

    with pytest.raises(ServerStartError):
        afd.attention.start()

    log = afd.attention.log_path.read_text()
    assert "AFD rendezvous timed out after 8s" in log or "cannot reach the AFD rendezvous" in log
    assert afd.attention.process.poll() is not None


def test_ffn_serving_another_model_is_refused_by_the_handshake(tiny_model_dir, vllm_python,
                                                               tmp_path):
    afd = AFDDeployment(tiny_model_dir("qwen3_moe"), ffn_model=tiny_model_dir("deepseek_v2"),
                        python=vllm_python, log_dir=tmp_path,
                        afd_fields={"rendezvous_timeout_s": 120})

    with pytest.raises(ServerStartError):
        afd.start()

    log = afd.attention.log_path.read_text()
    assert "AFD configuration mismatch" in log
    assert "architecture (attention=Qwen3MoeForCausalLM, ffn=DeepseekV2ForCausalLM)" in log


@pytest.mark.parametrize("attention_args, attention_cpus, num_stages", [
    # TP 2 with micro-batch stages (docs/pingpong.md): both ranks split every batched step alike and run their
    # stages' all-reduces in one baton order; batch-1 steps stay one stage, so both paths run here.  Both TP
    # ranks on core 1, the FFN alone on core 0 (failures.md#14-cpu-co-location): with TP rank 0 on the FFN's
    # core the FFN stopped answering for 5-35 s under load (failures.md#22-the-attention-tp-2-stall).
    (["--tensor-parallel-size", "2"], "1|1", 2),
    # Attention DP: two engine cores (and two API servers) behind one port; the idle rank runs
    # vLLM's dummy batches, which cross to the FFN as one row each.  With stages vLLM's DP vote splits a
    # step only when both ranks want to (the batch of 5: 3 + 2 requests) and pads both alike; an idle rank's
    # dummy step keeps both whole (the one-by-one requests).
    (["--data-parallel-size", "2"], "1|1", 2),
], ids=["tp2", "dp2"])
def test_two_attention_ranks_share_one_ffn(tiny_model_dir, vllm_python, tmp_path, plain_outputs_qwen,
                                           plain_tp2_qwen, attention_args, attention_cpus, num_stages):
    # NOTE: a stalled step (issue: an intermittent TP 2 hang) must fail well before the client's 120 s
    # read timeout, naming the waiting rank and the transfer it waits in (the watchdog's message).
    afd = AFDDeployment(tiny_model_dir("qwen3_moe"), python=vllm_python, log_dir=tmp_path,
                        afd_fields={"num_attention_ranks": 2, "step_timeout_s": 30, "num_stages": num_stages,
                                    "min_tokens_per_stage": 1},  # the batch of 5 splits its decodes too
                        attention_args=attention_args, attention_cpus=attention_cpus)

    # NOTE: attention TP 2 sums each layer's row-parallel halves in another order than one rank does, and on
    # this machine's AMX kernels that flips a greedy near-tie (prompt 4, token 9): plain vLLM with the same
    # flags is the baseline for TP 2; DP 2 computes each request as one rank does.
    expected = plain_tp2_qwen if "--tensor-parallel-size" in attention_args else plain_outputs_qwen
    with afd:
        batched = complete_batch(afd.attention.base_url, PROMPTS, MAX_TOKENS)
        one_by_one = [complete(afd.attention.base_url, prompt, MAX_TOKENS).token_ids for prompt in PROMPTS]
        if "--data-parallel-size" in attention_args:
            # DP 2 runs two API servers, so vLLM's PROMETHEUS_MULTIPROC_DIR mode (docs/metrics.md): both
            # ranks' AFD metrics on the page, whichever API server answers.
            round_trips = [("afd_layer_round_trip_seconds_count", "attention", rank) for rank in "01"]
            moved = wait_for(lambda: all(scrape_ranks(afd.attention.base_url).get(key, 0) > 0 for key in round_trips))
            pages = [scrape_ranks(afd.attention.base_url) for _ in range(4)]
            assert moved, pages[-1]
            for page in pages:
                for rank in "01":
                    assert page[("afd_peer_up", "attention", rank)] == 1.0
                    assert page[("afd_rendezvous_seconds", "attention", rank)] > 0.0
        else:
            # Re-forming (docs/connection.md#re-forming) with A > F: the attention server (both ranks)
            # crashes; the same FFN process waits, and a restarted attention pairs with it and serves the
            # same tokens. No FFN restart.
            ffn_pid = afd.ffn.process.pid
            afd.attention.kill()
            assert wait_for(lambda: scrape(afd.ffn.base_url).get(("afd_peer_up", "ffn")) == 0.0), \
                scrape(afd.ffn.base_url)
            afd.attention.start()
            after_restart = [g.token_ids for g in complete_batch(afd.attention.base_url, PROMPTS, MAX_TOKENS)]
            assert afd.ffn.process.pid == ffn_pid and afd.ffn.process.poll() is None
            ffn_page = scrape(afd.ffn.base_url)
            assert (ffn_page[("afd_peer_up", "ffn")], ffn_page[("afd_reformations_total", "ffn")]) == (1.0, 1.0)
            log = afd.ffn.log_path.read_text()
            assert "AFD ffn rank 0: lost the attention (AFD peer lost:" in log, afd.ffn.log_tail()
            paired = re.search(r"AFD ffn rank 0: paired again with attention ranks \[0, 1\] after ([0-9.]+) s", log)
            assert paired, afd.ffn.log_tail()
            # The goal of docs/operations.md: serving again within 60 s of the restarted role being up.
            print(f"re-formation: attention restart to healthy {afd.attention.startup_s:.1f} s, FFN lost to paired "
                  f"{float(paired.group(1)):.1f} s")
            assert after_restart == expected
            frozen_ffn_mid_stream(afd, step_timeout_s=30.0, peer_timeout_s=5.0)  # the last check: it ends both

    assert [g.token_ids for g in batched] == expected
    assert one_by_one == expected
    if num_stages > 1:
        log = afd.attention.log_path.read_text()
        assert f"running steps as {num_stages} micro-batch stages" in log, afd.attention.log_tail()


def frozen_ffn_mid_stream(afd: AFDDeployment, *, step_timeout_s: float, peer_timeout_s: float) -> None:
    """The FFN server frozen mid-stream (SIGSTOP: alive, not heartbeating, its TCP connections open): every
    attention TP rank reports it within peer_timeout_s + 5 s and both ranks leave the step together (the step
    gate): the clients' streams end within step_timeout_s + 15 s (docs/failures.md#22-the-attention-tp-2-stall).
    NOTE: pairing again after the thaw is not asserted: it is not reliable yet (failures.md, same section)."""
    base_url, model = afd.attention.base_url, afd.model
    results: list = [None] * 2
    chunks = [0] * 2
    streams = [threading.Thread(target=stream_until_error, args=(base_url, str(model), results, chunks, i),
                                daemon=True)
               for i in range(2)]
    for thread in streams:
        thread.start()
    assert wait_for(lambda: min(chunks) > 0, timeout_s=60.0), (results, chunks)  # decoding now
    offset = len(afd.attention.log_path.read_text())
    frozen_at = time.monotonic()
    os.killpg(afd.ffn.process.pid, signal.SIGSTOP)
    try:
        def reported() -> bool:
            log = afd.attention.log_path.read_text()[offset:]
            return all(f"has not answered attention rank {rank}'s heartbeat" in log for rank in (0, 1))

        assert wait_for(reported, timeout_s=60.0), afd.attention.log_tail()
        reported_s = time.monotonic() - frozen_at
        for thread in streams:
            thread.join(step_timeout_s + 60.0)
        ended_s = max(result[1] for result in results) - frozen_at
    finally:
        os.killpg(afd.ffn.process.pid, signal.SIGCONT)
    print(f"frozen FFN: reported by both TP ranks after {reported_s:.1f} s, streams ended after {ended_s:.1f} s")

    assert reported_s < peer_timeout_s + 5.0
    assert all(result is not None and result[0] in ("error", "aborted", "cut") for result in results), results
    assert ended_s < step_timeout_s + 15.0


@pytest.fixture(scope="module")
def plain_outputs_qwen(plain_outputs):
    return plain_outputs("qwen3_moe", greedy_outputs)["batched"]


@pytest.fixture(scope="module")
def plain_tp2_qwen(tiny_model_dir, vllm_server_factory, record_timing):
    """PROMPTS' greedy tokens from plain vLLM with `--tensor-parallel-size 2` (a rank per core), stopped at once."""
    plain = vllm_server_factory(tiny_model_dir("qwen3_moe"), launcher="cli", omp_cpus="0|1",
                                extra_args=["--tensor-parallel-size", "2"])
    try:
        record_timing(f"plain vLLM qwen3_moe TP 2: startup {plain.startup_s:.1f} s")
        return [g.token_ids for g in complete_batch(plain.base_url, PROMPTS, MAX_TOKENS)]
    finally:
        plain.stop()


STREAM_TOKENS = 480  # as long as the deployment's 512-token context allows: decoding for seconds


def stream_until_error(base_url: str, model: str, results: list, chunks: list, index: int) -> None:
    """Stream a long completion, counting its chunks in `chunks[index]`; record (how it ended, when):
    "error" (an error event or a broken connection), "aborted" (vLLM's finish_reason "abort"), "cut"
    (the stream closed early with no finish reason: vLLM's fault path does that too, seen in CI) or
    "ended" (all STREAM_TOKENS)."""
    body = {"model": model, "prompt": PROMPTS[index % len(PROMPTS)], "max_tokens": STREAM_TOKENS,
            "ignore_eos": True, "stream": True, "temperature": 0}
    try:
        with requests.post(f"{base_url}/v1/completions", json=body, stream=True,
                           timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith(b"data: ") and b'"error"' in line:
                    results[index] = ("error", time.monotonic())
                    return
                if line.startswith(b"data: ") and b'"finish_reason":"abort"' in line:
                    results[index] = ("aborted", time.monotonic())
                    return
                if line.startswith(b"data: {"):
                    chunks[index] += 1
        results[index] = ("ended" if chunks[index] >= STREAM_TOKENS else "cut", time.monotonic())
    except requests.RequestException:
        results[index] = ("error", time.monotonic())


def metrics_advanced(before: dict, after: dict) -> bool:
    """Both roles' pages show steps (and per-layer samples) counted after `before` was scraped."""
    return all(after[role][("afd_steps_total", role)] > before[role][("afd_steps_total", role)]
               and after[role][(counted, role)] > before[role][(counted, role)]
               for role, counted in (("attention", "afd_layer_round_trip_seconds_count"),
                                     ("ffn", "afd_ffn_compute_seconds_count")))


@pytest.mark.parametrize("arch", ["qwen3_moe"], indirect=True)
def test_ffn_killed_mid_stream_then_restarted_under_the_same_attention(deployment, plain_outputs_qwen):
    """Healing (docs/connection.md#healing-attention): in-flight requests end at once, new ones get a
    503 naming the cause, and the same attention process serves plain vLLM's tokens again once a
    restarted FFN pairs with it."""
    # NOTE: the last test on the module's deployment of its model (file order): it kills the FFN,
    # and it ends the deployment rather than leave it idle (or broken) beside the next tests.
    afd, model = deployment, deployment.model
    try:
        base_url = afd.attention.base_url
        results: list = [None] * 3
        chunks = [0] * 3
        threads = [threading.Thread(target=stream_until_error,
                                    args=(base_url, str(model), results, chunks, i), daemon=True)
                   for i in range(3)]
        for thread in threads:
            thread.start()
        # NOTE: the kill follows progress, not a fixed sleep: on an idle CI machine the three streams
        # decode ~130 tokens/s and a fixed 3 s had let them end before the kill (CI 2026-12-02, -04).
        assert wait_for(lambda: min(chunks) > 0, timeout_s=60.0), (results, chunks)  # all decoding now
        # AFD metrics (docs/metrics.md), scraped from both API servers while the engines serve; the ranks'
        # watchers write every 0.5 s.
        urls = {"attention": base_url, "ffn": afd.ffn.base_url}
        first = {role: scrape(url) for role, url in urls.items()}
        second: dict = {}

        def advanced() -> bool:
            second.update({role: scrape(url) for role, url in urls.items()})
            return metrics_advanced(first, second)

        assert wait_for(advanced, timeout_s=30.0, interval_s=0.2), (first, second)

        attention_pid = afd.attention.process.pid
        killed_at = time.monotonic()
        afd.ffn.kill()  # a crash; the FFN's log stays
        at_kill = list(chunks)
        for thread in threads:
            thread.join(30)

        assert max(at_kill) < STREAM_TOKENS, f"the streams ended before the kill ({at_kill} chunks): not a test"
        # vLLM's fault tolerance ends the engine's requests as aborted (finish_reason "abort").
        assert all(result is not None and result[0] in ("error", "aborted", "cut") for result in results), results
        assert max(result[1] for result in results) - killed_at < 10.0
        log = afd.attention.log_path.read_text()
        assert "AFD peer lost" in log or "AFDPeerLostError" in log
        assert wait_for(lambda: scrape(base_url).get(("afd_peer_lost", "attention")) == 1.0), scrape(base_url)
        # Requests during the outage: HTTP 503 naming the cause and what happens next, not a generic
        # engine error (docs/failures.md#requests-during-an-outage).
        refused = requests.post(f"{base_url}/v1/completions", timeout=30,
                                json={"model": str(model), "prompt": PROMPTS[0], "max_tokens": 4})
        assert refused.status_code == 503, refused.text
        message = refused.json()["error"]["message"]
        assert message.startswith("AFD attention server unavailable: its FFN peer was lost (AFD peer lost"), message
        assert "re-forming: this server serves again once the FFN is back and paired" in message

        afd.ffn.start()  # the FFN's supervisor restarts it; nobody touches the attention
        ffn_up = time.monotonic()
        assert wait_for(lambda: requests.post(
            f"{base_url}/v1/completions", timeout=30,
            json={"model": str(model), "prompt": PROMPTS[0], "max_tokens": 1}).status_code == 200, timeout_s=60.0), \
            afd.attention.log_tail()
        serving_again_s = time.monotonic() - ffn_up
        after_heal = [g.token_ids for g in complete_batch(base_url, PROMPTS, MAX_TOKENS)]

        assert afd.attention.process.pid == attention_pid and afd.attention.process.poll() is None
        assert after_heal == plain_outputs_qwen
        log = afd.attention.log_path.read_text()
        paired = re.search(r"AFD attention rank 0: paired again with FFN ranks \[0\] after ([0-9.]+) s", log)
        assert paired, afd.attention.log_tail()
        page = scrape(base_url)
        assert (page[("afd_peer_up", "attention")], page[("afd_peer_lost", "attention")]) == (1.0, 0.0)
        # The goal of docs/operations.md: serving again within 60 s of the restarted role being up.
        print(f"healing: FFN restart to healthy {afd.ffn.startup_s:.1f} s, then serving again after "
              f"{serving_again_s:.1f} s; attention lost to paired {float(paired.group(1)):.1f} s")
    finally:
        afd.stop()

    for role in urls:
        after = second[role]
        assert {key[1] for key in after if key != "vllm_metrics"} == {role} and after["vllm_metrics"] == 1.0
        assert first[role][("afd_steps_total", role)] > 0
        assert (after[("afd_peer_up", role)], after[("afd_peer_lost", role)]) == (1.0, 0.0)
        assert after[("afd_rendezvous_seconds", role)] > 0.0
    assert 0.0 < second["attention"][("afd_exposed_transport_share", "attention")] <= 1.0
