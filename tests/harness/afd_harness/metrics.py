"""Scraping the AFD samples of a server's /metrics page (docs/metrics.md), for the e2e tests."""

from __future__ import annotations

import time
from collections.abc import Callable

import requests


def scrape_ranks(base_url: str, connector: str | None = None) -> dict[tuple[str, str, str], float]:
    """AFD samples of one /metrics page: (sample name, role, role_rank) -> value; each series once.

    ``("vllm_metrics", "", "")`` is 1.0 when vLLM's own metrics are on the same page.
    """
    from prometheus_client.parser import text_string_to_metric_families

    page = requests.get(f"{base_url}/metrics", timeout=30)
    page.raise_for_status()
    values: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(page.text):
        for sample in family.samples:
            if sample.name.startswith("afd_") and "le" not in sample.labels:
                assert connector is None or sample.labels["connector"] == connector, sample
                key = (sample.name, sample.labels["role"], sample.labels["role_rank"])
                assert key not in values, f"{key} twice on {base_url}/metrics"
                values[key] = sample.value
    values["vllm_metrics", "", ""] = float("vllm:num_requests_running" in page.text)
    return values


def scrape(base_url: str, connector: str | None = None) -> dict[tuple[str, str] | str, float]:
    """As scrape_ranks for a page of rank 0 only: (sample name, role) -> value."""
    values = scrape_ranks(base_url, connector)
    assert {rank for _, _, rank in values} <= {"", "0"}, sorted(values)
    return {(name, role) if role else name: value for (name, role, _), value in values.items()}


def wait_for(predicate: Callable[[], bool], timeout_s: float = 30.0, interval_s: float = 0.5) -> bool:
    """Poll ``predicate`` every ``interval_s`` until it holds or ``timeout_s`` passed; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
