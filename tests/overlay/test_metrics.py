"""AFD metrics (metrics.py, docs/metrics.md): records to samples, step counting, peer state, collection."""

from __future__ import annotations

import bisect
import logging
import multiprocessing
import os
from types import SimpleNamespace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.utils import floatToGoString

from vllm_afd import metrics as afd_metrics
from vllm_afd.metrics import (
    BUCKETS_S,
    METRICS_DIR_ENV,
    AFDMetrics,
    expose_worker_metrics,
    exposed_transport_ns,
    make_rank_metrics,
    round_trip_intervals,
)
from vllm_afd.wire.messages import ControlPayload
from vllm_afd.wire.timeline import Mark, StepRecord

CONNECTOR = "P2pGlooAFDConnector"


def record(role: str, spans_ns: list[int], gap_ns: int = 5, *, warmup=False, profile=False) -> StepRecord:
    """One single-stage step whose exchanges take ``spans_ns`` (round trips or FFN computes), in turn."""
    marks, t = [], 1_000
    for exchange, span in enumerate(spans_ns):
        if role == "attention":
            kinds_at = [("a2f_send_start", t), ("a2f_send_end", t + 1), ("f2a_recv_end", t + span)]
        else:
            kinds_at = [("a2f_recv_start", t), ("a2f_recv_end", t + 1), ("f2a_send_start", t + 1 + span),
                        ("f2a_send_end", t + 2 + span)]
        marks += [Mark(kind, exchange, 0, at) for kind, at in kinds_at]
        t = marks[-1].t_ns + gap_ns
    return StepRecord(role=role, role_rank=0, step_seq=0, graph_replay=False, warmup=warmup, profile=profile,
                      rows=1, opened_ns=0, closed_ns=t, clock="host", marks=tuple(marks), host_syncs=0)


def samples(directory) -> dict[tuple[str, frozenset], float]:
    """What /metrics would show for the files in ``directory``: (sample, labels) -> value."""
    families = MultiProcessCollector(None, path=str(directory)).collect()
    return {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}


def labels(role: str = "attention", rank: int = 0, **extra: str) -> frozenset:
    return frozenset({"role": role, "role_rank": str(rank), "connector": CONNECTOR, **extra}.items())


class FakeConnector:
    """The connector surface the metrics read: steps.payload and .stages, is_initialized, failure, reforming,
    rendezvous_s, reformations."""

    def __init__(self) -> None:
        self.steps = SimpleNamespace(payload=None, stages={})
        self.is_initialized = False
        self.failure: BaseException | None = None
        self.reforming = False
        self.rendezvous_s: float | None = None
        self.reformations = 0


spans = st.lists(st.integers(0, 2_000_000_000), min_size=1, max_size=8)


@settings(max_examples=30, deadline=None)
@given(role=st.sampled_from(["attention", "ffn"]), steps=st.lists(spans, min_size=1, max_size=4))
@example(role="attention", steps=[[10_000, 10_001, 1_000_000_000, 1_000_000_001]])  # on and past bounds
def test_records_become_histogram_buckets_count_and_sum(tmp_path_factory, role, steps):
    directory = tmp_path_factory.mktemp("m")
    metrics = AFDMetrics(str(directory), role, 0, CONNECTOR)

    metrics.observe_steps([record(role, s) for s in steps])
    metrics.flush()
    got = samples(directory)

    name = "afd_layer_round_trip_seconds" if role == "attention" else "afd_ffn_compute_seconds"
    values_ns = sorted(v for s in steps for v in s)
    for bound in BUCKETS_S:
        expected = bisect.bisect_right(values_ns, round(bound * 1e9))  # cumulative: values <= bound
        assert got[(f"{name}_bucket", labels(role, le=floatToGoString(bound)))] == expected
    assert got[(f"{name}_bucket", labels(role, le="+Inf"))] == len(values_ns)
    assert got[(f"{name}_count", labels(role))] == len(values_ns)
    assert got[(f"{name}_sum", labels(role))] == pytest.approx(sum(values_ns) / 1e9)


def test_warmup_and_profile_records_are_not_observed(tmp_path):
    metrics = AFDMetrics(str(tmp_path), "attention", 0, CONNECTOR)

    metrics.observe_steps([record("attention", [1000], warmup=True), record("attention", [1000], profile=True)])
    metrics.flush()

    assert samples(tmp_path)[("afd_layer_round_trip_seconds_count", labels())] == 0


def test_steps_count_each_new_executed_payload_once(tmp_path):
    connector = FakeConnector()
    metrics = AFDMetrics(str(tmp_path), "ffn", 1, CONNECTOR)
    metrics.watch(connector, thread=False)
    served = [ControlPayload({0: (1,)}), ControlPayload({0: (2,)}, is_graph_replaying=True)]
    skipped = [ControlPayload({0: (1,)}, is_warmup=True), ControlPayload({0: (1,)}, is_profile=True),
               ControlPayload({0: (1,)}, is_graph_capturing=True)]

    for payload in [skipped[0], served[0], served[0], skipped[1], served[1], skipped[2], None]:
        connector.steps.payload = payload
        metrics.observe_steps([])
    metrics.flush()

    assert samples(tmp_path)[("afd_steps_total", labels("ffn", 1))] == 2


