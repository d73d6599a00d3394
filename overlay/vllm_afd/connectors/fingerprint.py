"""What a rank asserts about itself, read from the real ``VllmConfig`` (AFD_SPEC.md §3.7).

``build_fingerprint`` fills the handshake's ``Fingerprint``; ``settings_from_config`` turns the same
facts into the plain ``P2pSettings`` the protocol runs on, so the sizes a connector exchanges are the
sizes its rank published and compared.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_afd.config import AFDConfig
from vllm_afd.handshake import Fingerprint

if TYPE_CHECKING:
    import torch

    from vllm_afd.connectors.channels import P2pSettings

__all__ = ["build_fingerprint", "native_architecture", "settings_from_config"]


def native_architecture(architecture: str) -> str:
    """The checkpoint's architecture: the role configs name the AFD alias (``AFD<arch>``)."""
    from vllm_afd.models import AFD_MODEL_ALIASES

    if architecture in AFD_MODEL_ALIASES:
        return architecture.removeprefix("AFD")
    return architecture


def build_fingerprint(vllm_config: Any, afd_config: AFDConfig, role: str, role_rank: int) -> Fingerprint:
    """This rank's fingerprint; pure computation on the configs (no communication)."""
    import vllm

    from vllm_afd import __version__ as overlay_version
    from vllm_afd.models.split import layer_kinds, num_routed_experts
    from vllm_afd.validation import graph_mode

    if role != afd_config.role:
        raise ValueError(
            f"build_fingerprint: role {role!r} differs from the AFD config's role {afd_config.role!r}; "
            "expected the role this process runs. Pass afd_config.role"
        )
    model_config = vllm_config.model_config
    text_config = model_config.hf_text_config
    architecture = native_architecture(model_config.hf_config.architectures[0])
    parallel_config = vllm_config.parallel_config
    return Fingerprint.for_rank(
        afd_config,
        role_rank=role_rank,
        dp_size=parallel_config.data_parallel_size,
        tp_size=parallel_config.tensor_parallel_size,
        overlay_version=overlay_version,
        vllm_version=vllm.__version__,
        architecture=architecture,
        hidden_size=int(text_config.hidden_size),
        num_hidden_layers=int(text_config.num_hidden_layers),
        dtype=str(model_config.dtype).removeprefix("torch."),
        layer_kinds=layer_kinds(text_config, architecture),
        num_routed_experts=num_routed_experts(text_config),
        graph_mode=graph_mode(vllm_config),
        device=str(vllm_config.device_config.device_type),
    )


def settings_from_config(
    vllm_config: Any,
    afd_config: AFDConfig,
    fingerprint: Fingerprint,
    device: torch.device,
    connector_name: str,
) -> P2pSettings:
    """The protocol's plain settings for the rank ``fingerprint`` describes."""
    from vllm_afd.connectors.channels import P2pSettings

    crossing_layers = (
        fingerprint.layer_kinds.count("M") if afd_config.compute_gate_on_attention else fingerprint.num_hidden_layers
    )
    return P2pSettings(
        role=fingerprint.role,
        role_rank=fingerprint.role_rank,
        num_attention_ranks=afd_config.num_attention_ranks,
        num_ffn_ranks=afd_config.num_ffn_ranks,
        hidden_size=fingerprint.hidden_size,
        dtype=vllm_config.model_config.dtype,
        device=device,
        host=afd_config.host,
        port=afd_config.port,
        rendezvous_timeout_s=afd_config.rendezvous_timeout_s,
        step_timeout_s=afd_config.step_timeout_s,
        peer_timeout_s=afd_config.peer_timeout_s,
        compute_gate_on_attention=afd_config.compute_gate_on_attention,
        dp_size=fingerprint.dp_size,
        exchanges_per_stage=crossing_layers,
        num_routed_experts=fingerprint.num_routed_experts or None,
        use_graph_buffers=fingerprint.graph_mode != "eager",
        connector_name=connector_name,
    )
