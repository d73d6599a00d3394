"""Connector registry and factory (AFD_SPEC.md §4.7): lazy ``name -> "module:Class"`` entries.

Registration imports nothing, so the plugin and the config can name connectors in processes that
never load torch. Registering a name does not make it configurable: the config's allow-list
(§2.4 step 7) decides what a user may select.
"""

from __future__ import annotations

import importlib
from typing import Any

from vllm_afd.config import AFDConfig, parse_afd_config
from vllm_afd.connectors.base import AFDConnectorBase
from vllm_afd.connectors.null import NULL_CONNECTOR
from vllm_afd.topology import compute_role_rank

__all__ = [
    "create_connector",
    "get_connector_class",
    "register_connector_type",
    "registered_connector_types",
    "resolve_role_rank",
]

# connector name -> "module:Class"; imported on first use.
_REGISTRY: dict[str, str] = {}


def register_connector_type(name: str, target: str) -> None:
    """Register ``name`` -> ``"package.module:ClassName"``; a second registration is an error."""
    module, sep, qualname = target.partition(":")
    if not (sep and module and qualname):
        raise ValueError(
            f"connector registry: target {target!r} for {name!r} is not 'module:Class'; pass e.g. "
            "'vllm_afd.connectors.gloo:P2pGlooAFDConnector'"
        )
    if name in _REGISTRY:
        raise ValueError(
            f"connector {name!r} is already registered (as {_REGISTRY[name]!r}); choose another name"
        )
    _REGISTRY[name] = target


def registered_connector_types() -> tuple[str, ...]:
    """Registered names, sorted."""
    return tuple(sorted(_REGISTRY))


def get_connector_class(name: str) -> type[AFDConnectorBase]:
    """Import and return the class registered as ``name``."""
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unsupported AFD connector type: {name}; registered: "
            f"{', '.join(registered_connector_types())}"
        ) from None
    module_name, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, AFDConnectorBase)):
        raise TypeError(
            f"connector {name!r} resolves to {target} ({obj!r}), which is not an AFDConnectorBase "
            "subclass; register a connector class"
        )
    return obj


def resolve_role_rank(vllm_config: Any, afd_config: AFDConfig) -> int:
    """§3.1 from vLLM's distributed state: global DP rank x TP size + TP rank (after init_device)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    parallel_config = vllm_config.parallel_config
    return compute_role_rank(
        afd_config.role,
        dp_rank=parallel_config.data_parallel_rank,
        tp_rank=get_tensor_model_parallel_rank(),
        tp_size=parallel_config.tensor_parallel_size,
        role_size=afd_config.num_role_ranks,
    )


def create_connector(
    rank: int,
    local_rank: int,
    vllm_config: Any,
    afd_config: AFDConfig | None = None,
    role_rank: int | None = None,
) -> AFDConnectorBase:
    """The configured connector, constructed without communication; ``NULL_CONNECTOR`` when AFD is off.

    ``afd_config`` defaults to the one parsed from ``vllm_config``; ``role_rank`` defaults to the one
    derived from vLLM's distributed ranks (so the factory needs an initialised vLLM distributed
    environment unless the caller passes it).
    """
    if afd_config is None:
        afd_config = parse_afd_config(vllm_config)
        if afd_config is None:
            return NULL_CONNECTOR
    connector_cls = get_connector_class(afd_config.connector)
    if role_rank is None:
        role_rank = resolve_role_rank(vllm_config, afd_config)
    elif not 0 <= role_rank < afd_config.num_role_ranks:
        raise ValueError(
            f"create_connector: role_rank {role_rank} is out of range for role {afd_config.role} "
            f"(num_{afd_config.role}_ranks={afd_config.num_role_ranks}); expected 0 <= role_rank < "
            f"{afd_config.num_role_ranks}"
        )
    return connector_cls(rank, local_rank, vllm_config, afd_config, role_rank)


register_connector_type("P2pNcclAFDConnector", "vllm_afd.connectors.nccl:P2pNcclAFDConnector")
register_connector_type("P2pGlooAFDConnector", "vllm_afd.connectors.gloo:P2pGlooAFDConnector")