def test_rows_add_up_every_stage_of_the_counted_steps_per_rank(tmp_path):
    """An FFN pool's load per FFN rank: rows received per counted step (idle attention ranks send 1 row)."""
    connectors = {rank: FakeConnector() for rank in (0, 1)}
    ranks = {rank: AFDMetrics(str(tmp_path), "ffn", rank, CONNECTOR) for rank in (0, 1)}
    # (payload, {FFN rank: rows per stage}): FFN 0 serves attention ranks 0-1, FFN 1 ranks 2-3.
    steps = [(ControlPayload({0: (3, 1, 2, 0)}), {0: (4,), 1: (3,)}),
             (ControlPayload({0: (9, 9, 9, 9)}, is_warmup=True), {0: (18,), 1: (18,)}),
             (ControlPayload({0: (2, 0, 0, 0), 1: (5, 0, 0, 0)}), {0: (3, 6), 1: (2, 2)})]

    for payload, own_rows in steps:
        for rank, connector in connectors.items():
            ranks[rank].watch(connector, thread=False)
            stages = {stage: SimpleNamespace(own_rows=n) for stage, n in enumerate(own_rows[rank])}
            connector.steps = SimpleNamespace(payload=payload, stages=stages)
            ranks[rank].observe_steps([])
    for metrics in ranks.values():
        metrics.flush()

    got = samples(tmp_path)
    assert [got[("afd_rows_total", labels("ffn", rank))] for rank in (0, 1)] == [4 + 3 + 6, 3 + 2 + 2]


def brute_force_busy(intervals: list[tuple[int, int]]) -> int:
    return len({t for start, end in intervals for t in range(start, end)})


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 30)), min_size=1, max_size=6))
def test_exposed_transport_is_the_union_of_round_trips_within_the_layer_loop(starts_and_lengths):
    # Exchanges of two stages may overlap: each is (send start, round trip) on the attention's clock.
    marks = []
    for position, (start, length) in enumerate(starts_and_lengths):
        exchange, stage = divmod(position, 2)
        marks += [Mark("a2f_send_start", exchange, stage, start), Mark("f2a_recv_end", exchange, stage, start + length)]
    step = StepRecord(role="attention", role_rank=0, step_seq=0, graph_replay=False, warmup=False, profile=False,
                      rows=1, opened_ns=0, closed_ns=0, clock="host", marks=tuple(marks), host_syncs=0)
    intervals = [(s, s + n) for s, n in starts_and_lengths]

    busy, span = exposed_transport_ns(round_trip_intervals(step))

    assert busy == brute_force_busy(intervals)
    assert span == max(e for _, e in intervals) - min(s for s, _ in intervals)
    assert 0 <= busy <= span
    assert sorted(e - s for s, e in round_trip_intervals(step)) == sorted(step.round_trips_ns())


def test_attention_share_is_round_trips_over_layer_loop(tmp_path):
    metrics = AFDMetrics(str(tmp_path), "attention", 0, CONNECTOR)

    metrics.observe_steps([record("attention", [300, 300], gap_ns=400)])  # 600 busy of 1000
    metrics.flush()
    got = samples(tmp_path)

    assert got[("afd_exposed_transport_share", labels())] == pytest.approx(0.6)
    assert got[("afd_exposed_transport_seconds_total", labels())] == pytest.approx(600e-9)
    assert got[("afd_layer_loop_seconds_total", labels())] == pytest.approx(1000e-9)


def test_peer_state_and_rendezvous_follow_the_connector_and_end_down(tmp_path):
    connector = FakeConnector()
    metrics = AFDMetrics(str(tmp_path), "ffn", 0, CONNECTOR)
    metrics.watch(connector, thread=False)
    state = []

    for change in ({}, {"is_initialized": True, "rendezvous_s": 1.5}, {"is_initialized": False, "failure": OSError()},
                   {"failure": None, "reforming": True},
                   {"is_initialized": True, "reforming": False, "rendezvous_s": 7.0, "reformations": 1}):
        vars(connector).update(change)
        metrics.flush()
        got = samples(tmp_path)
        state.append((got[("afd_peer_up", labels("ffn"))], got[("afd_peer_lost", labels("ffn"))],
                      got.get(("afd_rendezvous_seconds", labels("ffn"))),
                      got.get(("afd_reformations_total", labels("ffn")))))
    connector.is_initialized = False  # the runner closes its connector before its metrics
    metrics.close()

    # A re-formation (docs/connection.md#re-forming) keeps the peer lost while it waits (its fresh failure latch
    # holds nothing yet), then brings it back up with a new rendezvous time.
    assert state == [(0, 0, None, None), (1, 0, 1.5, None), (0, 1, 1.5, None), (0, 1, 1.5, None), (1, 0, 7.0, 1)]
    assert samples(tmp_path)[("afd_peer_up", labels("ffn"))] == 0


