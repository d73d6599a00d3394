"""AFDConnector over GlooTransport across real processes on loopback (docs/protocol.md, docs/connection.md).

Each test runs its ranks on a session pool of spawned workers (tests/connectors/conftest.py). Data is
checked bit for bit by the attention ranks (tests/connectors/_scenarios.py), payloads by the FFN.
"""

from __future__ import annotations

import datetime
import re
import time

import pytest
from tests.connectors._harness import expect_ok, free_port
from tests.connectors._scenarios import (exchange, exchange_then_die, garbage_payload, hung_ffn, idle_attention,
                                         pingpong, reforming_pair, step_counts)


def run_exchange(pool, num_attention, num_ffn, *, dtype="bfloat16", num_steps=3, gate=False, num_stages=1,
                 probe_errors=False, attention_tp=1):
    """Run ``exchange`` on every rank of an ``num_attention``A``num_ffn``F layout; results by (role, rank)."""
    port = free_port()
    ranks = [("ffn", k) for k in range(num_ffn)] + [("attention", j) for j in range(num_attention)]
    arg_lists = [(role, rank, num_attention, num_ffn, port, dtype, num_steps, gate, num_stages, probe_errors,
                  attention_tp) for role, rank in ranks]
    return dict(zip(ranks, expect_ok(pool.run(exchange, arg_lists, timeout_s=90.0))))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_1a1f_exchanges_every_layer_of_every_step_bit_exact(pool, dtype):
    results = run_exchange(pool, 1, 1, dtype=dtype, num_steps=4)

    payloads = results[("ffn", 0)]["payloads"]
    assert [p["step_seq"] for p in payloads] == [0, 1, 2, 3]
    assert [p["stages"][0] for p in payloads] == [step_counts(step, 0, 1) for step in range(4)]
    assert all(not result["initialized_after_close"] for result in results.values())


def test_2a1f_tp2_router_logits_and_two_stages_with_row_checks(pool):
    results = run_exchange(pool, 2, 1, gate=True, num_stages=2, probe_errors=True, attention_tp=2)

    payloads = results[("ffn", 0)]["payloads"]
    assert [(p["is_profile"], p["is_warmup"]) for p in payloads] == [(True, False), (False, True), (False, False)]
    # One DP rank of TP 2: both attention ranks carry the DP rank's count.
    assert payloads[2]["stages"] == {0: step_counts(2, 0, 1) * 2, 1: step_counts(2, 1, 1) * 2}
    assert payloads == results[("attention", 0)]["payloads"] == results[("attention", 1)]["payloads"]
    for rank in (0, 1):
        errors = results[("attention", rank)]["errors"]
        assert errors[0].startswith(f"P2pGlooAFDConnector: attention rank {rank} sends 2 rows in stage 0 but "
                                    "published 1; publish the padded")
        assert errors[1].startswith("P2pGlooAFDConnector: router logits have 2 rows, hidden states 1")


def test_3a2f_pairs_data_and_control_ranks_with_idle_dp_ranks(pool):
    results = run_exchange(pool, 3, 2, num_steps=3)

    for k in (0, 1):
        payloads = results[("ffn", k)]["payloads"]
        assert [p["stages"][0] for p in payloads] == [step_counts(step, 0, 3) for step in range(3)]
    assert 0 in step_counts(0, 0, 3)  # an idle DP rank sent one row and got it back


@pytest.mark.parametrize(("num_attention", "num_stages"), [(1, 2), (2, 3)])
def test_interleaved_stages_complete_bit_exact_over_rendezvous_sends(pool, num_attention, num_stages):
    # Every stage's send is issued before the first receive: blocking sends would deadlock here
    # (tests/wire/test_stage_ordering.py); steps of fewer stages than agreed run too.
    port = free_port()
    ranks = [("ffn", 0)] + [("attention", j) for j in range(num_attention)]
    arg_lists = [(role, rank, num_attention, 1, port, num_stages, 2 * num_stages) for role, rank in ranks]

    results = expect_ok(pool.run(pingpong, arg_lists, timeout_s=90.0))

    expected = [step % num_stages + 1 for step in range(2 * num_stages)]
    assert [result["stage_counts"] for result in results] == [expected] * len(ranks)


