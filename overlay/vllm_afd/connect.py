"""From vLLM's configuration to a connector: the one place the wire package meets vLLM.

The role worker calls ``build_placement`` once (after vLLM's distributed state exists) and
passes the placement with its parsed ``AFDConfig`` to the runner, which calls ``build_connector``.
Here ``VllmConfig`` becomes the rank's ``Fingerprint`` and the plain ``ConnectorSpec``, so the
sizes a connector exchanges are the sizes its rank published and compared in the handshake.

``TRANSPORTS`` is the connector registry: a connector name (the config's ``connector`` key) maps
to a factory of its transport, called with the rank's device and the ``ConnectorSpec`` (a
preallocating transport sizes itself from it). A new transport is a file in ``wire/transports/``
plus an entry here and in ``config.CONNECTORS``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from vllm_afd.config import AFDConfig
from vllm_afd.outage import outage_notice_writer
from vllm_afd.wire.attention_end import AttentionConnector
from vllm_afd.config.secret import load_secret
from vllm_afd.wire.auth import Secret
from vllm_afd.wire.ends import make_connector
from vllm_afd.wire.ffn_end import FFNConnector
from vllm_afd.wire.handshake import Fingerprint
from vllm_afd.role import Role
from vllm_afd.wire.placement import Placement
from vllm_afd.wire.spec import ConnectorSpec
from vllm_afd.wire.transport import Transport
from vllm_afd.wire.failure import terminate_process

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "TRANSPORTS", "attention_heals", "build_connector", "build_fingerprint", "build_placement", "max_exchange_rows",
    "native_architecture", "timeline_clock",
]


def _gloo(device: torch.device, spec: ConnectorSpec | None = None) -> Transport:
    from vllm_afd.wire.transports.gloo import GlooTransport

    return GlooTransport(device)


def _nccl(device: torch.device, spec: ConnectorSpec | None = None) -> Transport:
    from vllm_afd.wire.transports.nccl import NcclTransport

    def new_unique_id() -> bytes:
        """A fresh ``ncclUniqueId``'s raw bytes (group rank 0 of each channel mints one)."""
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

        try:
            library = NCCLLibrary()
        except OSError as exc:
            raise RuntimeError(f"P2pNcclAFDConnector: the NCCL library cannot be loaded ({exc}); expected a working "
                               "NCCL. Set VLLM_NCCL_SO_PATH, or use P2pGlooAFDConnector") from exc
        return bytes(library.ncclGetUniqueId().internal)

    return NcclTransport(device, _pynccl_communicator, new_unique_id)


def _ipc(device: torch.device, spec: ConnectorSpec | None = None) -> Transport:
    from vllm_afd.wire.transports.ipc import IpcTransport, message_row_bytes

    assert spec is not None and spec.max_rows is not None, "build_connector passes max_rows (sizes the IPC slots)"
    row_bytes = message_row_bytes(spec.hidden_size, spec.dtype, spec.router_logits_width)
    return IpcTransport(device, row_bytes=row_bytes, max_rows=spec.max_rows, num_stages=spec.num_stages)


def timeline_clock(afd_config: AFDConfig, device_type: str) -> str | None:
    """The clock the connector stamps (docs/timeline.md): the host's on CPU, always (a few ns per mark;
    the metrics read it); the GPU's own timer on CUDA when ``timeline_dir`` asks for a timeline; else none."""
    if device_type == "cpu":
        return "host"
    return "device" if afd_config.timeline_dir else None


def _pynccl_communicator(unique_id: bytes, rank: int, size: int, device: torch.device) -> Any:
    """vLLM's ``PyNcclCommunicator`` from the channel's NCCL unique id (never torch's default group).

    NOTE: not on a ``StatelessProcessGroup``: its constructor ``pickle.loads`` the id from the store, which
    any store client can write. The transport exchanges the raw bytes and checks them
    (``wire/transports/nccl.py:exchange_unique_id``).
    """
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

    return PyNcclCommunicator.from_unique_id_bytes(unique_id, rank, size, device)


# Connector name -> transport factory: (the device the rank's tensors live on, the ConnectorSpec or None).
TRANSPORTS: dict[str, Callable[..., Transport]] = {
    "P2pGlooAFDConnector": _gloo,
    "P2pNcclAFDConnector": _nccl,
    "P2pIpcAFDConnector": _ipc,
}


def max_exchange_rows(vllm_config: VllmConfig) -> int:
    """Most rows one attention rank sends in one exchange: a scheduled step or a captured graph size."""
    scheduled = int(vllm_config.scheduler_config.max_num_batched_tokens)
    return max(scheduled, int(vllm_config.compilation_config.max_cudagraph_capture_size or 0))


def build_placement(vllm_config: VllmConfig, afd_config: AFDConfig) -> Placement:
    """This worker's placement from vLLM's global DP rank and TP rank (after ``init_device``)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    parallel_config = vllm_config.parallel_config
    return Placement.for_rank(
        afd_config.role,
        afd_config.num_attention_ranks,
        afd_config.num_ffn_ranks,
        dp_rank=parallel_config.data_parallel_rank,
        tp_rank=get_tensor_model_parallel_rank(),
        dp_size=parallel_config.data_parallel_size,
        tp_size=parallel_config.tensor_parallel_size,
    )


def native_architecture(architecture: str) -> str:
    """The checkpoint's architecture: the role configs name the AFD alias (``AFD<arch>``)."""
    from vllm_afd.models import AFD_MODEL_ALIASES

    if architecture in AFD_MODEL_ALIASES:
        return architecture.removeprefix("AFD")
    return architecture


