"""`AFDFFNModelRunner`: the FFN role's runner, ours and device-neutral.

Built by the FFN worker's `_make_model_runner` (no native runner is built and thrown away).
It owns the FFN half of the model, the connector and the CUDA-graph cache; the FFN loop
(loop.py) takes one control payload per attention step from `next_step` (the connector adopts
it there, the only place the FFN's step state changes) and hands it to `run_step`. Per step it
opens one forward context of its own (vLLM's public `create_forward_context` +
`override_forward_context`) and, layer-major and stage-minor, receives the peers' rows, runs
the layer's native MLP/MoE block and issues the result's sends back, waited at the end of the step.
At FFN DP > 1 each stage's MoE calls also carry the FFN-level `DPMetadata` that vLLM's expert-parallel
dispatch sizes its collectives by (docs/ffn.md#per-step-compute).
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.forward_context import DPMetadata, create_forward_context, override_forward_context
from vllm.logger import init_logger

from vllm_afd.config import NUM_STAGES, AFDConfig
from vllm_afd.connect import build_connector
from vllm_afd.ffn.graphs import FFNGraphCache, graph_key, run_mode
from vllm_afd.ffn.pool import DrainingExchanges, reforms_as_pool
from vllm_afd.telemetry import Telemetry
from vllm_afd.validation import graph_mode
from vllm_afd.wire.devices import bind_thread
from vllm_afd.wire.errors import AFDProtocolError
from vllm_afd.wire.messages import ControlPayload, RoutingSpec
from vllm_afd.wire.placement import Placement
from vllm_afd.wire.reforming import reform_within

logger = init_logger(__name__)
# At FFN DP 1 every stage's MoE runs without DP metadata: one constant, no dict per step.
NO_DP_METADATA: Mapping[int, None] = types.MappingProxyType({stage: None for stage in range(max(NUM_STAGES))})


class AFDFFNModelRunner:
    """Model, connector and per-step compute of one FFN worker."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, afd_config: AFDConfig,
                 placement: Placement):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.device = device
        self.gate_on_attention = afd_config.compute_gate_on_attention
        self.use_cuda_graph = graph_mode(vllm_config) != "eager"
        self.num_hidden_layers = self.model_config.hf_text_config.num_hidden_layers
        self.model: Any = None
        self._moe_position: dict[int, int] = {}  # layer index -> index among MoE layers
        self.kv_caches: list[torch.Tensor] = []  # read by CPUWorker; the FFN has none
        self.graphs = FFNGraphCache(device) if self.use_cuda_graph else None
        self._missing_graphs: set[tuple] = set()  # keys already warned about
        self.reform_timeout_s = afd_config.reform_timeout_s
        # FFN DP > 1 with re-forming: a failed exchange finishes the step on zero rows (ffn/pool.py).
        self.drains_failed_steps = reforms_as_pool(vllm_config.parallel_config.data_parallel_size,
                                                   afd_config.reform_timeout_s)
        self.connector = build_connector(vllm_config, afd_config, placement, device)
        self.telemetry = Telemetry(afd_config, placement, self.connector)

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

    # ---- FFN loop surface -------------------------------------------------------------
    def init_connector(self) -> None:
        """On the FFN loop thread: make the rank's GPU current there (wire/devices.py), then rendezvous with the
        attention ranks (blocks up to rendezvous_timeout_s)."""
        bind_thread(self.device)
        self.connector.init()

    def reform(self, cause: BaseException) -> None:
        """Pair again after losing the attention (docs/connection.md#re-forming), or raise.

        Waits up to ``reform_timeout_s`` for the attention ranks to return; a returning attention whose
        handshake disagrees is refused (its start-up fails, naming the fields) and the wait goes on.
        The graphs recorded the old pairing's buffers: they are dropped and captured again.
        """
        if not self.connector.can_reform:
            raise cause
        if self.graphs is not None:
            self.graphs.clear()
        self._missing_graphs.clear()
        reform_within(self.connector, self.reform_timeout_s, cause, peer="the attention",
                   then="this FFN exits. Restart the attention with the FFN's model and AFD settings within "
                        "reform_timeout_s, or raise it")

    def next_step(self) -> ControlPayload | None:
        """The next step's payload, adopted by the connector; None once shutdown closed it.

        A connector that failed between two steps raises its failure here, so the FFN loop
        stores it (and health checks report it) instead of ending as if stopped.
        """
        if not self.connector.is_initialized:
            self.connector.check_failed()
            return None
        return self.connector.next_step()

    def run_step(self, payload: ControlPayload) -> None:
        """Run one attention step's FFN half: warm-up, capture, replay or eager."""
        key = graph_key(payload)
        has_graph = self.graphs is not None and self.graphs.has(key)
        mode = run_mode(payload, use_cuda_graph=self.use_cuda_graph, has_graph=has_graph)
        if mode in ("WARMUP", "CAPTURE") and self.graphs is None:
            raise AFDProtocolError("attention is capturing CUDA graphs but this FFN runs "
                                   "eager; launch both roles with the same graph mode")
        if mode == "EAGER" and payload.is_graph_replaying and self.graphs is not None:
            self._warn_missing_graph(key)
        with torch.inference_mode(), set_current_vllm_config(self.vllm_config):
            if mode == "REPLAY":
                # The receive buffers the graph recorded are keyed by shape and never evicted.
                self.graphs.replay(key)
            elif mode == "CAPTURE":
                self.graphs.capture(key, lambda: self._forward(payload))
                logger.info("AFD FFN: captured a CUDA graph for step counts %s", key)
            else:
                self._forward(payload)
        # NOTE: no device synchronisation: the next step's work queues behind this one on the same
        # stream, and the connector's flags and failure latch surface a peer's failure (docs/ffn.md).
        self.telemetry.after_step()

    def _warn_missing_graph(self, key: tuple) -> None:
        """Once per key: the attention replays a graph this FFN never captured (it runs eagerly)."""
        if key not in self._missing_graphs:
            self._missing_graphs.add(key)
            logger.warning("AFD FFN: the attention replays a CUDA graph for step counts %s, which this "
                           "FFN did not capture; running those steps eagerly (slower, same tokens). "
                           "Launch both roles with the same cudagraph_capture_sizes", key)

    def _forward(self, payload: ControlPayload) -> torch.Tensor:
        layers = (self.model.get_experts_layer_indices() if self.gate_on_attention
                  else range(self.num_hidden_layers))
        context = create_forward_context(None, self.vllm_config)
        dp_metadata = self._dp_metadata()
        exchanges = DrainingExchanges(self.connector) if self.drains_failed_steps else self.connector
        output = None
        with override_forward_context(context):
            for layer_idx in layers:
                routing = (RoutingSpec(*self.model.get_experts_routing_spec(layer_idx))
                           if self.gate_on_attention else None)
                for stage in payload.stages:
                    batch = exchanges.recv_a2f(stage, routing)
                    # vLLM's fast-MoE cold start pops MoE layer names in call order, and its DP dispatch
                    # reads this stage's rows per FFN DP rank: this context is ours, so point it at both.
                    context.moe_layer_index = self._moe_position.get(layer_idx, 0)
                    context.dp_metadata = dp_metadata[stage]
                    if self.gate_on_attention:
                        output = self.model.compute_experts_output(
                            batch.hidden_states, layer_idx, batch.router_logits)
                    else:
                        output = self.model.compute_ffn_output(batch.hidden_states, layer_idx)
                    exchanges.send_f2a(stage, output)
            # NOTE: the sends are asynchronous (with k stages a blocking f2a send would idle this FFN until
            # the attention finished its other stages, docs/pingpong.md#5); their buffers are free after this.
            exchanges.wait_sends()
        return output

    def _dp_metadata(self) -> Mapping[int, DPMetadata | None]:
        """Per stage of the adopted payload, the FFN-level `DPMetadata` of vLLM's MoE dispatch; None at FFN DP 1.

        NOTE: the step state holds every FFN DP rank's rows per stage (`Stage.dp_counts`, empty at FFN DP 1),
        so all FFN DP ranks size the same collectives alike without a collective of their own; vLLM resets the
        object's `local_sizes` after each MoE call, so one per stage serves every layer.
        """
        parallel = self.vllm_config.parallel_config
        if parallel.data_parallel_size == 1:
            return NO_DP_METADATA
        return {
            stage: DPMetadata.make(parallel, s.own_rows, torch.tensor(s.dp_counts, dtype=torch.int32))
            for stage, s in self.connector.steps.stages.items()
        }

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
            self.telemetry.close()
