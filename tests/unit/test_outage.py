"""The attention's outage notice (vllm_afd/outage.py, docs/failures.md#requests-during-an-outage):
written once by the worker's metrics on an AFD failure, answered as HTTP 503 by the API server's veto."""

from __future__ import annotations

from http import HTTPStatus

import pytest

from vllm_afd import plugin
from vllm_afd.metrics import METRICS_DIR_ENV, PROMETHEUS_DIR_ENV, AFDMetrics
from vllm_afd.outage import OUTAGE_FILE, clear_outage, read_outage, record_outage
from vllm_afd.wire.errors import AFDPeerLostError

pytest.importorskip("vllm")


class FailedConnector:
    """The connector surface the metrics read, after a lost peer."""

    def __init__(self, failure: BaseException | None) -> None:
        self.steps = type("Steps", (), {"payload": None})()
        self.is_initialized = failure is None
        self.failure = failure
        self.rendezvous_s = 1.0
        self.reformations = 0


def test_the_notice_is_written_once_read_whole_and_cleared(tmp_path):
    assert read_outage(str(tmp_path)) is None

    record_outage(str(tmp_path), AFDPeerLostError("AFD peer lost: ffn rank 0 silent for 5.0s"))
    record_outage(str(tmp_path), AFDPeerLostError("a later failure"))  # the first cause stays
    notice = read_outage(str(tmp_path))
    clear_outage(str(tmp_path))
    clear_outage(str(tmp_path))  # idempotent

    assert notice == (
        "AFD attention server unavailable: its engine stopped after an AFD failure (AFD peer lost: ffn rank 0 "
        "silent for 5.0s). Restart this attention server: the FFN waits for it (reform_timeout_s) and pairs "
        "with the new one; send requests elsewhere meanwhile")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("role, failure, written", [
    ("attention", AFDPeerLostError("AFD peer lost: x"), True),
    ("attention", None, False),
    ("ffn", AFDPeerLostError("AFD peer lost: x"), False),  # the FFN re-forms; its server has nothing to refuse
])
def test_metrics_write_the_notice_for_a_failed_attention_only(tmp_path, role, failure, written):
    metrics = AFDMetrics(str(tmp_path), role, 0, "P2pGlooAFDConnector")
    metrics.watch(FailedConnector(failure), thread=False)
    metrics.flush()
    metrics.close()

    assert (tmp_path / OUTAGE_FILE).exists() is written


def test_the_attention_veto_answers_503_with_the_notice_while_it_exists(tmp_path, monkeypatch):
    monkeypatch.delenv(PROMETHEUS_DIR_ENV, raising=False)
    monkeypatch.setenv(METRICS_DIR_ENV, str(tmp_path))

    serving = plugin._veto_during_outage(object())  # noqa: SLF001
    record_outage(str(tmp_path), AFDPeerLostError("AFD peer lost: f2a receive from ffn rank 0 failed"))
    refused = plugin._veto_during_outage(object())  # noqa: SLF001

    assert serving is None
    assert refused.http_status == HTTPStatus.SERVICE_UNAVAILABLE
    assert refused.message.startswith("AFD attention server unavailable: its engine stopped after an AFD failure "
                                      "(AFD peer lost: f2a receive from ffn rank 0 failed)")
