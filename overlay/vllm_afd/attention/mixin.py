"""AFD logic shared by the attention runners (V1 on CPU, Model Runner V2 on CUDA).

Be paranoid about adding lines here: every override calls `super()` plus one AFD step.
An override that starts to copy upstream code is a missing seam; add a patch instead.

Lifecycle (AFD_SPEC §5.2): `__init__` builds the connector (no communication) and
registers the forward-context hook; `load_model` loads the attention half natively, then
rendezvouses, so a missing or mismatched FFN fails the server at start-up; `shutdown`
runs the native shutdown, then unhooks and closes the connector even if that raised.
"""

from __future__ import annotations

import itertools
from typing import Any

from vllm.distributed.parallel_state import get_world_group
from vllm.forward_context import ForwardContext, register_forward_context_hook

from vllm_afd.config import require_afd_config
from vllm_afd.connectors.factory import create_connector
from vllm_afd.connectors.metadata import AFDForwardContextMetadata
from vllm_afd.connectors.ops import register_afd_ops, register_connector, unregister_connector

SIDECAR_KEY = "afd_metadata"


class AFDAttentionRunnerMixin:
    """Mixed in before the native runner class; see the module docstring."""

    # V2 publishes each step's payload from its per-step hook (so contexts arrive
    # published); V1 publishes lazily from the first AFD op of each forward context.
    afd_publishes_per_step: bool = False

    def __init__(self, vllm_config: Any, device: Any):
        super().__init__(vllm_config, device)
        self.afd_connector: Any = None
        self._afd_unhook: Any = None
        self.afd_connector_handle: int | None = None
        try:
            self.afd_config = require_afd_config(vllm_config, type(self).__name__,
                                                 expected_role="attention")
            world = get_world_group()
            self.afd_connector = create_connector(world.rank, world.local_rank,
                                                  vllm_config, self.afd_config)
            if self.afd_connector.control_plane is None:
                raise RuntimeError(
                    "AFD ModelRunnerV2 requires a control-plane-driven connector")
            self.afd_connector_handle = register_connector(self.afd_connector)
            self._afd_in_profile = False
            self._afd_transaction_ids = itertools.count()
            self._afd_unhook = register_forward_context_hook(self._install_afd_metadata)
        except BaseException:
            self._afd_teardown()
            raise

    # ---- lifecycle ----------------------------------------------------------------
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        register_afd_ops()
        super().load_model(*args, **kwargs)
        self.afd_connector.init_afd_connector()

    def profile_run(self, *args: Any, **kwargs: Any) -> None:
        self._afd_in_profile = True
        try:
            super().profile_run(*args, **kwargs)
        finally:
            self._afd_in_profile = False

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self._afd_teardown()

    def _afd_teardown(self) -> None:
        """Unhook and close; safe after a partial `__init__` and when repeated."""
        unhook, self._afd_unhook = self._afd_unhook, None
        if unhook is not None:
            unhook()
        if self.afd_connector_handle is not None:
            unregister_connector(self.afd_connector_handle)
            self.afd_connector_handle = None
        if self.afd_connector is not None:
            self.afd_connector.close()

    # ---- check points (AFD_SPEC §5.7) -----------------------------------------------
    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        self.afd_connector.check_failed()
        output = super().execute_model(*args, **kwargs)
        self.afd_connector.check_failed()
        self.afd_connector.control_plane.mark_step_done()
        return output

    def afd_mark_startup_done(self) -> None:
        """Arm the step timeouts: profile, warm-up and graph capture are over."""
        self.afd_connector.control_plane.mark_startup_done()

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        self.afd_connector.check_failed()
        return super().sample_tokens(*args, **kwargs)

    # ---- forward-context sidecar (AFD_SPEC §5.4) ------------------------------------
    def _afd_context_runs_model(self, context: ForwardContext) -> bool:
        """Whether a context will run the model; V1 contexts always do."""
        return True

    def _install_afd_metadata(self, context: ForwardContext) -> None:
        """Forward-context hook: attach this step's sidecar. Python only: it also runs
        inside FULL CUDA-graph capture, so no device work, sync or send here."""
        if not self._afd_context_runs_model(context):
            return
        num_tokens = _context_num_tokens(context, self.afd_dp_rank)
        context.additional_kwargs[SIDECAR_KEY] = AFDForwardContextMetadata(
            tokens_start_loc=[0],
            requests_start_loc=[0],
            stage_idx=0,
            num_stages=1,
            tokens_lens=[num_tokens],
            tokens_unpadded_lens=[num_tokens],
            transaction_id=f"afd-{next(self._afd_transaction_ids)}",
            connector_handle=self.afd_connector_handle,
            published=self.afd_publishes_per_step,
            is_profile=self._afd_in_profile,
        )

    @property
    def afd_dp_rank(self) -> int:
        return self.vllm_config.parallel_config.data_parallel_rank


def _context_num_tokens(context: ForwardContext, dp_rank: int) -> int:
    """This DP rank's row count if the context knows it, clamped to >= 1."""
    if context.dp_metadata is not None:
        return max(1, int(context.dp_metadata.num_tokens_across_dp_cpu[dp_rank]))
    if context.batch_descriptor is not None:
        return max(1, int(context.batch_descriptor.num_tokens))
    return 1