def build_fingerprint(vllm_config: VllmConfig, afd_config: AFDConfig, placement: Placement) -> Fingerprint:
    """This rank's fingerprint: the configs plus a sampled digest of the checkpoint files (no communication).

    The digest reads the checkpoint (vllm_afd/checkpoint.py: its headers and a few bytes per tensor),
    so that an FFN restarted on other weights of the same shapes is refused at the handshake.
    """
    import vllm

    from vllm_afd import __version__ as overlay_version
    from vllm_afd.checkpoint import checkpoint_digest
    from vllm_afd.models.split import layer_kinds, num_routed_experts
    from vllm_afd.validation import graph_mode

    model_config = vllm_config.model_config
    load_config = vllm_config.load_config
    text_config = model_config.hf_text_config
    architecture = native_architecture(model_config.hf_config.architectures[0])
    checkpoint = checkpoint_digest(
        model_config.model, load_format=str(load_config.load_format), revision=model_config.revision,
        download_dir=load_config.download_dir,
    )
    return Fingerprint.for_rank(
        placement,
        connector=afd_config.connector,
        compute_gate_on_attention=afd_config.compute_gate_on_attention,
        num_stages=afd_config.num_stages,
        integrity=afd_config.integrity,
        max_rows=max_exchange_rows(vllm_config),
        overlay_version=overlay_version,
        vllm_version=vllm.__version__,
        architecture=architecture,
        hidden_size=int(text_config.hidden_size),
        num_hidden_layers=int(text_config.num_hidden_layers),
        dtype=str(model_config.dtype).removeprefix("torch."),
        layer_kinds=layer_kinds(text_config, architecture),
        num_routed_experts=num_routed_experts(text_config),
        graph_mode=graph_mode(vllm_config),
        config_digest=checkpoint.config_digest,
        weights_digest=checkpoint.weights_digest,
        device=str(vllm_config.device_config.device_type),
        checkpoint=checkpoint.source,
    )


def build_connector(
    vllm_config: VllmConfig, afd_config: AFDConfig, placement: Placement, device: torch.device, *,
    terminate: Callable[[BaseException], None] = terminate_process,
) -> AttentionConnector | FFNConnector:
    """The configured end for this rank's role (wire/ends.py), constructed without communication.

    ``terminate``: what an unobserved failure ends in (a healing attention re-forms instead). The shared
    secret (``VLLM_AFD_SECRET`` or ``secret_file``, wire/auth.py) is read here, before anything is taken.
    """
    found = load_secret(afd_config.secret_file)
    secret = None if found is None else Secret(*found)
    fingerprint = build_fingerprint(vllm_config, afd_config, placement)
    if afd_config.integrity and fingerprint.graph_mode != "eager":
        raise ValueError(f"AFD integrity=true checks every message on the host, so it runs eager only; got graph mode "
                         f"{fingerprint.graph_mode}. Pass --enforce-eager or leave integrity off")
    gate_on_attention = afd_config.compute_gate_on_attention
    spec = ConnectorSpec(
        name=afd_config.connector,
        hidden_size=fingerprint.hidden_size,
        dtype=vllm_config.model_config.dtype,
        device=device,
        host=afd_config.host,
        port=afd_config.port,
        rendezvous_timeout_s=afd_config.rendezvous_timeout_s,
        step_timeout_s=afd_config.step_timeout_s,
        peer_timeout_s=afd_config.peer_timeout_s,
        startup_timeout_s=afd_config.startup_timeout_s,
        exchanges_per_stage=(
            fingerprint.layer_kinds.count("M") if gate_on_attention else fingerprint.num_hidden_layers
        ),
        router_logits_width=fingerprint.num_routed_experts if gate_on_attention else None,
        use_graph_buffers=fingerprint.graph_mode != "eager",
        max_rows=max_exchange_rows(vllm_config),
        timeline_clock=timeline_clock(afd_config, device.type),
        num_stages=afd_config.num_stages,
        integrity=afd_config.integrity,
    )
    factory = TRANSPORTS[afd_config.connector]
    reform = afd_config.reform_timeout_s > 0 and (
        placement.role is Role.FFN or attention_heals(vllm_config, afd_config))
    # NOTE: the attention's API server answers 503 from the moment of the failure (outage.py).
    notice = None
    if placement.role is Role.ATTENTION:
        notice = outage_notice_writer(afd_config.reform_timeout_s if reform else None)
    return make_connector(spec, placement, factory(device, spec), fingerprint, terminate=terminate,
                          new_transport=(lambda: factory(device, spec)) if reform else None, on_failure=notice,
                          secret=secret)


def attention_heals(vllm_config: VllmConfig, afd_config: AFDConfig) -> bool:
    """Whether this attention re-forms after a lost FFN (docs/connection.md#healing-attention): vLLM's fault
    tolerance is on and nothing blocks healing.  The config hook asked the same question, but before the
    platform resolved the graph mode, so the worker asks again with the final config."""
    from vllm_afd.validation import healing_blocker

    return bool(vllm_config.parallel_config.enable_fault_tolerance) and healing_blocker(vllm_config, afd_config) is None
