"""AFD metrics on both roles' /metrics (docs/metrics.md): real `vllm serve` roles on CPU, scraped while serving.

The AFD runners live in each server's engine-core process; /metrics is served by its API server
process, so every value checked here crossed a process boundary.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from afd_harness.afd import DEFAULT_CONNECTOR, AFDDeployment
from afd_harness.server import complete, complete_batch

pytestmark = pytest.mark.e2e

PROMPTS = ["Hello, my name is", "The capital of France is", "1 2 3 4 5"]
MAX_TOKENS = 8


def scrape_ranks(base_url: str) -> dict[tuple[str, str, str], float]:
    """AFD samples of one /metrics page: (sample name, role, role_rank) -> value; each series once."""
    page = requests.get(f"{base_url}/metrics", timeout=30)
    page.raise_for_status()
    values: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(page.text):
        for sample in family.samples:
            if sample.name.startswith("afd_") and "le" not in sample.labels:
                assert sample.labels["connector"] == DEFAULT_CONNECTOR, sample
                key = (sample.name, sample.labels["role"], sample.labels["role_rank"])
                assert key not in values, f"{key} twice on {base_url}/metrics"
                values[key] = sample.value
    values["vllm_metrics", "", ""] = float("vllm:num_requests_running" in page.text)
    return values


def scrape(base_url: str) -> dict[tuple[str, str], float]:
    """As scrape_ranks for a page of rank 0 only: (sample name, role) -> value."""
    values = scrape_ranks(base_url)
    assert {rank for _, _, rank in values} <= {"", "0"}, sorted(values)
    return {(name, role) if role else name: value for (name, role, _), value in values.items()}


def wait_for(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return predicate()


def test_afd_metrics_move_on_both_roles_while_serving_and_show_a_lost_peer(tiny_model_dir, vllm_python,
                                                                           tmp_path):
    from afd_harness.tiny_models import serve_env

    model = tiny_model_dir("qwen3_moe")
    with AFDDeployment(model, python=vllm_python, log_dir=tmp_path, env=serve_env(model)) as afd:
        attention_url, ffn_url = afd.attention.base_url, afd.ffn.base_url
        # Each rank's watcher writes its peer state every 0.5 s: up once both servers are healthy.
        assert wait_for(lambda: scrape(ffn_url).get(("afd_peer_up", "ffn")) == 1.0)
        before = {"attention": scrape(attention_url), "ffn": scrape(ffn_url)}

        complete_batch(attention_url, PROMPTS, MAX_TOKENS)
        complete(attention_url, PROMPTS[0], MAX_TOKENS, stream=True)
        # The watcher writes what the steps queued every 0.5 s.
        steps = ("afd_steps_total", "attention")
        wait_for(lambda: scrape(attention_url)[steps] >= before["attention"][steps] + 2 * MAX_TOKENS)
        time.sleep(1.0)  # and the FFN's watcher its last steps
        after = {"attention": scrape(attention_url), "ffn": scrape(ffn_url)}
        for role, url in (("attention", attention_url), ("ffn", ffn_url)):  # kept for a look
            page = requests.get(f"{url}/metrics", timeout=30).text
            (tmp_path / f"metrics-{role}.txt").write_text("".join(
                line + "\n" for line in page.splitlines() if line.startswith(("afd_", "# HELP afd_"))))

        afd.ffn.stop()
        lost = wait_for(lambda: scrape(attention_url).get(("afd_peer_lost", "attention")) == 1.0)
        last = scrape(attention_url)

    a0, a1, f0, f1 = before["attention"], after["attention"], before["ffn"], after["ffn"]
    # Each page holds its own role only, next to vLLM's own metrics.
    assert {key[1] for key in a1 if key != "vllm_metrics"} == {"attention"} and a1["vllm_metrics"] == 1.0
    assert {key[1] for key in f1 if key != "vllm_metrics"} == {"ffn"}
    # Steps, per-layer round trips (attention) and FFN computes (FFN) move with the traffic.
    assert a1[("afd_steps_total", "attention")] >= a0[("afd_steps_total", "attention")] + MAX_TOKENS
    assert f1[("afd_steps_total", "ffn")] >= f0[("afd_steps_total", "ffn")] + MAX_TOKENS
    round_trips = ("afd_layer_round_trip_seconds_count", "attention")
    computes = ("afd_ffn_compute_seconds_count", "ffn")
    assert a1[round_trips] >= a0[round_trips] + MAX_TOKENS
    assert f1[computes] >= f0[computes] + MAX_TOKENS
    assert a1[("afd_layer_round_trip_seconds_sum", "attention")] > a0[("afd_layer_round_trip_seconds_sum", "attention")]
    assert 0.0 < a1[("afd_exposed_transport_share", "attention")] <= 1.0
    assert a1[("afd_exposed_transport_seconds_total", "attention")] <= a1[("afd_layer_loop_seconds_total", "attention")]
    # Peer up with a measured rendezvous on both roles; the attention sees the FFN go.
    for values, role in ((a1, "attention"), (f1, "ffn")):
        assert (values[("afd_peer_up", role)], values[("afd_peer_lost", role)]) == (1.0, 0.0)
        assert values[("afd_rendezvous_seconds", role)] > 0.0
    assert lost, f"attention never reported the lost FFN: {last}"
    assert last[("afd_peer_up", "attention")] == 0.0
    assert last[round_trips] >= a1[round_trips]  # counters survive the engine's death


def test_two_attention_dp_ranks_show_on_vllms_multiprocess_metrics_page(tiny_model_dir, vllm_python, tmp_path):
    """DP 2: two engine cores and two API servers, so vLLM's PROMETHEUS_MULTIPROC_DIR mode."""
    model = tiny_model_dir("qwen3_moe")
    afd = AFDDeployment(model, python=vllm_python, log_dir=tmp_path, afd_fields={"num_attention_ranks": 2},
                        attention_args=["--data-parallel-size", "2"], attention_cpus="1|1")
    with afd:
        url = afd.attention.base_url
        with ThreadPoolExecutor(6) as pool:  # concurrent requests: vLLM's DP balancer feeds both ranks
            list(pool.map(lambda i: complete(url, PROMPTS[i % len(PROMPTS)], MAX_TOKENS), range(12)))
        round_trips = [("afd_layer_round_trip_seconds_count", "attention", rank) for rank in "01"]
        moved = wait_for(lambda: all(scrape_ranks(url).get(key, 0) > 0 for key in round_trips))
        pages = [scrape_ranks(url) for _ in range(4)]  # either API server may answer

    assert moved, pages[-1]
    for page in pages:
        for rank in "01":
            assert page[("afd_peer_up", "attention", rank)] == 1.0
            assert page[("afd_rendezvous_seconds", "attention", rank)] > 0.0
            assert page[("afd_layer_round_trip_seconds_count", "attention", rank)] > 0