def test_watcher_thread_reports_peer_up_and_close_stops_it(tmp_path, monkeypatch):
    monkeypatch.setattr(afd_metrics, "WATCH_INTERVAL_S", 0.01)
    connector = FakeConnector()
    connector.is_initialized, connector.rendezvous_s = True, 0.25
    metrics = AFDMetrics(str(tmp_path), "ffn", 0, CONNECTOR)

    metrics.watch(connector)
    for _ in range(500):
        if samples(tmp_path)[("afd_peer_up", labels("ffn"))] == 1:
            break
        metrics._stop.wait(0.01)  # noqa: SLF001
    up = samples(tmp_path)[("afd_peer_up", labels("ffn"))]
    connector.is_initialized = False
    metrics.close()

    assert up == 1
    assert samples(tmp_path)[("afd_rendezvous_seconds", labels("ffn"))] == 0.25
    assert samples(tmp_path)[("afd_peer_up", labels("ffn"))] == 0
    assert metrics._thread is None  # noqa: SLF001


def test_a_metrics_error_is_logged_once_and_never_raised(tmp_path, caplog):
    metrics = AFDMetrics(str(tmp_path), "attention", 0, CONNECTOR)
    metrics.watch(SimpleNamespace(steps=None), thread=False)  # reading .payload raises

    with caplog.at_level(logging.ERROR, logger="vllm_afd.metrics"):
        for _ in range(3):
            metrics.observe_steps([record("attention", [1000])])
            metrics.flush()

    assert len([r for r in caplog.records if "metrics" in r.getMessage()]) == 1
    assert samples(tmp_path)[("afd_layer_round_trip_seconds_count", labels())] == 0


def test_ranks_of_one_role_stay_apart_on_one_page(tmp_path):
    ranks = [AFDMetrics(str(tmp_path), "attention", rank, CONNECTOR) for rank in (0, 1)]

    ranks[1].observe_steps([record("attention", [1000, 2000])])
    ranks[1].flush()
    got = samples(tmp_path)

    assert got[("afd_layer_round_trip_seconds_count", labels(rank=0))] == 0
    assert got[("afd_layer_round_trip_seconds_count", labels(rank=1))] == 2


def _write_in_child(directory: str) -> None:
    metrics = AFDMetrics(directory, "ffn", 0, CONNECTOR)
    metrics.observe_steps([record("ffn", [5_000_000])])
    metrics.close()


def test_values_written_by_another_process_reach_this_processes_registry(tmp_path, monkeypatch):
    """The /metrics path without PROMETHEUS_MULTIPROC_DIR: the root exposes its dir, a child writes."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.setenv(METRICS_DIR_ENV, "/nonexistent/inherited")  # from a test process: replaced
    monkeypatch.setattr(afd_metrics, "_exposed_dir", None)
    registry = CollectorRegistry()

    expose_worker_metrics(registry)
    child = multiprocessing.get_context("fork").Process(target=_write_in_child, args=(os.environ[METRICS_DIR_ENV],))
    child.start()
    child.join(60)
    page = generate_latest(registry).decode()

    assert child.exitcode == 0
    assert os.environ[METRICS_DIR_ENV] != "/nonexistent/inherited"
    assert 'afd_ffn_compute_seconds_count{connector="P2pGlooAFDConnector",role="ffn",role_rank="0"} 1.0' in page
    assert 'afd_peer_up{connector="P2pGlooAFDConnector",role="ffn",role_rank="0"} 0.0' in page


def test_vllm_multiprocess_mode_needs_no_collector_and_workers_write_there(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.delenv(METRICS_DIR_ENV, raising=False)
    monkeypatch.setattr(afd_metrics, "_exposed_dir", None)
    registry = CollectorRegistry()

    expose_worker_metrics(registry)
    metrics = make_rank_metrics("attention", 0, CONNECTOR, FakeConnector())
    metrics.close()

    assert METRICS_DIR_ENV not in os.environ and list(registry.collect()) == []
    assert ("afd_steps_total", labels()) in samples(tmp_path)


def test_without_a_directory_metrics_are_off(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv(METRICS_DIR_ENV, raising=False)

    assert make_rank_metrics("ffn", 0, CONNECTOR, FakeConnector()) is None


def _expose_in_child(queue) -> None:
    before = os.environ.get(METRICS_DIR_ENV)
    expose_worker_metrics(CollectorRegistry())
    queue.put(os.environ.get(METRICS_DIR_ENV) != before)


@pytest.mark.parametrize("inherited, acts", [("/tmp/the-servers-dir", False), (None, True)],
                         ids=["engine-core-keeps-its-servers-dir", "dp-supervisor-child-makes-its-own"])
def test_a_multiprocessing_child_makes_a_directory_only_without_one(monkeypatch, inherited, acts):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    if inherited is None:
        monkeypatch.delenv(METRICS_DIR_ENV, raising=False)
    else:
        monkeypatch.setenv(METRICS_DIR_ENV, inherited)
    monkeypatch.setattr(afd_metrics, "_exposed_dir", None)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()

    child = context.Process(target=_expose_in_child, args=(queue,))
    child.start()
    changed = queue.get(timeout=60)
    child.join(60)

    assert changed is acts
