"""Build native models and AFD halves in-process on CPU from tiny checkpoints.

Every build gets its own `VllmConfig` from `EngineArgs.create_engine_config()` (vLLM keys
attention and MoE layers by prefix per config, so two models cannot share one), is
constructed under `set_current_vllm_config` and loaded by vLLM's default loader, whose
strict check fails on any parameter the (filtered) checkpoint did not fill.
"""

from __future__ import annotations

import importlib.util
import pathlib
import socket
import sys
from collections.abc import Callable

import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def without_afd_plugin():
    """Keep vLLM's general-plugin loader from running the AFD plugin in this process.

    These tests build model classes directly; the plugin (model registration, config hook)
    has its own tests, and it needs the patched vLLM, which this interpreter may lack.
    """
    from importlib.metadata import entry_points

    others = [ep.name for ep in entry_points(group="vllm.general_plugins") if ep.name != "afd"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_PLUGINS", ",".join(others))
        yield


@pytest.fixture(scope="session")
def vllm_distributed(tiny_model_dirs, without_afd_plugin):
    """vLLM's world of one (gloo) and its TP/PP/EP groups, once per test process."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs

    from tests.connectors._vllm_configs import skip_without_cpu_configs

    skip_without_cpu_configs()  # every build below needs a CPU VllmConfig

    config = EngineArgs(
        model=str(tiny_model_dirs["qwen3_moe"]), enforce_eager=True, skip_tokenizer_init=True
    ).create_engine_config()
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            local_rank=0,
            backend="gloo",
        )
        ensure_model_parallel_initialized(1, 1)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, pathlib.Path]:
    """Tiny checkpoints: the shared recipes plus a local DeepSeek-V3 noaux_tc variant."""
    from models_support import build_deepseek_v3_noaux
    from afd_harness.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    dirs = {arch: build_tiny_model(arch, root / arch) for arch in ("qwen3_moe", "deepseek_v2")}
    dirs["deepseek_v2_mla"] = build_tiny_model("deepseek_v2_mla", root / "deepseek_v2_mla")
    dirs["deepseek_v3"] = build_deepseek_v3_noaux(root / "deepseek_v3")
    return dirs


@pytest.fixture(scope="session")
def build(vllm_distributed) -> Callable[..., object]:
    """`build(model_dir, model_class=None, afd=None, env=None, **engine_kwargs) -> Built`."""
    import torch
    from models_support import Built
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import (
        initialize_model,
        process_weights_after_loading,
    )
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_afd.config import parse_afd_config
    from vllm_afd.workers.common import make_role_vllm_config

    def _build(model_dir, model_class=None, afd=None, env=None, **engine_kwargs):
        with pytest.MonkeyPatch.context() as mp:
            for key, value in (env or {}).items():
                mp.setenv(key, value)
            config = EngineArgs(
                model=str(model_dir),
                enforce_eager=True,
                skip_tokenizer_init=True,
                max_model_len=256,
                max_num_batched_tokens=256,
                additional_config={} if afd is None else {"afd": afd},
                **engine_kwargs,
            ).create_engine_config()
            if afd is not None:  # as the role worker does: one parse, carried by the role runner's config
                config = make_role_vllm_config(config, parse_afd_config(config))
            with set_current_vllm_config(config), set_default_torch_dtype(config.model_config.dtype):
                model = initialize_model(vllm_config=config, model_class=model_class)
                get_model_loader(config.load_config).load_weights(model, config.model_config)
                process_weights_after_loading(model, config.model_config, torch.device("cpu"))
        return Built(model.eval(), config)

    return _build
