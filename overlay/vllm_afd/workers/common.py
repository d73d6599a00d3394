"""What the AFD role workers share: start-up checks, the placement and the role runner's config.

A role worker differs from its native parent in two places only: `init_device` parses and
checks the AFD config before any native resource exists (the one parse in the worker process),
and `_make_model_runner` (patch `worker-add-make-model-runner`) builds the role's runner
instead of the native one, handing it the parsed config and the rank's `Placement`.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from vllm_afd.config import AFDConfig, ParsedAdditionalConfig, require_afd_config

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def check_worker_start(vllm_config: VllmConfig, worker_name: str, role: str,
                       platform: str) -> AFDConfig:
    """Config, worker stack and feature checks, before any resource.

    The checks in order: docs/config.md#worker-start-checks.
    """
    from vllm_afd.validation import check_features, check_worker_stack

    afd = require_afd_config(vllm_config, worker_name, expected_role=role)
    check_worker_stack(vllm_config.parallel_config.worker_cls, platform, role)
    check_features(vllm_config, afd, platform)
    return afd


def make_role_vllm_config(vllm_config: VllmConfig, afd_config: AFDConfig) -> VllmConfig:
    """A config for the role runner: the model config names the AFD alias class, and
    `additional_config` carries the worker's parse down to the model (`afd_config_of`).

    NOTE: both copies are ours (a deep-copied model config inside a shallow `VllmConfig`
    copy that does not re-run validation), so nothing vLLM owns is modified; the deep
    copy keeps `hf_text_config is hf_config`, which the alias classes rely on.
    """
    from vllm_afd.models import alias_for

    model_config = copy.deepcopy(vllm_config.model_config)
    native = model_config.hf_config.architectures[0]
    model_config.hf_config.architectures = [alias_for(native)]
    role_config = copy.copy(vllm_config)
    role_config.model_config = model_config
    role_config.additional_config = ParsedAdditionalConfig(vllm_config.additional_config, afd_config)
    return role_config


def make_role_runner(runner_cls: type, vllm_config: VllmConfig, afd_config: AFDConfig, device: Any) -> Any:
    """The role's runner: its config copy, the parsed config, and this rank's placement (built once)."""
    from vllm_afd.connect import build_placement

    placement = build_placement(vllm_config, afd_config)
    return runner_cls(make_role_vllm_config(vllm_config, afd_config), device, afd_config, placement)
