"""AFD metrics on each role's /metrics (docs/metrics.md): written by the worker, served by the front end.

AFD runs in vLLM's worker processes; ``/metrics`` is served by the API server process. The worker
writes its samples in prometheus_client's multiprocess file format (``MmapedDict`` files, one per
metric type and writer) and prometheus_client's own ``MultiProcessCollector`` reads them in the
API server:

* vLLM's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set: ``--api-server-count`` > 1, or by the
  user): the files go into that directory, which vLLM's /metrics registry already collects;
* otherwise the root process of ``vllm serve`` (from the config hook, before it starts the engine
  core) makes a private directory, names it in ``VLLM_AFD_METRICS_DIR`` for its children, and adds a
  ``MultiProcessCollector`` for it to the default registry, which its /metrics serves.

The step path only counts the step and queues its timeline records; a daemon thread per rank
writes them and the connector's peer state every WATCH_INTERVAL_S. A metrics error is logged once
and stops this rank's metrics; it never reaches a step.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import multiprocessing
import os
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.utils import floatToGoString

from vllm_afd.wire.timeline import A2F_SEND_START, F2A_RECV_END, StepRecord
from vllm_afd.role import Role

__all__ = [
    "BUCKETS_S",
    "METRICS_DIR_ENV",
    "WATCHER_THREAD",
    "AFDMetrics",
    "expose_worker_metrics",
    "exposed_transport_ns",
    "round_trip_intervals",
    "make_rank_metrics",
    "metrics_dir",
]

logger = logging.getLogger(__name__)

# The private directory of one `vllm serve`, set by its root process for the processes it starts.
METRICS_DIR_ENV = "VLLM_AFD_METRICS_DIR"
# vLLM's (and prometheus_client's) multiprocess directory; when set, /metrics collects only it.
PROMETHEUS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Histogram upper bounds (s): 10 us .. 1 s, 1-2.5-5 per decade (+Inf is added).
BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
             0.1, 0.25, 0.5, 1.0)
# Steps the exposed-transport share gauge averages over (the counters hold the whole run).
SHARE_WINDOW_STEPS = 64
# How often the watcher writes the queued records and reads the connector's state.
WATCH_INTERVAL_S = 0.5
WATCHER_THREAD = "afd-metrics"  # the name of every rank's watcher thread (the tests check none outlives them)
# Records queued for the watcher at most (the oldest are dropped: the watcher stopped).
MAX_PENDING_RECORDS = 4096
LABEL_NAMES = ("role", "role_rank", "connector")

HELP = {
    "afd_steps": "AFD steps this rank executed (warm-up, profile and capture steps excluded).",
    "afd_rows": "Rows this rank sent (attention) or received (FFN) in the steps afd_steps counts, all stages.",
    "afd_layer_round_trip_seconds": "Attention: per layer and stage, send start to FFN output received.",
    "afd_ffn_compute_seconds": "FFN: per layer and stage, all rows received to the first byte sent back.",
    "afd_exposed_transport_seconds": "Attention: time with an exchange in flight, within the layer loop.",
    "afd_layer_loop_seconds": "Attention: first layer's send to the last layer's output received.",
    "afd_exposed_transport_share": "Attention: exposed transport over layer-loop time, last steps.",
    "afd_peer_up": "1 while the connector is connected and has no failure, else 0.",
    "afd_peer_lost": ("1 while the connector holds a failure (lost peer, timeout, transport error), "
                      "until it pairs again."),
    "afd_rendezvous_seconds": "Rendezvous, handshake and channel set-up of this rank's latest pairing.",
    "afd_reformations": "Times this rank paired again after losing its peers (FFN, reform_timeout_s).",
}

_exposed_dir: tempfile.TemporaryDirectory | None = None
_writer_ids = itertools.count()


def metrics_dir() -> str | None:
    """Where this process writes its AFD metrics: vLLM's multiprocess directory, else AFD's own."""
    return os.environ.get(PROMETHEUS_DIR_ENV) or os.environ.get(METRICS_DIR_ENV) or None


def expose_worker_metrics(registry: CollectorRegistry = REGISTRY) -> None:
    """Front end: make the worker processes' AFD metrics reach this process's /metrics; idempotent.

    Runs in the config hook of every process that builds a VllmConfig. It acts in a process not
    started by multiprocessing (the root of a `vllm serve`), always replacing an inherited
    ``VLLM_AFD_METRICS_DIR`` (another server's or a test process's), and in one that multiprocessing
    started without the variable (vLLM's DP supervisor starts its API servers so); a process that
    inherited it from its server (engine core, workers) keeps it. ``registry`` is the one vLLM's
    /metrics serves without ``PROMETHEUS_MULTIPROC_DIR``: the default one.
    """
    global _exposed_dir
    if _exposed_dir is not None or os.environ.get(PROMETHEUS_DIR_ENV):
        return  # done, or vLLM's /metrics already collects the multiprocess directory
    if os.environ.get(METRICS_DIR_ENV) and multiprocessing.parent_process() is not None:
        return  # started by its server's processes: it writes to their directory
    try:
        exposed = tempfile.TemporaryDirectory(prefix="vllm-afd-metrics-")
        MultiProcessCollector(registry, path=exposed.name)
    except (OSError, ValueError) as exc:
        logger.warning("AFD metrics: cannot make a metrics directory (%s); AFD metrics are off", exc)
        return
    _exposed_dir = exposed
    os.environ[METRICS_DIR_ENV] = exposed.name


def make_rank_metrics(role: Role, role_rank: int, connector_name: str, connector: Any) -> AFDMetrics | None:
    """One rank's metrics, watching ``connector``; None (logged) where no directory is set."""
    directory = metrics_dir()
    if directory is None:
        logger.info("AFD metrics: neither %s nor %s is set in this process; metrics are off",
                    PROMETHEUS_DIR_ENV, METRICS_DIR_ENV)
        return None
    metrics = AFDMetrics(directory, role, role_rank, connector_name)
    metrics.watch(connector)
    return metrics


def round_trip_intervals(record: StepRecord) -> list[tuple[int, int]]:
    """Attention record: (send start, output received) of every exchange, in ns, sorted."""
    starts = {}
    intervals = []
    for m in record.marks:
        if m.kind == A2F_SEND_START:
            starts[(m.exchange, m.stage)] = m.t_ns
        elif m.kind == F2A_RECV_END and (m.exchange, m.stage) in starts:
            intervals.append((starts[(m.exchange, m.stage)], m.t_ns))
    intervals.sort()
    return intervals


def exposed_transport_ns(intervals: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """(time with at least one exchange in flight, layer-loop span) in ns, from sorted intervals.

    An exchange is in flight from its send start to its output received; the layer loop runs from
    the step's first send start to its last output received.
    """
    if not intervals:
        return 0, 0
    busy, (cur_start, cur_end) = 0, intervals[0]
    last_end = cur_end
    for start, end in intervals[1:]:
        last_end = max(last_end, end)
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    return busy, last_end - intervals[0][0]


class _Files:
    """This writer's three multiprocess files (counter, histogram, most-recent gauge) in one directory.

    File names end in a writer id unique on the host (``afd-<role>-<rank>-<pid>-<n>``), so they never
    collide with prometheus_client's own ``<type>_<pid>.db`` files of the same process.
    """

    def __init__(self, directory: str, ident: str) -> None:
        self._dicts = {
            "counter": MmapedDict(os.path.join(directory, f"counter_{ident}.db")),
            "histogram": MmapedDict(os.path.join(directory, f"histogram_{ident}.db")),
            "gauge": MmapedDict(os.path.join(directory, f"gauge_mostrecent_{ident}.db")),
        }

    def write(self, typ: str, key: str, value: float, timestamp: float = 0.0) -> None:
        self._dicts[typ].write_value(key, value, timestamp)

    def close(self) -> None:
        for mmaped in self._dicts.values():
            mmaped.close()


class _Histogram:
    """Per-bucket counts and a sum, as prometheus_client's multiprocess histogram stores them."""

    def __init__(self, name: str, labels: dict[str, str]) -> None:
        bucket_names = [*labels, "le"]
        bounds = [*BUCKETS_S, float("inf")]
        self.bounds_ns = [round(b * 1e9) for b in BUCKETS_S]
        self.counts = [0] * len(bounds)
        self.sum_ns = 0
        self.bucket_keys = [mmap_key(name, f"{name}_bucket", bucket_names,
                                     [*labels.values(), floatToGoString(b)], HELP[name]) for b in bounds]
        self.sum_key = mmap_key(name, f"{name}_sum", list(labels), list(labels.values()), HELP[name])

    def observe_ns(self, values_ns: Iterable[int], touched: set[int]) -> None:
        """Add the values (ns); adds the indices of the buckets they fell in to ``touched``."""
        for value_ns in values_ns:
            index = bisect.bisect_left(self.bounds_ns, value_ns)  # first bound >= value (le)
            self.counts[index] += 1
            self.sum_ns += value_ns
            touched.add(index)


class AFDMetrics:
    """One rank's AFD metrics, written to its multiprocess files; see the module docstring.

    The step path (``observe_steps``) only counts the step and queues its records; the watcher
    thread (``flush``, every WATCH_INTERVAL_S) turns them into samples, reads the connector's peer
    state and writes the files, so the step never waits for the metrics' lock or an mmap write.
    """

    def __init__(self, directory: str, role: Role, role_rank: int, connector_name: str) -> None:
        self.role = Role(role)
        self.labels = dict(zip(LABEL_NAMES, (self.role.value, str(role_rank), connector_name)))
        self.steps = 0
        self.rows = 0
        self.exposed_ns = 0
        self.loop_ns = 0
        self._steps_written = -1
        self._pending: deque[StepRecord] = deque(maxlen=MAX_PENDING_RECORDS)
        self._window: deque[tuple[int, int]] = deque(maxlen=SHARE_WINDOW_STEPS)  # (busy, span) ns
        self._window_busy = self._window_span = 0
        self._peer: tuple[bool, bool] | None = None
        self._rendezvous_written: float | None = None
        self._reformations_written = 0
        self._last_payload: Any = None
        self._broken = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._connector: Any = None
        self._keys: dict[str, str] = {}
        name = "afd_layer_round_trip_seconds" if self.role is Role.ATTENTION else "afd_ffn_compute_seconds"
        self.histogram = _Histogram(name, self.labels)
        ident = f"afd-{role}-{role_rank}-{os.getpid()}-{next(_writer_ids)}"
        self._files = _Files(directory, ident)
        with self._lock:
            self._write_steps()
            self._write_histogram(range(len(self.histogram.counts)))
            if self.role is Role.ATTENTION:
                self._write_share()
            self._set_peer_state(False, False)

    # ---- what the runners report ---------------------------------------------------------------
    def observe_steps(self, records: Sequence[StepRecord]) -> None:
        """After each executed step (step path): count it and queue the records completed so far."""
        if self._broken:
            return
        try:
            self._count_step()
            self._pending.extend(records)
        except Exception:  # noqa: BLE001 - metrics never break serving
            self._fail()

    def flush(self) -> None:
        """Write what was observed since the last flush and the connector's state (watcher, close)."""
        self._guarded(self._flush)

    def watch(self, connector: Any, *, thread: bool = True) -> None:
        """Count ``connector``'s steps, follow its peer state and rendezvous; start the watcher thread
        (tests without it call ``flush``)."""
        self._connector = connector
        if thread:
            self._thread = threading.Thread(target=self._watch, name=WATCHER_THREAD, daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the watcher, write the last records and peer state; the files stay for the front end."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(2 * WATCH_INTERVAL_S)
        self.flush()
        with self._lock:
            self._broken = True
            self._files.close()

    # ---- internals --------------------------------------------------------------------------------
    def _guarded(self, fn: Any) -> None:
        if self._broken:
            return
        try:
            with self._lock:
                if not self._broken:
                    fn()
        except Exception:  # noqa: BLE001 - metrics never break serving
            self._fail()

    def _fail(self) -> None:
        """Log once with the traceback; this rank's metrics stop here."""
        if not self._broken:
            self._broken = True
            logger.exception("AFD metrics of %s rank %s failed; they stop here (serving goes on)",
                             self.role, self.labels["role_rank"])

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            self.flush()

    def _count_step(self) -> None:
        payload = None if self._connector is None else self._connector.steps.payload
        if payload is None or payload is self._last_payload:
            return
        self._last_payload = payload
        if not (payload.is_graph_capturing or payload.is_warmup or payload.is_profile):
            self.steps += 1
            self.rows += sum(stage.own_rows for stage in self._connector.steps.stages.values())

    def _flush(self) -> None:
        connector = self._connector
        if connector is not None:
            self._set_peer_state(connector.is_initialized, connector.failure is not None or connector.reforming)
            if connector.rendezvous_s is not None and connector.rendezvous_s != self._rendezvous_written:
                self._set_rendezvous_seconds(connector.rendezvous_s)
            reformations = connector.reformations
            if reformations != self._reformations_written:
                self._reformations_written = reformations
                self._write_counter("afd_reformations", float(reformations))
        records = []
        while self._pending:
            records.append(self._pending.popleft())
        self._observe(records)
        self._write_steps()

    def _observe(self, records: Sequence[StepRecord]) -> None:
        records = [r for r in records if not (r.warmup or r.profile)]
        touched: set[int] = set()
        for record in records:
            if self.role is Role.ATTENTION:
                intervals = round_trip_intervals(record)
                self.histogram.observe_ns([end - start for start, end in intervals], touched)
                busy, span = exposed_transport_ns(intervals)
                self.exposed_ns += busy
                self.loop_ns += span
                if len(self._window) == self._window.maxlen:
                    old_busy, old_span = self._window[0]
                    self._window_busy -= old_busy
                    self._window_span -= old_span
                self._window.append((busy, span))
                self._window_busy += busy
                self._window_span += span
            else:
                self.histogram.observe_ns(record.ffn_compute_ns(), touched)
        if records:
            self._write_histogram(touched)
            if self.role is Role.ATTENTION:
                self._write_share()

    def _set_peer_state(self, up: bool, lost: bool) -> None:
        if self._peer == (up, lost):
            return
        self._peer = (up, lost)
        self._write_gauge("afd_peer_up", float(up))
        self._write_gauge("afd_peer_lost", float(lost))

    def _set_rendezvous_seconds(self, seconds: float) -> None:
        self._rendezvous_written = seconds
        self._write_gauge("afd_rendezvous_seconds", float(seconds))

    def _key(self, metric: str, sample: str) -> str:
        key = self._keys.get(sample)
        if key is None:
            key = self._keys[sample] = mmap_key(metric, sample, list(self.labels),
                                                list(self.labels.values()), HELP[metric])
        return key

    def _write_steps(self) -> None:
        steps = self.steps
        if steps != self._steps_written:
            self._steps_written = steps
            self._files.write("counter", self._key("afd_steps", "afd_steps_total"), steps)
            self._files.write("counter", self._key("afd_rows", "afd_rows_total"), self.rows)

    def _write_counter(self, metric: str, value: float) -> None:
        self._files.write("counter", self._key(metric, f"{metric}_total"), value)

    def _write_gauge(self, metric: str, value: float) -> None:
        # NOTE: most-recent gauges keep the newest write per label set (time.time() orders them).
        self._files.write("gauge", self._key(metric, metric), value, time.time())

    def _write_histogram(self, buckets: Iterable[int]) -> None:
        h = self.histogram
        for index in buckets:
            self._files.write("histogram", h.bucket_keys[index], float(h.counts[index]))
        self._files.write("histogram", h.sum_key, h.sum_ns / 1e9)

    def _write_share(self) -> None:
        self._write_counter("afd_exposed_transport_seconds", self.exposed_ns / 1e9)
        self._write_counter("afd_layer_loop_seconds", self.loop_ns / 1e9)
        share = self._window_busy / self._window_span if self._window_span else 0.0
        self._write_gauge("afd_exposed_transport_share", share)
