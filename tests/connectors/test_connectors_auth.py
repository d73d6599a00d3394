"""Authenticated pairing across real processes over gloo on loopback (docs/security.md, wire/auth.py).

Ranks run on the session pool of spawned workers (tests/connectors/conftest.py); every wait is bounded by a
short ``rendezvous_timeout_s`` and the pool's own timeout.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from tests.connectors._harness import expect_ok, free_port, make_connector, make_placement, make_spec

from vllm_afd.wire.auth import AUTH_FIX, Secret
from vllm_afd.wire.errors import AFDRendezvousTimeout

RIGHT, WRONG = "s3cret-of-the-deployment", "another-secret"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def init_with_secret(role: str, port: int, secret: str | None, timeout_s: float, delay_s: float = 0.0,
                     hold_s: float = 0.0) -> dict[str, Any]:
    """One rank of a 1A1F pairing: init() with ``secret``; whether it paired, its error and its AFD log lines."""
    lines = _Lines()
    logging.getLogger("vllm_afd").addHandler(lines)
    logging.getLogger("vllm_afd").setLevel(logging.INFO)
    time.sleep(delay_s)
    connector = make_connector(make_spec(port, rendezvous_timeout_s=timeout_s), make_placement(role, 0, 1, 1),
                               secret=None if secret is None else Secret(secret.encode(), "test"))
    started = time.monotonic()
    try:
        connector.init()
        result = {"paired": True, "peers": sorted(connector.fingerprints)}
        time.sleep(hold_s)  # the store host outlives its peer's last store call
    except AFDRendezvousTimeout as exc:
        result = {"paired": False, "error": str(exc)}
    finally:
        connector.close()
    return {**result, "seconds": time.monotonic() - started, "log": lines.lines}


def test_ranks_with_the_same_secret_pair(pool):
    port = free_port()

    ffn, attention = expect_ok(pool.run(init_with_secret, [("ffn", port, RIGHT, 20.0, 0.0, 1.0),
                                                           ("attention", port, RIGHT, 20.0)], timeout_s=60.0))

    assert ffn["paired"] and attention["paired"], (ffn, attention)
    assert ffn["peers"] == attention["peers"] == [("attention", 0), ("ffn", 0)]
    assert not any("UNAUTHENTICATED" in line for line in ffn["log"] + attention["log"])


@pytest.mark.parametrize(("ffn_secret", "attention_secret", "detail"), [
    (RIGHT, WRONG, "the proof of attention rank 0 does not verify"),
    (RIGHT, None, "attention rank 0 has no secret"),
])
def test_a_wrong_or_missing_secret_does_not_pair_and_the_errors_name_authentication(pool, ffn_secret,
                                                                                     attention_secret, detail):
    port = free_port()

    ffn, attention = expect_ok(pool.run(init_with_secret, [("ffn", port, ffn_secret, 4.0),
                                                           ("attention", port, attention_secret, 4.0)],
                                        timeout_s=60.0))

    for result in (ffn, attention):
        assert not result["paired"] and AUTH_FIX in result["error"], result
        assert result["seconds"] < 4.0 + 5.0, result  # the rendezvous' own deadline ended the wait
    assert detail in ffn["error"]
    assert any("refused the pairing" in line and AUTH_FIX in line for line in ffn["log"]), ffn["log"]
    assert sum("refused the pairing" in line for line in ffn["log"]) <= 2, ffn["log"]  # one line per 10 s


def test_the_ffn_keeps_waiting_past_a_refused_attention_and_pairs_with_the_right_one(pool):
    port = free_port()

    ffn, wrong, right = expect_ok(pool.run(init_with_secret, [
        ("ffn", port, RIGHT, 25.0, 0.0, 1.0),
        ("attention", port, WRONG, 3.0),
        ("attention", port, RIGHT, 15.0, 5.0),  # started after the wrong one gave up
    ], timeout_s=60.0))

    assert not wrong["paired"] and AUTH_FIX in wrong["error"], wrong
    assert ffn["paired"] and right["paired"], (ffn, right)
    assert any("refused the pairing" in line for line in ffn["log"]), ffn["log"]
