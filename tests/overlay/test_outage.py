"""The attention's outage notice (vllm_afd/outage.py, docs/failures.md#requests-during-an-outage):
written once by the connector's failure latch the moment it fails, answered as HTTP 503 by the API
server's veto."""

from __future__ import annotations

from http import HTTPStatus

import pytest

from vllm_afd import plugin
from vllm_afd.metrics import METRICS_DIR_ENV, PROMETHEUS_DIR_ENV
from vllm_afd.outage import (clear_outage, healing_message, outage_message, outage_notice_writer, outage_probe,
                             read_outage, record_outage)
from vllm_afd.wire.errors import AFDAuthenticationError, AFDPeerLostError, AFDRendezvousTimeout
from vllm_afd.wire.failure import FailureLatch

pytest.importorskip("vllm")


def test_the_notice_is_written_once_read_whole_and_cleared(tmp_path):
    assert read_outage(str(tmp_path)) is None

    record_outage(str(tmp_path), outage_message(AFDPeerLostError("AFD peer lost: ffn rank 0 silent for 5.0s")))
    record_outage(str(tmp_path), outage_message(AFDPeerLostError("a later failure")))  # the first cause stays
    notice = read_outage(str(tmp_path))
    clear_outage(str(tmp_path))
    clear_outage(str(tmp_path))  # idempotent

    assert notice == (
        "AFD attention server unavailable: its engine stopped after an AFD failure (AFD peer lost: AFDPeerLostError; "
        "the details are in the server log). Restart this attention server: the FFN waits for it (reform_timeout_s) "
        "and pairs with the new one; send requests elsewhere meanwhile")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_writer_puts_the_notice_into_this_servers_afd_directory_or_is_none_without_one(tmp_path, monkeypatch):
    monkeypatch.delenv(PROMETHEUS_DIR_ENV, raising=False)
    monkeypatch.delenv(METRICS_DIR_ENV, raising=False)
    assert outage_notice_writer() is None  # metrics off: vLLM's generic engine error remains

    monkeypatch.setenv(METRICS_DIR_ENV, str(tmp_path))
    outage_notice_writer()(AFDPeerLostError("AFD peer lost: x"))

    assert read_outage(str(tmp_path)).startswith("AFD attention server unavailable")


def test_the_latch_tells_the_first_failure_at_once_and_survives_a_failing_callback():
    told: list[BaseException] = []

    def callback(exc: BaseException) -> None:
        told.append(exc)
        raise OSError("disk full")

    latch = FailureLatch(lambda: None, None, on_failure=callback)
    first, second = AFDPeerLostError("first"), AFDPeerLostError("second")

    assert latch.fail(first) is first and told == [first]  # synchronous: before anyone could observe it
    assert latch.fail(second) is first and told == [first]
    latch.close()


def test_the_attention_veto_answers_503_with_the_notice_while_it_exists(tmp_path, monkeypatch):
    monkeypatch.delenv(PROMETHEUS_DIR_ENV, raising=False)
    monkeypatch.setenv(METRICS_DIR_ENV, str(tmp_path))

    serving = plugin._veto_during_outage(object())  # noqa: SLF001
    record_outage(str(tmp_path), outage_message(AFDPeerLostError("AFD peer lost: f2a receive from ffn rank 0 failed")))
    refused = plugin._veto_during_outage(object())  # noqa: SLF001

    assert serving is None
    assert refused.http_status == HTTPStatus.SERVICE_UNAVAILABLE
    assert refused.message.startswith("AFD attention server unavailable: its engine stopped after an AFD failure "
                                      "(AFD peer lost: AFDPeerLostError; the details are in the server log)")


def test_health_answers_what_a_request_gets_while_the_attention_heals(tmp_path, monkeypatch):
    """One outage, one answer: /health's veto (patch health-add-health-veto) and the request veto share it."""
    monkeypatch.delenv(PROMETHEUS_DIR_ENV, raising=False)
    monkeypatch.setenv(METRICS_DIR_ENV, str(tmp_path))

    serving = plugin._outage_refusal()  # noqa: SLF001 - what the plugin registers as /health's veto
    record_outage(str(tmp_path), healing_message(AFDPeerLostError("AFD peer lost: ffn rank 0 silent for 5.0s"), 600))
    health, request = plugin._outage_refusal(), plugin._veto_during_outage(object())  # noqa: SLF001

    assert serving is None
    assert health.http_status == request.http_status == HTTPStatus.SERVICE_UNAVAILABLE
    assert health.message == request.message == read_outage(str(tmp_path))


def test_the_probe_sees_any_ranks_notice_and_never_fires_without_a_directory(tmp_path):
    probe, never = outage_probe(str(tmp_path)), outage_probe(None)

    before = probe()
    record_outage(str(tmp_path), outage_message(AFDPeerLostError("AFD peer lost: ffn rank 1 silent for 5.0s")))

    assert (before, probe(), never()) == (False, True, False)
    clear_outage(str(tmp_path))
    assert probe() is False


@pytest.mark.parametrize("failure", [
    AFDPeerLostError("AFD peer lost: the rendezvous store at 10.0.0.5:6390 (hosted by ffn rank 0) is unreachable "
                     "from attention rank 0 (Connection reset by peer [10.0.0.7]:41234)"),
    AFDRendezvousTimeout("AFD rendezvous timed out after 300s at 10.0.0.5:6390 (role=attention, role_rank=0)"),
    AFDAuthenticationError("AFD attention rank 0: authentication failed: … 10.0.0.5:6390"),
    RuntimeError("Gloo connectFullMesh failed with ... remote=[10.0.0.5]:6390"),
])
def test_a_client_reads_the_kind_of_failure_never_an_address_or_the_connectors_text(failure):
    messages = [outage_message(failure), healing_message(failure, 600)]

    for message in messages:
        assert "10.0.0." not in message and "6390" not in message and str(failure) not in message
        assert f": {type(failure).__name__}; the details are in the server log)" in message
    assert messages[1].startswith("AFD attention server unavailable: its FFN peer was lost (AFD ")
    assert "re-forming: this server serves again once the FFN is back and paired" in messages[1]
