"""Release-gated behaviour of the plugin and the workers: a release without Model Runner V1 (vLLM 0.34) refuses
the CPU attention role in the config hook, before anything is chosen, and its CUDA worker never asks for V1."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_afd import releases

WITHOUT_V1 = next(release for release in releases.RELEASES if not release.has_model_runner_v1)


def hook_config(role: str) -> SimpleNamespace:
    return SimpleNamespace(additional_config={"afd": {"role": role, "connector": "P2pGlooAFDConnector"}},
                           parallel_config=SimpleNamespace(worker_cls="auto"))


def test_the_config_hook_refuses_the_cpu_attention_role_without_model_runner_v1_before_choosing_a_worker(
        monkeypatch):
    pytest.importorskip("vllm")
    from vllm_afd import metrics, plugin

    monkeypatch.setattr(plugin, "current_platform_name", lambda: "cpu")
    monkeypatch.setattr(metrics, "expose_worker_metrics", lambda: None)
    monkeypatch.setattr(releases, "installed", lambda: WITHOUT_V1)
    config = hook_config("attention")

    with pytest.raises(RuntimeError, match=r"needs vLLM's V1 CPU runner, which vLLM 0\.34\.0 removed"):
        plugin.apply_afd_config(config)

    assert config.parallel_config.worker_cls == "auto"


def test_the_cuda_attention_worker_asks_for_model_runner_v2_only_where_v1_exists(monkeypatch):
    pytest.importorskip("vllm")
    from vllm_afd.workers import cuda

    monkeypatch.setattr(cuda, "check_worker_start", lambda *a: "afd")
    monkeypatch.setattr(cuda, "installed", lambda: WITHOUT_V1)
    monkeypatch.setattr(cuda.Worker, "init_device", lambda self: None)
    worker = object.__new__(cuda.AFDAttentionWorker)  # no `use_v2_model_runner`, as on 0.34
    worker.vllm_config = None

    worker.init_device()

    assert worker.afd_config == "afd"
