"""The FFN runner's re-formation (docs/connection.md#re-forming): the real runner and connector over gloo on
loopback, returning attentions built from the same config-only tiny Qwen3-MoE (no weights, no vLLM engine)."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("vllm")
from tests.connectors._harness import free_port
from tests.connectors._vllm_configs import make_vllm_config

from vllm_afd.config import parse_afd_config
from vllm_afd.wire.errors import AFDConfigMismatchError, AFDPeerLostError, AFDRendezvousTimeout

GLOO = {"connector": "P2pGlooAFDConnector"}



def role_connector(model_dir, role: str, port: int, **afd):
    """The connector a role's runner builds, from a real VllmConfig of the tiny model."""
    import torch

    from vllm_afd.connect import build_connector
    from vllm_afd.wire.placement import Placement

    vllm_config = make_vllm_config(model_dir, role=role, port=port, rendezvous_timeout_s=20, **GLOO, **afd)
    return build_connector(vllm_config, parse_afd_config(vllm_config), Placement(role, 0, 1, 1), torch.device("cpu"))


def ffn_runner(model_dir, port: int, reform_timeout_s: float):
    import torch

    from vllm_afd.ffn.runner import AFDFFNModelRunner
    from vllm_afd.wire.placement import Placement
    from vllm_afd.workers.common import make_role_vllm_config

    vllm_config = make_vllm_config(model_dir, role="ffn", port=port, reform_timeout_s=reform_timeout_s, **GLOO)
    afd_config = parse_afd_config(vllm_config)
    return AFDFFNModelRunner(make_role_vllm_config(vllm_config, afd_config), torch.device("cpu"), afd_config,
                             Placement("ffn", 0, 1, 1))


def test_a_mismatching_attention_is_refused_and_the_ffn_pairs_with_the_next_agreeing_one(model_dir, caplog):
    port = free_port()
    runner = ffn_runner(model_dir, port, reform_timeout_s=30)
    wrong = role_connector(model_dir, "attention", port, compute_gate_on_attention=True)
    right = role_connector(model_dir, "attention", port)
    outcomes: dict[str, object] = {}

    def arrive(name, connector, delay_s):
        time.sleep(delay_s)
        try:
            connector.init()
            outcomes[name] = "paired"
        except Exception as exc:  # noqa: BLE001 - asserted below
            outcomes[name] = exc

    threads = [threading.Thread(target=arrive, args=("wrong", wrong, 0.2)),
               threading.Thread(target=arrive, args=("right", right, 3.0))]
    for thread in threads:
        thread.start()
    with caplog.at_level("INFO", logger="vllm_afd"):
        runner.reform(AFDPeerLostError("AFD peer lost: a2f receive from attention rank 0 failed"))
    for thread in threads:
        thread.join(30)

    try:
        assert isinstance(outcomes["wrong"], AFDConfigMismatchError), outcomes
        assert outcomes["right"] == "paired"
        assert runner.connector.is_initialized and runner.connector.reformations == 1
        text = caplog.text
        assert "AFD ffn rank 0: lost the attention (AFD peer lost: a2f receive from attention rank 0 failed); " \
               "waiting up to 30 s for it to return and pair again (reform_timeout_s)" in text
        assert "AFD ffn rank 0: refused a returning attention: " in text and "still waiting" in text
        assert "AFD ffn rank 0: paired again with attention ranks [0] after" in text
    finally:
        right.close()
        wrong.close()
        runner.shutdown()


def test_no_attention_within_reform_timeout_is_an_error_naming_the_key_and_the_fix(model_dir):
    runner = ffn_runner(model_dir, free_port(), reform_timeout_s=1)

    with pytest.raises(AFDRendezvousTimeout) as info:
        runner.reform(AFDPeerLostError("AFD peer lost: attention rank 0 silent for 5.0s (peer_timeout_s=5)"))
    runner.shutdown()

    assert str(info.value) == (
        "AFD ffn rank 0: the attention did not return with an agreeing handshake within reform_timeout_s=1 after "
        "AFD peer lost: attention rank 0 silent for 5.0s (peer_timeout_s=5); this FFN exits. Restart the "
        "attention with the FFN's model and AFD settings within reform_timeout_s, or raise it")
