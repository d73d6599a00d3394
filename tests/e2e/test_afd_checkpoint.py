"""The handshake knows the model (docs/connection.md#checkpoint-digests): an FFN on other weights of the same
shapes is refused.

Two tiny Qwen3-MoE checkpoints built from one recipe with different seeds: config.json, tokenizer
and every tensor shape agree, only the weights differ.  Before checkpoint digests the attention
accepted such an FFN and served wrong tokens; now both roles refuse at the handshake, before any
data channel exists, naming both checkpoints (docs/connection.md#checkpoint-digests).
"""

from __future__ import annotations

import json
import time

import pytest

from afd_harness.afd import AFDDeployment
from afd_harness.server import ServerStartError

pytestmark = pytest.mark.e2e

# Bound on how long the FFN may take to log the refusal after the attention's start-up failed.
FFN_LOG_WAIT_S = 120.0


def wait_for_text(server, text: str, bound_s: float) -> str:
    """The server's log once it holds ``text``, or as it is after ``bound_s`` (the caller asserts)."""
    deadline = time.monotonic() + bound_s
    log = server.log_path.read_text()
    while text not in log and time.monotonic() < deadline and server.is_running():
        time.sleep(1.0)
        log = server.log_path.read_text()
    return log


def test_ffn_on_another_seed_of_the_same_checkpoint_is_refused_naming_both(tiny_model_dir, tiny_models_root,
                                                                             vllm_python, tmp_path):
    from afd_harness.tiny_models import build_tiny_model

    model = tiny_model_dir("qwen3_moe")
    other = build_tiny_model("qwen3_moe", tiny_models_root / "qwen3_moe_seed1", seed=1)
    assert json.loads((model / "config.json").read_text()) == json.loads((other / "config.json").read_text())
    afd = AFDDeployment(model, ffn_model=other, python=vllm_python, log_dir=tmp_path,
                        afd_fields={"rendezvous_timeout_s": 120})

    try:
        afd.ffn.spawn()
        afd.attention.spawn()
        with pytest.raises(ServerStartError):
            afd.attention.wait_healthy()
        ffn_log = wait_for_text(afd.ffn, "The roles loaded different checkpoints", FFN_LOG_WAIT_S)
    finally:
        afd.stop()

    attention_log = afd.attention.log_path.read_text()
    for log, local, peer in ((attention_log, "attention", "ffn"), (ffn_log, "ffn", "attention")):
        assert f"AFD configuration mismatch between {local} rank 0 and {peer} rank 0: weights_digest (" in log
        assert "config_digest (" not in log  # the same config.json on both
        assert f"attention rank 0 loaded {model} (weights sha256:" in log
        assert f"ffn rank 0 loaded {other} (weights sha256:" in log
        assert "Start both roles on the same checkpoint" in log
    assert afd.attention.process.poll() is not None
