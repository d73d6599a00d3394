"""Rendezvous at FFN rank 0's store (docs/connection.md#rendezvous): real TCPStores on loopback, ranks as threads."""

from __future__ import annotations

import re
import socket
import threading
import time

import pytest

from vllm_afd.wire.errors import AFDConfigMismatchError, AFDLayoutError, AFDRendezvousTimeout
from vllm_afd.wire.handshake import Fingerprint
from vllm_afd.wire.placement import Placement
from vllm_afd.wire.rendezvous import Rendezvous, RendezvousSpec
from vllm_afd.wire.store import knock, rank_key

MODEL_FACTS = dict(
    overlay_version="0.1.0", vllm_version="0.30.0", architecture="Qwen3MoeForCausalLM", hidden_size=64,
    num_hidden_layers=4, dtype="bfloat16", layer_kinds="DMMM", num_routed_experts=8, graph_mode="eager",
    device="cpu",
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def place(role, rank, num_attention, num_ffn, tp_size=1):
    role_size = num_attention if role == "attention" else num_ffn
    return Placement(role, rank, num_attention, num_ffn, role_size // tp_size, tp_size)


def spec(role, rank, num_attention, num_ffn, port, timeout_s=10.0):
    return RendezvousSpec(place(role, rank, num_attention, num_ffn), "127.0.0.1", port, timeout_s)


def pair(rendezvous, fingerprint):
    """The rendezvous steps in the order of their production caller, `AFDConnector.init` (wire/connector.py):
    connect(), connect_client() (the watchdog's connection), claim() until held, then exchange_fingerprints()."""
    while True:
        rendezvous.connect()
        watchdog_store = rendezvous.connect_client()
        if rendezvous.claim():
            break
        watchdog_store = None  # our claim's holder died and FFN rank 0 re-hosts the store: connect again
    fingerprints = rendezvous.exchange_fingerprints(fingerprint)
    del watchdog_store  # held through the exchange, as the watchdog holds it in init
    return fingerprints


def run_ranks(ranks, port, timeout_s=10.0, delays=None):
    """ranks: [(role, rank, A, F, facts)], facts may hold "tp_size"; returns {index: fingerprints or the exception}."""
    results, threads, keep = {}, [], []

    def body(index, role, rank, num_attention, num_ffn, facts):
        time.sleep((delays or {}).get(index, 0.0))
        facts = dict(facts)
        placement = place(role, rank, num_attention, num_ffn, facts.pop("tp_size", 1))
        rendezvous = Rendezvous(RendezvousSpec(placement, "127.0.0.1", port, timeout_s))
        keep.append(rendezvous)  # the host's store must outlive the other threads
        fingerprint = Fingerprint.for_rank(placement, connector="P2pGlooAFDConnector", compute_gate_on_attention=False,
                                           hostname="localhost", pid=0, **{**MODEL_FACTS, **facts})
        try:
            results[index] = pair(rendezvous, fingerprint)
        except Exception as exc:  # noqa: BLE001 - asserted by the tests
            results[index] = exc

    for index, (role, rank, num_attention, num_ffn, facts) in enumerate(ranks):
        threads.append(threading.Thread(target=body, args=(index, role, rank, num_attention, num_ffn, facts)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 10.0)
    assert not any(thread.is_alive() for thread in threads), "a rendezvous thread hung"
    return results


def test_only_ffn_rank_0_hosts_the_store_and_every_rank_is_listed_ffn_first():
    specs = [spec(role, rank, 3, 2, 29500) for role, rank in (("ffn", 0), ("ffn", 1), ("attention", 0))]

    hosts = [s.is_store_host for s in specs]

    assert hosts == [True, False, False]
    assert specs[2].all_ranks() == [("ffn", 0), ("ffn", 1), ("attention", 0), ("attention", 1), ("attention", 2)]
    assert (specs[2].address, specs[2].identity) == ("127.0.0.1:29500", "role=attention, role_rank=0")
    assert (specs[1].role, specs[1].role_rank) == ("ffn", 1)
    assert rank_key("claim", "attention", 2) == "afd/claim/attention/2"


def test_every_rank_receives_every_fingerprint_2a1f():
    port = free_port()

    results = run_ranks([("attention", 1, 2, 1, {}), ("ffn", 0, 2, 1, {}), ("attention", 0, 2, 1, {})], port)

    for result in results.values():
        assert not isinstance(result, Exception), result
        assert sorted(result) == [("attention", 0), ("attention", 1), ("ffn", 0)]
        assert result[("attention", 1)].role_rank == 1


def test_timeout_message_lists_joined_and_missing_ranks():
    port = free_port()
    started = time.monotonic()

    results = run_ranks([("ffn", 0, 3, 1, {}), ("attention", 0, 3, 1, {})], port, timeout_s=1.5)

    assert time.monotonic() - started < 6.0
    for index, identity in ((0, "role=ffn, role_rank=0"), (1, "role=attention, role_rank=0")):
        assert isinstance(results[index], AFDRendezvousTimeout)
        assert str(results[index]) == (
            f"AFD rendezvous timed out after 1.5s at 127.0.0.1:{port} ({identity}); joined: ffn [0], "
            "attention [0]; missing: attention [1 2]. Start the other role with the same host/port/topology, "
            "or raise rendezvous_timeout_s"
        )


def test_timeout_without_ffn_rank_0_says_the_store_is_unreachable():
    port = free_port()
    started = time.monotonic()

    results = run_ranks([("attention", 0, 1, 1, {})], port, timeout_s=1.0)

    assert time.monotonic() - started < 4.0
    assert isinstance(results[0], AFDRendezvousTimeout)
    assert f"cannot reach the AFD rendezvous store at 127.0.0.1:{port} (hosted by FFN rank 0)" in str(results[0])
    assert "raise rendezvous_timeout_s" in str(results[0])


def test_ffn_rank_0_reports_a_busy_port_with_the_os_error():
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]

        with pytest.raises(RuntimeError) as info:
            Rendezvous(spec("ffn", 0, 1, 1, port, 1.0)).connect()

    assert str(info.value).startswith(f"AFD FFN rank 0 cannot listen on 127.0.0.1:{port}: [Errno 98]")
    assert str(info.value).endswith("'port' must be free and 'host' must be this machine's address")


def test_two_claimants_of_one_role_rank_both_fail_naming_it():
    port = free_port()

    # Attention 1 never comes, so the first claimant is still waiting when the second claims.
    results = run_ranks([("ffn", 0, 2, 1, {}), ("attention", 0, 2, 1, {}), ("attention", 0, 2, 1, {})], port,
                        timeout_s=3.0, delays={2: 0.5})

    for index in (1, 2):
        assert isinstance(results[index], ValueError), results[index]
        assert str(results[index]) == (
            "AFD rank (role=attention, role_rank=0) joined twice; check DP/TP sizes and that only one "
            f"deployment uses 127.0.0.1:{port}"
        )
    assert isinstance(results[0], AFDRendezvousTimeout)


def test_a_claim_held_by_a_dead_process_is_retaken_once_ffn_rank_0_re_hosts_the_store():
    # The restarted attention reaches the old store before the FFN noticed its predecessor's death
    # (docs/connection.md#re-forming): it waits, sees the store go away, and claims on the new one.
    port = free_port()
    host = Rendezvous(spec("ffn", 0, 1, 1, port))
    host.connect()
    Rendezvous(spec("attention", 0, 1, 1, port)).connect().add(rank_key("claim", "attention", 0), 1)  # the dead one
    restarted = Rendezvous(RendezvousSpec(place("attention", 0, 1, 1), "127.0.0.1", port, 10.0, stale_claim_s=5.0))
    restarted.connect()

    def re_host():
        time.sleep(0.5)
        host.store = None  # the FFN's re-formation drops the old store ...
        time.sleep(0.2)
        again = Rendezvous(RendezvousSpec(place("ffn", 0, 1, 1), "127.0.0.1", port, 10.0, rebind_s=5.0))
        again.connect()  # ... and listens again on the same port
        keep.append(again)

    keep: list = []
    thread = threading.Thread(target=re_host)
    thread.start()
    started = time.monotonic()
    first = restarted.claim()
    thread.join(10.0)
    restarted.connect()
    second = restarted.claim()

    assert (first, second) == (False, True)
    assert time.monotonic() - started < 5.0


def test_a_live_duplicate_is_still_refused_after_the_stale_claim_grace():
    port = free_port()
    host = Rendezvous(spec("ffn", 0, 1, 1, port))
    host.connect()
    first = Rendezvous(spec("attention", 0, 1, 1, port))
    first.connect()
    assert first.claim() is True
    second = Rendezvous(RendezvousSpec(place("attention", 0, 1, 1), "127.0.0.1", port, 10.0, stale_claim_s=0.3))
    second.connect()

    with pytest.raises(ValueError, match=r"joined twice"):
        second.claim()


def test_fingerprint_mismatch_fails_every_rank_naming_both_values():
    port = free_port()

    results = run_ranks([("ffn", 0, 2, 1, {"hidden_size": 4096, "dtype": "float16"}),
                         ("attention", 0, 2, 1, {}), ("attention", 1, 2, 1, {})], port)

    for result in results.values():
        assert isinstance(result, AFDConfigMismatchError), result
        # Each rank names its own side first; both values must be there.
        assert re.search(r"hidden_size \((attention=64, ffn=4096|ffn=4096, attention=64)\)", str(result))
        assert re.search(r"dtype \((attention=bfloat16, ffn=float16|ffn=float16, attention=bfloat16)\)", str(result))


def test_invalid_layout_fails_every_rank():
    port = free_port()
    ffn = {"tp_size": 2}  # FFN 1x2 under attention 2x1: TP peers would get different tokens

    results = run_ranks([("ffn", 0, 2, 2, ffn), ("ffn", 1, 2, 2, ffn), ("attention", 0, 2, 2, {}),
                         ("attention", 1, 2, 2, {})], port)

    for result in results.values():
        assert isinstance(result, AFDLayoutError), result
        assert "TP peers of FFN DP rank 0 would receive different tokens" in str(result)


# ---- what a waiting rank logs (docs/decisions.md#28-a-waiting-rank-knocks-with-a-plain-socket-first) ------------


class FakeTime:
    """A clock that moves only when the rendezvous sleeps: the waits run at once, the log cadence is exact."""

    def __init__(self) -> None:
        self.now = 1000.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def waiting_lines(caplog):
    return [record for record in caplog.records if "waiting for" in record.getMessage()]


def test_a_rank_waiting_for_the_store_logs_one_line_per_interval_and_no_trace(caplog, capfd):
    port = free_port()  # nobody listens there
    fake = FakeTime()
    rendezvous = Rendezvous(spec("attention", 0, 1, 1, port, timeout_s=25.0), clock=fake.clock, sleep=fake.sleep,
                            log_interval_s=10.0)
    caplog.set_level("INFO", logger="vllm_afd.wire.rendezvous")

    with pytest.raises(AFDRendezvousTimeout, match="cannot reach the AFD rendezvous store"):
        rendezvous.connect()

    lines = [record.getMessage() for record in waiting_lines(caplog)]
    assert lines == [
        f"AFD attention rank 0: waiting for FFN rank 0 (the rendezvous store) at 127.0.0.1:{port} "
        f"(rendezvous, {elapsed} s of 25 s)" for elapsed in (10, 20)
    ]
    assert all(record.exc_info is None and record.levelname == "INFO" for record in caplog.records)
    output = capfd.readouterr()
    for trace_text in ("frame #", "TCPStore.cpp", "socket.cpp", "Traceback"):
        assert trace_text not in output.err + output.out + caplog.text


def test_knocking_leaves_the_store_serving_clients_and_silent(capfd):
    port = free_port()
    host = Rendezvous(spec("ffn", 0, 1, 1, port))
    store = host.connect()
    client = Rendezvous(spec("attention", 0, 1, 1, port))

    for _ in range(20):
        knock("127.0.0.1", port, 1.0)
    knock_output = capfd.readouterr()
    other = client.connect_client()
    other.set("afd/test/key", "value")

    assert store.get("afd/test/key") == b"value"
    # NOTE: only the knocks are checked: a TCPStore connect itself stalls now and then and logs its retry.
    assert "frame #" not in knock_output.err and "[c10d]" not in knock_output.err


def test_a_rank_waiting_for_fingerprints_names_the_missing_ranks(caplog):
    port = free_port()
    fake = FakeTime()
    rendezvous = Rendezvous(spec("ffn", 0, 2, 1, port, timeout_s=15.0), clock=fake.clock, sleep=fake.sleep,
                            log_interval_s=10.0)
    placement = place("ffn", 0, 2, 1)
    fingerprint = Fingerprint.for_rank(placement, connector="P2pGlooAFDConnector", compute_gate_on_attention=False,
                                       hostname="localhost", pid=0, **MODEL_FACTS)
    caplog.set_level("INFO", logger="vllm_afd.wire.rendezvous")

    with pytest.raises(AFDRendezvousTimeout, match=r"missing: attention \[0 1\]"):
        pair(rendezvous, fingerprint)

    assert [record.getMessage() for record in waiting_lines(caplog)] == [
        f"AFD ffn rank 0: waiting for attention [0 1] at 127.0.0.1:{port} (handshake, 10 s of 15 s)"
    ]
