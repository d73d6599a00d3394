"""vllm_afd.wire.reforming.reform_within: which failed attempts are refusals to wait past, which end the wait.

A recording fake stands in for the connector: ``reform`` raises the scripted errors in turn, then pairs.
The real re-formations (processes, stores, transports) are tests/connectors/test_connectors_gloo.py's.
"""

from __future__ import annotations

import time

import pytest

from vllm_afd.wire.errors import (
    AFDConfigMismatchError, AFDLayoutError, AFDPeerLostError, AFDProtocolError, AFDRendezvousTimeout,
)
from vllm_afd.wire.placement import Placement
from vllm_afd.wire.reforming import reform_within


class ScriptedConnector:
    """``reform(timeout_s)`` raises ``failures`` one by one, then succeeds; every call is recorded."""

    def __init__(self, *failures: BaseException) -> None:
        self.placement = Placement("ffn", 0, 1, 1)
        self.reformations = 0
        self.attempts: list[float] = []
        self._failures = list(failures)

    def reform(self, timeout_s: float) -> None:
        self.attempts.append(timeout_s)
        if self._failures:
            raise self._failures.pop(0)
        self.reformations += 1


@pytest.mark.parametrize("refusal", [
    AFDConfigMismatchError("hidden_size (attention=8, ffn=16)"),
    AFDLayoutError("layouts"),
    AFDProtocolError("P2pIpcAFDConnector: store record afd/ipc/0/who/1: max_rows is -2"),
])
def test_a_refused_pairing_is_logged_and_the_wait_goes_on(refusal, caplog):
    connector = ScriptedConnector(refusal, refusal)

    reform_within(connector, 30.0, AFDPeerLostError("lost"), peer="the attention", then="this FFN exits")

    assert len(connector.attempts) == 3 and connector.reformations == 1
    assert caplog.text.count("refused a returning attention") == 2 and str(refusal) in caplog.text


def test_a_forged_store_value_until_the_deadline_names_the_last_refusal():
    forged = AFDProtocolError("the NCCL unique id of the AFD a2f channel in the store has 57 bytes")

    class ForgedEveryTime(ScriptedConnector):
        def reform(self, timeout_s: float) -> None:
            self.attempts.append(timeout_s)
            time.sleep(0.01)  # a rendezvous takes time
            raise forged

    connector = ForgedEveryTime()

    with pytest.raises(AFDRendezvousTimeout, match="one returned but was refused: the NCCL unique id"):
        reform_within(connector, 0.05, AFDPeerLostError("lost"), peer="the attention", then="this FFN exits")


def test_a_rendezvous_timeout_ends_the_wait_at_once():
    connector = ScriptedConnector(AFDRendezvousTimeout("nobody came"))

    with pytest.raises(AFDRendezvousTimeout, match="did not return with an agreeing handshake"):
        reform_within(connector, 30.0, AFDPeerLostError("lost"), peer="the attention", then="this FFN exits")

    assert len(connector.attempts) == 1
