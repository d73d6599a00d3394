"""The transport custom ops at the attention proxy boundary (AFD_SPEC.md §4.6, §5.3-5.4).

vLLM compiles the model with Dynamo guards dropped, so Python state read inside the compiled module
is frozen at trace time. The proxy therefore calls two opaque ops, ``torch.ops.vllm_afd.afd_send``
and ``torch.ops.vllm_afd.afd_recv``, whose tensor arguments are declared mutated (compile neither
drops nor reorders them) and whose only other argument is the trace-stable layer index. Everything
per-step runs inside the real implementations at every call: reading the forward-context sidecar,
finding the connector by its integer handle (custom ops cannot take objects), the lazy publish of
the step's control payload on the V1 runner, the row checks and the transfer. Fake impls no-op.
"""

import itertools
import threading
from typing import Any, Optional

import torch

from vllm_afd.connectors.base import AFDConnectorBase
from vllm_afd.connectors.metadata import AFDForwardContextMetadata, AFDTransferContext, AFDTransferMetadata

__all__ = [
    "NAMESPACE",
    "SIDECAR_KEY",
    "get_connector",
    "register_afd_ops",
    "register_connector",
    "unregister_connector",
]

NAMESPACE = "vllm_afd"
# Key of the sidecar in forward_context.additional_kwargs (§5.4).
SIDECAR_KEY = "afd_metadata"

_lock = threading.Lock()
# Keeps the op library alive for the process's lifetime; None until registered.
_library: Optional[torch.library.Library] = None
# handle -> connector; handles are never reused within a process.
_connectors: dict[int, AFDConnectorBase] = {}
_handles = itertools.count(1)


# ---- connector registry ----------------------------------------------------------------------------


def register_connector(connector: AFDConnectorBase) -> int:
    """Register ``connector``; returns the integer handle the sidecar carries into the ops."""
    with _lock:
        handle = next(_handles)
        _connectors[handle] = connector
    return handle


def unregister_connector(handle: int) -> None:
    """Forget ``handle``; unknown handles are ignored so teardown paths may repeat it."""
    with _lock:
        _connectors.pop(handle, None)


def get_connector(handle: int) -> AFDConnectorBase:
    try:
        return _connectors[handle]
    except KeyError:
        raise RuntimeError(
            f"AFD communicator id {handle} is not registered (registered: {sorted(_connectors)}); expected "
            "the id the attention runner registered for its connector. The runner unregisters it at "
            "shutdown: no forward may run after that"
        ) from None


# ---- op bodies ---------------------------------------------------------------------------------------


def _sidecar() -> tuple[Any, AFDForwardContextMetadata]:
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        raise RuntimeError(
            "RemoteFFNProxy requires AFD forward metadata (no vLLM forward context is set); expected the "
            "model to run inside the AFD attention runner's forward"
        )
    context = get_forward_context()
    metadata = context.additional_kwargs.get(SIDECAR_KEY)
    if not isinstance(metadata, AFDForwardContextMetadata):
        raise RuntimeError(
            f"RemoteFFNProxy requires AFD forward metadata (additional_kwargs[{SIDECAR_KEY!r}] is "
            f"{type(metadata).__name__}); expected the AFD runner's forward-context hook to install an "
            "AFDForwardContextMetadata"
        )
    return context, metadata


def _publish(connector: AFDConnectorBase, context: Any, metadata: AFDForwardContextMetadata,
             hidden: torch.Tensor) -> None:
    """V1 publish rule (§5.3): the first AFD op of a forward context sends that step's payload."""
    control_plane = connector.control_plane
    if control_plane is None:
        raise RuntimeError(
            f"{type(connector).__name__} has no control plane (control_plane is None); the AFD attention "
            "runner requires a control-plane-driven connector"
        )
    if metadata.num_stages != 1:
        raise RuntimeError(
            f"AFD lazy publish supports one stage per forward, got num_stages={metadata.num_stages}; "
            "microbatched steps must publish from the runner's per-step hook"
        )
    if connector.dp_size > 1:
        if context.dp_metadata is None:
            raise RuntimeError(
                f"AFD expected vLLM DPMetadata for attention DP > 1 (DP size {connector.dp_size}, the "
                "forward context has none); expected vLLM's MoE DP engine to set dp_metadata"
            )
        counts = [int(n) for n in context.dp_metadata.num_tokens_across_dp_cpu]
    else:
        counts = [int(hidden.shape[0])]
    control_plane.send_dp_metadata({metadata.stage_idx: counts}, is_profile=metadata.is_profile)
    metadata.published = True


def _afd_send_impl(hidden: torch.Tensor, router_logits: Optional[torch.Tensor], layer_idx: int) -> None:
    context, metadata = _sidecar()
    connector = get_connector(metadata.connector_handle)
    connector.check_failed()
    if not metadata.published:
        _publish(connector, context, metadata, hidden)
    transfer = AFDTransferMetadata.create_attention_metadata(layer_idx, metadata.stage_idx, int(hidden.shape[0]))
    connector.send_attn_output(hidden, AFDTransferContext(transfer), router_logits)


def _afd_send_fake(hidden: torch.Tensor, router_logits: Optional[torch.Tensor], layer_idx: int) -> None:
    return None


def _afd_recv_impl(out: torch.Tensor, layer_idx: int) -> None:
    _, metadata = _sidecar()
    connector = get_connector(metadata.connector_handle)
    result = connector.recv_ffn_output(out, metadata.stage_idx)
    if result is not out:
        out.copy_(result)


def _afd_recv_fake(out: torch.Tensor, layer_idx: int) -> None:
    return None


def register_afd_ops() -> None:
    """Define ``vllm_afd::afd_send`` and ``vllm_afd::afd_recv`` once per process (later calls no-op)."""
    global _library
    with _lock:
        if _library is not None:
            return
        from vllm.utils.torch_utils import direct_register_custom_op

        library = torch.library.Library(NAMESPACE, "FRAGMENT")
        direct_register_custom_op(
            op_name="afd_send",
            op_func=_afd_send_impl,
            mutates_args=["hidden", "router_logits"],
            fake_impl=_afd_send_fake,
            target_lib=library,
        )
        direct_register_custom_op(
            op_name="afd_recv",
            op_func=_afd_recv_impl,
            mutates_args=["out"],
            fake_impl=_afd_recv_fake,
            target_lib=library,
        )
        _library = library
