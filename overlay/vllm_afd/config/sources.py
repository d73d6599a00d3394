"""Where the config comes from (docs/config.md#activation-and-sources), and the worker's one parse handed down."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_afd.config.constants import AFD_KEY
from vllm_afd.config.fields import AFDConfig


def get_additional_config(src: Any) -> Mapping[Any, Any] | None:
    """Return ``additional_config`` of ``src`` (a mapping, an object with the attribute, or None)."""
    if src is None:
        return None
    if isinstance(src, Mapping):
        additional = src
    else:
        try:
            additional = src.additional_config
        except AttributeError as exc:
            raise AttributeError(
                f"AFD config source: {type(src).__name__} has no attribute 'additional_config'; "
                "expected a VllmConfig, EngineArgs, the additional_config mapping or None"
            ) from exc
    if additional is None:
        return None
    if not isinstance(additional, Mapping):
        raise TypeError(
            f"additional_config must be a mapping, got {type(additional).__name__}; pass "
            """--additional-config as a JSON object, e.g. '{"afd": {"role": "attention"}}'"""
        )
    return additional


def parse_afd_config(src: Any, expected_role: str | None = None) -> AFDConfig | None:
    """The validated config, or None when ``afd`` is absent; a present invalid config raises."""
    additional = get_additional_config(src)
    if additional is None or AFD_KEY not in additional:
        return None
    return AFDConfig.from_mapping(additional[AFD_KEY], expected_role=expected_role)


class ParsedAdditionalConfig(dict):
    """``additional_config`` of a role runner's own ``VllmConfig`` copy: the user's mapping plus the parse.

    Configuration enters a worker process once: the role worker parses ``additional_config["afd"]``
    and passes the result down. vLLM builds the model from a ``VllmConfig`` alone
    (``get_model(vllm_config=...)``), so the parse reaches the model halves inside the runner's config
    copy (workers/common.py) and ``afd_config_of`` hands it out without parsing again. A ``dict``
    with the same items: vLLM hashes a dict-valued ``additional_config`` as the JSON of its items.
    """

    __slots__ = ("afd_config",)

    def __init__(self, items: Mapping[Any, Any], afd_config: AFDConfig) -> None:
        super().__init__(items)
        self.afd_config = afd_config

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (dict(self), self.afd_config))


def afd_config_of(src: Any, caller: str) -> AFDConfig:
    """The worker's parse carried by a role runner's config; never a second parse."""
    additional = get_additional_config(src)
    if additional is None or AFD_KEY not in additional:
        raise _afd_required(caller)
    assert isinstance(additional, ParsedAdditionalConfig), (
        f"{caller}: additional_config['afd'] is parsed once per worker and reaches the model inside the role "
        "runner's config (workers/common.py, make_role_vllm_config); build the model from that config"
    )
    return additional.afd_config


def require_afd_config(src: Any, caller: str, expected_role: str | None = None) -> AFDConfig:
    """Like ``parse_afd_config`` for code that only makes sense under AFD (e.g. an AFD worker class)."""
    afd_config = parse_afd_config(src, expected_role=expected_role)
    if afd_config is None:
        raise _afd_required(caller)
    return afd_config


def _afd_required(caller: str) -> ValueError:
    return ValueError(
        f'{caller} requires additional_config["afd"]; pass --additional-config '
        """'{"afd": {"role": ...}}' or drop the AFD-specific setting"""
    )