def test_undecodable_control_bytes_are_a_protocol_error_on_the_ffn(pool):
    port = free_port()

    ffn, _ = expect_ok(pool.run(garbage_payload, [("ffn", 0, port), ("attention", 0, port)], 60.0))

    assert ffn["error"].startswith("AFDPeerProtocolError: P2pGlooAFDConnector: from attention rank 0: AFD control "
                                   "payload is undecodable")


# ---- failures that kill a worker (kept last: each dead worker is respawned, ~10 s) ----


def test_ffn_killed_mid_exchange_is_a_lost_peer_on_the_attention_at_once(pool):
    port = free_port()

    ffn, attention = pool.run(exchange_then_die, [("ffn", 0, port, 2.0), ("attention", 0, port, 2.0)], 60.0)

    assert ffn == ("exit", 3)
    status, report = attention
    assert status == "ok", report
    assert report["error"].startswith("AFDPeerLostError: AFD peer lost: f2a receive from ffn rank 0 failed on "
                                      "attention rank 0")
    assert report["elapsed_s"] < 2.0  # within peer_timeout_s: the dead peer closed its connections
    assert report["sticky"] == "AFDPeerLostError"


def test_ffn_re_forms_with_a_restarted_attention_that_arrived_while_the_dead_one_held_its_claim(pool, tmp_path):
    port, marker = free_port(), str(tmp_path / "generation-1-serving")

    ffn, first, second = pool.run(reforming_pair, [("ffn", 0, port, marker), ("attention", 1, port, marker),
                                                   ("attention", 2, port, marker)], 60.0)

    assert first == ("exit", 5)
    assert second == ("ok", {"step_seqs": [0, 1]}), second  # exact FFN results, a fresh step sequence
    status, report = ffn
    assert status == "ok", report
    assert report["served"] == [0, 0, 1] and report["reformations"] == 1
    assert report["lost"][0].startswith("AFD peer lost: a2f receive from attention rank 0 failed on ffn rank 0")
    assert report["reform_s"] < 10.0


def test_hung_ffn_is_a_step_timeout_then_the_stuck_attention_terminates(pool, tmp_path):
    port, report = free_port(), tmp_path / "cause.txt"
    started = time.monotonic()

    ffn, attention = pool.run(hung_ffn, [("ffn", 0, port, str(report)), ("attention", 0, port, str(report))], 60.0)

    assert attention == ("exit", 17)
    assert re.match(r"AFDStepTimeoutError: AFD step 0 \(open for [0-9.]+s\) did not complete within step_timeout_s=1 "
                    r"\(ffn peer rank 0\): attention rank 0 has waited ", report.read_text())
    assert "in 'f2a receive from ffn rank 0'" in report.read_text()  # the waiting and the missing rank
    assert ffn[0] == "ok", ffn
    assert time.monotonic() - started < 20.0


def test_idle_attention_goes_down_when_the_store_host_dies(pool, tmp_path):
    port, report = free_port(), tmp_path / "cause.txt"

    ffn, attention = pool.run(idle_attention,
                              [("ffn", 0, port, str(report)), ("attention", 0, port, str(report))], 60.0)

    assert ffn == ("exit", 3)
    assert attention == ("exit", 18)
    assert report.read_text().startswith("AFDPeerLostError: AFD peer lost: the rendezvous store at 127.0.0.1:")


# ---- gloo's own address (docs/connection.md#roles-on-different-hosts) ----


def test_gloo_binds_the_address_that_routes_to_the_store_unless_an_interface_is_named(monkeypatch):
    from types import SimpleNamespace

    from vllm_afd.wire.transports.gloo import _gloo_options

    store = SimpleNamespace(host="127.0.0.1", port=free_port())  # the TCPStore's public host and port
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    routed = _gloo_options(store, datetime.timedelta(seconds=3))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo,eth0")
    named = _gloo_options(store, datetime.timedelta(seconds=3))

    assert routed[1] == "127.0.0.1" and len(routed[0]._devices) == 1
    assert named[1] == "GLOO_SOCKET_IFNAME=lo,eth0" and len(named[0]._devices) == 1
