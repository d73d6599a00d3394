"""AFD logic shared by the attention runners (V1 on CPU, Model Runner V2 on CUDA).

Be paranoid about adding lines here: every override calls `super()` plus one AFD step.
An override that starts to copy upstream code is a missing seam; add a patch instead.

Lifecycle: `__init__` builds the connector (no communication) and registers the
forward-context hook; `load_model` loads the attention half natively, then rendezvouses, so a
missing or mismatched FFN fails the server at start-up; `shutdown` runs the native shutdown,
then unhooks and closes the connector even if that raised.  A lost FFN later is healed where the
config allows it (`recover_after_fault`, attention/healing.py).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed import get_tp_group
from vllm.forward_context import ForwardContext, register_forward_context_hook

from vllm_afd.attention.healing import AttentionHealer
from vllm_afd.attention.step import (
    SIDECAR_KEY,
    AttentionStep,
    ForwardSidecar,
    register_afd_ops,
    register_step,
    unregister_step,
)
from vllm_afd.attention.step_gate import checked_output, make_step_gate
from vllm_afd.config import AFDConfig
from vllm_afd.connect import build_connector
from vllm_afd.metrics import metrics_dir
from vllm_afd.outage import outage_probe
from vllm_afd.telemetry import Telemetry
from vllm_afd.wire.placement import Placement
from vllm_afd.wire.failure import terminate_process


class AFDAttentionRunnerMixin:
    """Mixed in before the native runner class; see the module docstring."""

    # V2 publishes each step's payload from its per-step hook (so contexts arrive
    # published); V1 publishes lazily from the first AFD op of each forward context.
    afd_publishes_per_step: bool = False
    # What the send op yields to the next stage in a split step (attention/step.py): V2 hands vLLM's
    # micro-batch threads on (attention/cuda_stages.py); V1's stage contexts carry their own baton.
    afd_stage_baton: Any = None

    def __init__(self, vllm_config: Any, device: Any, afd_config: AFDConfig, placement: Placement):
        self.afd_num_stages = afd_config.num_stages  # before super(): the runners' num_ubatches reads it
        self.afd_min_tokens_per_stage = afd_config.min_tokens_per_stage
        super().__init__(vllm_config, device)
        self._afd_unhook: Any = None
        self._afd_handle: int | None = None
        self._afd_telemetry: Telemetry | None = None
        self._afd_healer: AttentionHealer | None = None
        self.afd_connector = build_connector(vllm_config, afd_config, placement, self.device,
                                             terminate=self._afd_unobserved_failure)
        try:
            if self.afd_connector.can_reform:
                self._afd_healer = AttentionHealer(self.afd_connector, afd_config.reform_timeout_s, metrics_dir())
            self._afd_telemetry = Telemetry(afd_config, placement, self.afd_connector)
            # What this runner tells the FFN each step, and the ops' way to its connector (attention/step.py).
            parallel_config = vllm_config.parallel_config
            self.afd_step = AttentionStep(self.afd_connector, parallel_config.data_parallel_size,
                                          parallel_config.data_parallel_rank)
            self._afd_handle = register_step(self.afd_step)
            tp_group = get_tp_group()
            self._afd_step_gate = make_step_gate(self.afd_connector, tp_group.world_size, tp_group.cpu_group)
            # Another TP rank's failure, seen after a step's device work (attention/step_gate.py, CheckedOutput).
            self._afd_server_failed = outage_probe(metrics_dir() if tp_group.world_size > 1 else None)
            self._afd_unhook = register_forward_context_hook(self._install_afd_sidecar)
        except BaseException:
            self._afd_teardown()
            raise

    # ---- lifecycle ----------------------------------------------------------------
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        register_afd_ops()
        super().load_model(*args, **kwargs)
        self.afd_connector.init()

    def profile_run(self, *args: Any, **kwargs: Any) -> None:
        self.afd_step.in_profile = True
        try:
            super().profile_run(*args, **kwargs)
        finally:
            self.afd_step.in_profile = False

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
        if self._afd_handle is not None:
            unregister_step(self._afd_handle)
            self._afd_handle = None
        self.afd_connector.close()
        if self._afd_telemetry is not None:
            self._afd_telemetry.close()

    # ---- healing (attention/healing.py) --------------------------------------------------
    def recover_after_fault(self) -> None:
        """vLLM's fault-tolerance retry (patch ``worker-sentinel-add-runner-recovery``): pair again
        with the FFN, or raise to end the retry (the engine stops, as without fault tolerance)."""
        if self._afd_healer is None:
            raise RuntimeError("AFD attention: this server does not heal a lost FFN (reform_timeout_s=0, or "
                               "its config hook found a blocker, logged at start-up); restart it")
        self._afd_healer.heal()

    def _afd_unobserved_failure(self, cause: BaseException) -> None:
        """The connector's fallback for a failure no step observed: re-form, or end the process."""
        if self._afd_healer is not None:
            self._afd_healer.start(cause)
        else:
            terminate_process(cause)

    # ---- check points ---------------------------------------------------------------
    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        # NOTE: a failure is raised only through the gate, at both ends of the step, on every TP rank at once
        # (attention/step_gate.py); inside the step a failed transfer fills zeros (attention/step.py).
        self._afd_step_gate.check()
        self._afd_before_step()
        self.afd_step.in_step = True
        try:
            output = super().execute_model(*args, **kwargs)
        finally:
            self.afd_step.in_step = False
            self._afd_step_gate.check()
        self._afd_telemetry.after_step()
        return output

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        # NOTE: the third check point: an asynchronous output raises the failure after vLLM waited for the step's
        # sampled tokens, so a step the abort let finish on garbage hands no token on (attention/step_gate.py).
        return checked_output(super().sample_tokens(*args, **kwargs), self.afd_connector, self._afd_server_failed)

    def _afd_before_step(self) -> None:
        """Runs once the step gate passed, before the native step (the CUDA runner re-records graphs here)."""

    def afd_mark_startup_done(self) -> None:
        """Arm the step timeouts: profile, warm-up and graph capture are over."""
        self.afd_connector.mark_startup_done()

    # ---- forward-context sidecar ------------------------------------------------------
    def _afd_context_stage(self, context: ForwardContext) -> int | None:
        """The stage a new context runs, or None when it runs no model; V1 contexts always run the model
        (its stage contexts are made by the CPU runner, with their sidecars)."""
        return 0

    def _install_afd_sidecar(self, context: ForwardContext) -> None:
        """Forward-context hook: attach this forward's sidecar. Python only: it also runs
        inside FULL CUDA-graph capture, so no device work, sync or send here."""
        stage = self._afd_context_stage(context)
        if stage is not None:
            context.additional_kwargs[SIDECAR_KEY] = ForwardSidecar(
                self._afd_handle, stage=stage, published=self.afd_publishes_per_step, baton=self.afd_stage_baton)
