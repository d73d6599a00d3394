"""AFD configuration: ``additional_config["afd"]`` parsed once into a frozen ``AFDConfig``.

The only channel is vLLM's ``additional_config`` (docs/config.md#activation-and-sources): the presence
of ``afd`` activates AFD, and a present config must validate, never silently deactivate. Parsing
follows the fixed order of docs/config.md#validation-order and stops at the first failure, so a user
sees the same message whatever else is wrong. The role worker parses once per process and hands the
result down (``ParsedAdditionalConfig``, ``afd_config_of``). This package imports neither torch nor
vLLM: vLLM's plugin loader imports the overlay in every process, and every check here must finish
before any socket, group or device memory is taken.

Import every name from here. ``constants`` (the key, roles, connectors, aliases, stage counts),
``coercion`` (step 4), ``rules`` (steps 5-12 on coerced values), ``fields`` (``AFDConfig``: the
fields, steps 2-3 on the keys) and ``sources`` (where ``additional_config`` comes from, the parse
entry points and the one parse handed down).
"""

from __future__ import annotations

from vllm_afd.config.constants import (AFD_KEY, ALIASES, CAM_CONNECTORS, CONNECTOR_HINT, CONNECTORS,
                                       DEFAULT_MIN_TOKENS_PER_STAGE, NUM_STAGES, ROLES, RUNTIME_ONLY_FIELDS)
from vllm_afd.config.fields import FIELD_NAMES, AFDConfig
from vllm_afd.config.rules import check_p2p_extra_config
from vllm_afd.config.sources import (ParsedAdditionalConfig, afd_config_of, get_additional_config,
                                     parse_afd_config, require_afd_config)

__all__ = [
    "AFD_KEY",
    "ALIASES",
    "AFDConfig",
    "CAM_CONNECTORS",
    "CONNECTORS",
    "CONNECTOR_HINT",
    "FIELD_NAMES",
    "DEFAULT_MIN_TOKENS_PER_STAGE",
    "NUM_STAGES",
    "ROLES",
    "RUNTIME_ONLY_FIELDS",
    "check_p2p_extra_config",
    "get_additional_config",
    "ParsedAdditionalConfig",
    "afd_config_of",
    "parse_afd_config",
    "require_afd_config",
]
