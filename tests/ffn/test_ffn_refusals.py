"""The FFN role's documented refusals (docs/ffn.md#worker-surface-and-refusals, docs/failures.md rows 25-27).

Each test pins what is refused, where (the worker or runner call) and what to do instead.  The FFN
worker mixin runs over a base of our own; the FFN runner is the real one, built on a real VllmConfig
of a config-only tiny Qwen3-MoE (constructing it communicates nothing).
"""

from __future__ import annotations


import pytest

pytest.importorskip("vllm")
from tests.connectors._vllm_configs import make_vllm_config, write_tiny_model

from vllm_afd.config import parse_afd_config
from vllm_afd.ffn.worker import FFNWorkerMixin


class Worker(FFNWorkerMixin):
    """The mixin over a base of our own: only the refusals are under test here."""


def kv_cache_config(num_groups: int):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    groups = [KVCacheGroupSpec(layer_names=[f"model.layers.{i}.self_attn"], kv_cache_spec=spec)
              for i in range(num_groups)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def test_a_kv_cache_planned_for_the_ffn_is_refused_naming_the_groups():
    with pytest.raises(RuntimeError) as info:
        Worker().initialize_from_config(kv_cache_config(2))

    assert str(info.value) == (
        "AFD FFN worker: the engine planned a KV cache (2 groups); expected none because FFN workers report an "
        "empty KV-cache spec.")


def test_an_empty_kv_cache_plan_is_accepted():
    Worker().initialize_from_config(kv_cache_config(0))


@pytest.fixture
def ffn_runner(tmp_path):
    import torch

    from vllm_afd.ffn.runner import AFDFFNModelRunner
    from vllm_afd.wire.placement import Placement
    from vllm_afd.workers.common import make_role_vllm_config

    vllm_config = make_vllm_config(write_tiny_model(tmp_path / "qwen"), role="ffn", connector="P2pGlooAFDConnector")
    afd_config = parse_afd_config(vllm_config)
    runner = AFDFFNModelRunner(make_role_vllm_config(vllm_config, afd_config), torch.device("cpu"), afd_config,
                               Placement("ffn", 0, 1, 1))
    yield runner
    runner.shutdown()


def test_the_ffn_runner_refuses_dummy_weights_before_loading_anything(ffn_runner):
    with pytest.raises(ValueError) as info:
        ffn_runner.load_model(load_dummy_weights=True)

    assert ffn_runner.model is None
    assert str(info.value) == (
        "AFDFFNModelRunner: dummy weights (elastic EP) are not supported; start the FFN with real weights.")


def test_the_ffn_runner_refuses_to_reload_weights_and_says_to_restart_both_roles(ffn_runner):
    with pytest.raises(RuntimeError) as info:
        ffn_runner.reload_weights()

    assert str(info.value) == (
        "AFDFFNModelRunner: reload_weights() is not supported; restart both AFD roles with the new weights.")


@pytest.mark.parametrize("flag", ["is_graph_capturing", "is_warmup"])
def test_an_eager_ffn_refuses_a_capture_payload_naming_the_fix(ffn_runner, flag):
    """docs/failures.md row 26: the handshake's graph_mode prevents it; the runner refuses it anyway."""
    from vllm_afd.wire.errors import AFDProtocolError
    from vllm_afd.wire.messages import ControlPayload

    with pytest.raises(AFDProtocolError) as info:
        ffn_runner.run_step(ControlPayload({0: (4,)}, **{flag: True}))

    assert str(info.value) == (
        "attention is capturing CUDA graphs but this FFN runs eager; launch both roles with the same graph mode")
