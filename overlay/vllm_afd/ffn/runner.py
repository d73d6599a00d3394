"""`AFDFFNModelRunner`: the FFN role's runner, ours and device-neutral (AFD_SPEC §6).

Built by the FFN worker's `_make_model_runner` (no native runner is built and thrown
away).  It owns the FFN half of the model, the connector and the CUDA-graph cache; the
daemon loop (loop.py) feeds it one control payload per attention step.  Per step it
opens one forward context of its own (vLLM's public `create_forward_context` +
`override_forward_context`) and, layer-major and stage-minor, receives the peers' rows,
runs the layer's native MLP/MoE block and sends the result back.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.forward_context import create_forward_context, override_forward_context

from vllm_afd.config import require_afd_config
from vllm_afd.ffn.graphs import FFNGraphCache, graph_key, run_mode
from vllm_afd.validation import graph_mode


class AFDFFNModelRunner:
    """Model, connector and per-step compute of one FFN worker."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.device = device
        self.afd_config = require_afd_config(vllm_config, "AFDFFNModelRunner",
                                             expected_role="ffn")
        self.use_cuda_graph = graph_mode(vllm_config) != "eager"
        self.num_hidden_layers = self.model_config.hf_text_config.num_hidden_layers
        self.model: Any = None
        self._moe_position: dict[int, int] = {}  # layer index -> index among MoE layers
        self.kv_caches: list[torch.Tensor] = []  # read by CPUWorker; the FFN has none
        self.graphs = FFNGraphCache(device) if self.use_cuda_graph else None
        self.connector = _create_connector(vllm_config, self.afd_config)
        if self.connector.control_plane is None:
            raise NotImplementedError(
                "GPU FFN only supports control-plane-driven connectors; connectors "
                "without a control plane (control_plane is None) are not supported."
            )

    # ---- native worker surface ------------------------------------------------------
    def load_model(self, load_dummy_weights: bool = False, **kwargs: Any) -> None:
        from vllm.model_executor.model_loader import get_model

        if load_dummy_weights:
            raise ValueError("AFDFFNModelRunner: dummy weights (elastic EP) are not "
                             "supported; start the FFN with real weights.")
        self.model = get_model(vllm_config=self.vllm_config)
        self._moe_position = {
            layer_idx: position
            for position, layer_idx in enumerate(self.model.get_experts_layer_indices())
        }

    def get_model(self) -> torch.nn.Module:
        return self.model

    def get_kv_cache_spec(self) -> dict[str, Any]:
        return {}

    def get_supported_tasks(self) -> tuple[str, ...]:
        # NOTE: "generate" keeps vLLM registering the generation routes, which the
        # FFN's request veto answers with a pointer to the attention server.
        return ("generate",)

    def update_max_model_len(self, max_model_len: int) -> None:
        self.model_config.max_model_len = max_model_len

    def sample_tokens(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("FFN runners do not sample tokens")

    # The FFN holds no caches, LoRAs, drafts or encoders: vLLM's engine-wide utility
    # calls (API-server start-up resets, LoRA listing) answer as for an empty runner.
    is_pooling_model = False

    def reset_mm_cache(self) -> None:
        return None

    def reset_encoder_cache(self) -> None:
        return None

    def get_encoder_timing_stats(self) -> dict[str, Any]:
        return {}

    def take_draft_token_ids(self) -> None:
        return None

    def add_lora(self, lora_request: Any) -> bool:
        return False

    def remove_lora(self, lora_id: int) -> bool:
        return False

    def pin_lora(self, lora_id: int) -> bool:
        return False

    def list_loras(self) -> set[int]:
        return set()

    def reload_weights(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("AFDFFNModelRunner: reload_weights() is not supported; restart "
                           "both AFD roles with the new weights.")

    # ---- loop surface ---------------------------------------------------------------
    def init_connector(self) -> None:
        """Rendezvous with the attention ranks (blocks up to rendezvous_timeout_s)."""
        self.connector.init_afd_connector()

    def recv_control_payload(self) -> Any:
        """The next step's payload; None once the connector was closed by shutdown."""
        if not self.connector.is_initialized:
            return None
        return self.connector.control_plane.recv_dp_metadata_list()

    def run_step(self, payload: Any) -> None:
        with torch.inference_mode(), set_current_vllm_config(self.vllm_config):
            if payload.is_warmup or payload.is_graph_capturing:
                self.capture_model(payload)
            else:
                self.execute_model(payload)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # errors surface in this step
        self.connector.control_plane.mark_step_done()

    def execute_model(self, payload: Any) -> torch.Tensor | None:
        if not payload.dp_metadata_list:
            raise RuntimeError("AFDFFNModelRunner requires dp_metadata_list")
        key = graph_key(payload.dp_metadata_list)
        has_graph = self.graphs is not None and self.graphs.has(key)
        if run_mode(payload, use_cuda_graph=self.use_cuda_graph, has_graph=has_graph) == "REPLAY":
            # The receive buffers the graph recorded are keyed by shape and never evicted.
            self.connector.update_state_from_dp_metadata(payload)
            return self.graphs.replay(key)
        return self._ffn_forward(payload, update_connector_state=True)

    def capture_model(self, payload: Any) -> int:
        """Warm-up payload: one eager step; capture payload: record this step's graph."""
        if not payload.dp_metadata_list:
            raise RuntimeError("AFDFFNModelRunner.capture_model requires metadata")
        if self.graphs is None:
            from vllm_afd.errors import AFDProtocolError

            raise AFDProtocolError("attention is capturing CUDA graphs but this FFN runs "
                                   "eager; launch both roles with the same graph mode")
        self.connector.update_state_from_dp_metadata(payload)
        if payload.is_warmup:
            self._ffn_forward(payload, update_connector_state=False)
            return 0
        self.graphs.capture(graph_key(payload.dp_metadata_list),
                            lambda: self._ffn_forward(payload, update_connector_state=False))
        return 1

    def _ffn_forward(self, payload: Any, *, update_connector_state: bool) -> torch.Tensor:
        if update_connector_state:
            self.connector.update_state_from_dp_metadata(payload)
        gate_on_attention = self.afd_config.compute_gate_on_attention
        layers = (self.model.get_experts_layer_indices() if gate_on_attention
                  else range(self.num_hidden_layers))
        stages = sorted(payload.dp_metadata_list)
        context = create_forward_context(None, self.vllm_config)
        output = None
        with override_forward_context(context):
            for layer_idx in layers:
                routing_spec = (self.model.get_experts_routing_spec(layer_idx)
                                if gate_on_attention else None)
                for stage_idx in stages:
                    received = self.connector.recv_attn_output(stage_idx, routing_spec)
                    # vLLM's fast-MoE cold start pops MoE layer names in call order;
                    # this context is ours, so point it at this layer (AFD_SPEC §9.10).
                    context.moe_layer_index = self._moe_position.get(layer_idx, 0)
                    if gate_on_attention:
                        output = self.model.compute_experts_output(
                            received.hidden_states, layer_idx, received.router_logits)
                    else:
                        output = self.model.compute_ffn_output(received.hidden_states,
                                                               layer_idx)
                    self.connector.send_ffn_output(output, received.context)
        return output

    # ---- teardown ---------------------------------------------------------------------
    def close_connector(self) -> None:
        self.connector.close()

    def shutdown(self) -> None:
        """Drop graphs and model; close the connector last, even if dropping raised."""
        try:
            if self.graphs is not None:
                self.graphs.clear()
            self.model = None
        finally:
            self.connector.close()


def _create_connector(vllm_config: VllmConfig, afd_config: Any) -> Any:
    from vllm.distributed.parallel_state import get_world_group

    from vllm_afd.connectors.factory import create_connector

    world = get_world_group()
    return create_connector(world.rank, world.local_rank, vllm_config, afd_config)
