"""`afd_plan.py profile`: a PROFILE.json measured through the real vLLM layers of a model's AFD halves.

Both halves are built in this process as the role workers build them (`EngineArgs` -> `create_engine_config`
-> `make_role_vllm_config` -> `initialize_model` -> vLLM's default loader; `--load-format dummy` for real
shapes without a checkpoint, `--layers N` builds N layers).  Then, per crossing layer (docs/planner.md#the-profile):

  attention  the attention half's first MoE decoder layer without its `mlp`: input_layernorm, self_attn
             (projections, rotary, vLLM's paged attention on a KV cache of `context` tokens per request,
             metadata built by the backend's own builder, inside vLLM's forward context), post_attention_layernorm;
  ffn        the FFN half's `compute_ffn_output` of that layer (router, experts, shared experts) on T rows,
             with all E experts (one process cannot run vLLM's EP; the `touched` term extrapolates to e < E);
  step       the attention half's per-step host work outside the layers: embedding of B tokens, final norm,
             logits, greedy pick (no scheduler, input preparation or detokenizer: a lower bound);
  transport  measure_wire.py: the connector's round trip in two local processes;
  control    one control payload's encode and checked decode (wire.messages), added to the transport's
             per-step publish as `afd_step_extra_ms`.
Every sample is the median of `repeats` timed calls after `warmup` untimed ones; the spread (min, max) is
returned beside the body for the report.  On CUDA a timed call replays the sample's CUDA graph (`Timer`): the
GPU time of a FULL_DECODE_ONLY step, without eager launch costs (the `step` sample then times its GPU work
only).  On CPU every timed call starts with a cold cache (`CacheEvictor`, untimed): in the engine a layer's
weights leave the shared last-level cache between two calls of it (the other layers, the other role's expert
reads), and a layer called back to back would read them from the cache instead.
"""

from __future__ import annotations

import json
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .memory import memory_block
from .profile import SCHEMA, VERSION, parse_profile

__all__ = ["EXIT_CAPTURE_FAILED", "CacheEvictor", "CaptureError", "Grid", "Timer", "Timing", "cuda_graph",
           "last_level_cache_bytes", "measure_profile", "read_model_config", "time_call"]

LOAD_FORMATS = ("auto", "dummy", "safetensors")
# `afd_plan.py profile`'s exit status when a sample's CUDA graph could not be captured (the device run then
# retries with --eager); other refusals exit 1.
EXIT_CAPTURE_FAILED = 3
# Checkpoint architecture -> what its decoder layer passes to `self_attn` after (positions, hidden_states), as
# the native `forward`s of vLLM 0.30.0 do (DeepSeek-V2/V3: `llama_4_scaling`, None without Llama-4 scaling).
SELF_ATTN_EXTRA_ARGS: dict[str, tuple[Any, ...]] = {
    "Qwen3MoeForCausalLM": (), "DeepseekV2ForCausalLM": (None,), "DeepseekV3ForCausalLM": (None,)}


@dataclass(frozen=True, slots=True)
class Grid:
    """What to measure and how often; checked by the CLI before anything is built."""

    batches: tuple[int, ...]  # requests per attention rank (attention, step, transport rows)
    contexts: tuple[int, ...]  # tokens of context per request (attention)
    tokens: tuple[int, ...]  # rows of one FFN rank (ffn)
    warmup: int  # untimed calls before each sample
    repeats: int  # timed calls per sample (the median is the sample)


@dataclass(frozen=True, slots=True)
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float

    def spread(self) -> str:
        return f"{self.median_ms:.3f} ms ({self.min_ms:.3f}..{self.max_ms:.3f})"


def _nothing() -> None:
    return None


def time_call(fn: Callable[[], Any], warmup: int, repeats: int, sync: Callable[[], None] = _nothing,
              before: Callable[[], None] = _nothing) -> Timing:
    """Median, min and max of `repeats` calls of `fn` after `warmup` untimed ones (`sync` ends each call;
    `before` runs untimed ahead of each timed one, e.g. a `CacheEvictor`)."""
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        before()
        started = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - started) * 1e3)
    return Timing(statistics.median(samples), min(samples), max(samples))


class CaptureError(RuntimeError):
    """A sample's layer could not be captured in a CUDA graph (the message says how to time it eagerly)."""


def cuda_graph(fn: Callable[[], Any], warmup: int, what: str) -> Callable[[], Any]:
    """`fn` run `warmup` (at least one) times on a side stream, then captured once in a CUDA graph (as torch's
    `make_graphed_callables` does); the returned call replays it: the GPU time a FULL_DECODE_ONLY step spends in
    the layer, without the eager launch costs (which dominate small layers on a GPU)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as exc:
        raise CaptureError(f"profile: capturing {what} in a CUDA graph failed ({type(exc).__name__}: {exc}); "
                           "rerun with --eager to time the layers eagerly (launch costs included)") from exc
    return graph.replay


@dataclass(frozen=True, slots=True)
class Timer:
    """How every sample of a profile is timed: `fn` called as is (CPU; CUDA with --eager), or its CUDA graph
    replayed (`graphs`); `before` runs untimed ahead of each timed call (a `CacheEvictor` on CPU)."""

    grid: Grid
    sync: Callable[[], None] = _nothing
    before: Callable[[], None] = _nothing
    graphs: bool = False

    def __call__(self, fn: Callable[[], Any], what: str) -> Timing:
        if not self.graphs:
            return time_call(fn, self.grid.warmup, self.grid.repeats, self.sync, self.before)
        # the eager warm-up happens before the capture; one replay warms the graph itself
        return time_call(cuda_graph(fn, self.grid.warmup, what), 1, self.grid.repeats, self.sync, self.before)

    def describe(self) -> str:
        return "CUDA graph replays" if self.graphs else "eager calls"


# Smallest eviction write: above the last-level cache of the machines measured (32 MiB on the 2-core box).
MIN_EVICTION_BYTES = 64 << 20


def last_level_cache_bytes(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """The largest cache of CPU 0 in bytes (sysfs `index*/size`, e.g. "32768K"), or None where sysfs has none."""
    sizes = []
    for entry in sorted(root.glob("index*/size")):
        text = entry.read_text(encoding="ascii").strip()
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text[:-1] if unit > 1 else text
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes) if sizes else None


class CacheEvictor:
    """Writes a buffer of twice the last-level cache (at least MIN_EVICTION_BYTES) so that the next call reads its
    weights from memory, as a layer does in the engine.
    What that changes: docs/planner.md#measured-through-the-models-layers-profile."""

    def __init__(self, num_bytes: int | None = None) -> None:
        import torch

        cache = last_level_cache_bytes()
        self.num_bytes = num_bytes or max(MIN_EVICTION_BYTES, 2 * (cache or 0))
        self._buffer = torch.empty(self.num_bytes, dtype=torch.uint8)

    def __call__(self) -> None:
        self._buffer.fill_(1)


def read_model_config(model_dir: Path) -> dict[str, Any]:
    """MODEL_DIR/config.json, or a message naming what is wrong (the CLI checks before building)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"profile: cannot read {path} ({exc.strerror}); pass a model directory") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"profile: {path} is not JSON ({exc})") from exc
    if not isinstance(config, dict) or not isinstance(config.get("num_hidden_layers"), int):
        raise ValueError(f"profile: {path} has no integer num_hidden_layers; is it a Hugging Face model config?")
    return config


def full_moe_layers(model_dir: Path) -> list[int]:
    """The MoE layer indices of the whole model (config.json's layer count, not a built one's)."""
    from transformers import AutoConfig

    from vllm_afd.models.split import check_architecture, moe_layer_indices

    hf = AutoConfig.from_pretrained(model_dir)
    return moe_layer_indices(hf, check_architecture((hf.architectures or ["(none)"])[0]))


def layers_through_first_moe(model_dir: Path) -> int:
    """How many layers to build so that the last one is the model's first MoE layer (the one measured)."""
    moe = full_moe_layers(model_dir)
    if not moe:
        raise ValueError(f"profile: {model_dir} holds no MoE layer; AFD splits MoE models only")
    return moe[0] + 1


# ---- building the halves ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _role_config(model_dir: Path, role: str, load_format: str, num_layers: int | None, max_len: int,
                 max_rows: int, device: str) -> Any:
    """One role's `VllmConfig`, as the role worker makes it (one AFD parse, the alias architecture)."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_afd.config import parse_afd_config
    from vllm_afd.workers.common import make_role_vllm_config

    connector = "P2pIpcAFDConnector" if device == "cuda" else "P2pGlooAFDConnector"
    config = EngineArgs(
        model=str(model_dir), enforce_eager=True, skip_tokenizer_init=True, load_format=load_format,
        max_model_len=max_len, max_num_batched_tokens=max(max_rows, max_len), max_num_seqs=max_rows,
        hf_overrides={"num_hidden_layers": num_layers} if num_layers else {},
        additional_config={"afd": {"role": role, "connector": connector}},
    ).create_engine_config()
    return make_role_vllm_config(config, parse_afd_config(config))


def _init_world(config: Any, device: str) -> None:
    """vLLM's world of one and its groups, once per process."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    if device == "cpu":
        from vllm_afd.compute_threads import prepare_compute_thread

        prepare_compute_thread()  # the layers run on this thread: vLLM's AMX kernels need the tile state
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo" if device == "cpu" else "nccl",
                                     distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
        ensure_model_parallel_initialized(1, 1)


def _load(config: Any, device: Any) -> tuple[Any, dict[str, int]]:
    """(the half `config` names, built and loaded by vLLM's default loader (strict: every parameter filled); its
    parameters' bytes as loaded, by name: before the device's kernels repack them, as the CPU's do)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_current_vllm_config(config), set_default_torch_dtype(config.model_config.dtype), torch.device(device):
        model = initialize_model(vllm_config=config)
        get_model_loader(config.load_config).load_weights(model, config.model_config)
        loaded = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
        process_weights_after_loading(model, config.model_config, torch.device(device))
    return model.eval(), loaded


@dataclass(frozen=True, slots=True)
class Halves:
    """Both AFD halves of the first layers, built and loaded in this process."""

    configs: dict[str, Any]  # role -> VllmConfig
    hf: Any  # the built (truncated) text config
    architecture: str  # the checkpoint's, without the AFD alias prefix
    moe: list[int]  # the built MoE layers
    where: Any  # torch.device
    attention_model: Any
    ffn_model: Any
    param_bytes: dict[str, int]  # both halves' parameters as loaded, by name


def _build(model_dir: Path, grid: Grid, device: str, load_format: str, num_layers: int | None) -> Halves:
    """Both halves as the role workers build them, on `device`; refuses an architecture not measured yet or a
    build without a MoE layer."""
    import torch

    from vllm_afd.models import register_afd_models
    from vllm_afd.models.split import moe_layer_indices

    max_len = max(grid.contexts) + 2
    max_rows = max(max(grid.batches), max(grid.tokens))
    register_afd_models()
    configs = {role: _role_config(model_dir, role, load_format, num_layers, max_len, max_rows, device)
               for role in ("attention", "ffn")}
    hf = configs["ffn"].model_config.hf_text_config
    architecture = configs["ffn"].model_config.hf_config.architectures[0].removeprefix("AFD")
    if architecture not in SELF_ATTN_EXTRA_ARGS:
        raise ValueError(f"profile: {architecture} is not measured yet; expected one of {sorted(SELF_ATTN_EXTRA_ARGS)} "
                         "(add its self_attn arguments to SELF_ATTN_EXTRA_ARGS)")
    moe = moe_layer_indices(hf, architecture)
    if not moe:
        raise ValueError(f"profile: the {hf.num_hidden_layers} built layer(s) hold no MoE layer; raise --layers "
                         "past the model's dense layers (first_k_dense_replace, mlp_only_layers)")
    if device == "cpu":
        torch.set_num_threads(1)  # one core per role, as the CPU benchmarks pin them
    where = torch.device("cuda:0" if device == "cuda" else "cpu")
    _init_world(configs["attention"], device)
    if device == "cuda":
        from vllm.v1.worker.workspace import init_workspace_manager

        init_workspace_manager(where)  # the fused MoE's scratch, as vLLM's GPU worker sets it up before the model
    attention_model, attention_bytes = _load(configs["attention"], where)
    ffn_model, ffn_bytes = _load(configs["ffn"], where)
    return Halves(configs, hf, architecture, moe, where, attention_model, ffn_model, attention_bytes | ffn_bytes)


# ---- the samples ----------------------------------------------------------------------------------------


def _kv_cache(spec: Any, backend: Any, num_blocks: int, device: Any) -> Any:
    """One layer's zeroed KV cache: logical [blocks, kv heads, block tokens, content] in the backend's first
    supported physical layout (vLLM's allocate_kv_cache does the same per group)."""
    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layouts = backend.supported_kv_cache_layouts() or (KVCacheLayout.LBHNC,)
    content = spec.page_size_bytes // (spec.num_kv_heads * spec.block_size * spec.dtype.itemsize)
    logical = (num_blocks, spec.num_kv_heads, spec.block_size, content)
    order = layouts[0].layer_view_order
    physical = torch.zeros([logical[i] for i in order], dtype=spec.dtype, device=device)
    return physical.permute([order.index(i) for i in range(4)])


def _attention_module(self_attn: Any) -> Any:
    """The one vLLM attention layer inside a decoder layer's `self_attn` (`Attention`, or DeepSeek's `MLAAttention`
    inside its MLA wrapper): the module that owns the layer name, KV cache spec and backend."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    found = [module for module in self_attn.modules() if isinstance(module, AttentionLayerBase)]
    assert len(found) == 1, f"{type(self_attn).__name__} holds {len(found)} attention layers, expected one"
    return found[0]


def _attention_samples(model: Any, config: Any, layer_idx: int, grid: Grid, device: Any, timer: Timer,
                       extra_args: tuple[Any, ...]) -> tuple[list[dict[str, Any]], list[str]]:
    """One decode token per request against `context` cached tokens, through the layer's own modules."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.v1.attention.backend import CommonAttentionMetadata

    layer = model.model.layers[layer_idx]
    attn = _attention_module(layer.self_attn)
    name, spec, backend = attn.layer_name, attn.get_kv_cache_spec(config), attn.get_attn_backend()
    hidden, dtype = config.model_config.hf_text_config.hidden_size, config.model_config.dtype
    block = spec.block_size
    samples, notes = [], []
    for context in grid.contexts:
        for batch in grid.batches:
            per_request = context // block + 1  # the blocks holding `context` tokens and the new one
            attn.bind_kv_cache(_kv_cache(spec, backend, batch * per_request, device))
            with set_current_vllm_config(config):
                builder = backend.get_builder_cls()(spec, [name], config, device)
            starts = torch.arange(batch + 1, dtype=torch.int32)
            table = torch.arange(batch * per_request, dtype=torch.int32).view(batch, per_request)
            slots = (table[:, context // block] * block + context % block).to(torch.int64)
            common = CommonAttentionMetadata(
                query_start_loc=starts.to(device), query_start_loc_cpu=starts,
                seq_lens=torch.full((batch,), context + 1, dtype=torch.int32, device=device), num_reqs=batch,
                num_actual_tokens=batch, max_query_len=1, max_seq_len=context + 1,
                block_table_tensor=table.to(device), slot_mapping=slots.to(device))
            metadata = builder.build(0, common)
            positions = torch.full((batch,), context, dtype=torch.int64, device=device)
            states = torch.randn(batch, hidden, device=device).to(dtype)
            residual = torch.randn(batch, hidden, device=device).to(dtype)

            def attention(states: Any = states, residual: Any = residual, positions: Any = positions) -> Any:
                # NOTE: the fused norm adds into `residual` in place, as between layers of a forward.
                x, r = layer.input_layernorm(states, residual)
                x = layer.self_attn(positions, x, *extra_args)
                return layer.post_attention_layernorm(x, r)

            with torch.inference_mode(), set_forward_context({name: metadata}, config,
                                                             slot_mapping={name: slots.to(device)}):
                timing = timer(attention, f"the attention at B {batch} L {context}")
            samples.append({"batch": batch, "context": context, "ms": round(timing.median_ms, 4)})
            notes.append(f"attention B {batch} L {context}: {timing.spread()}")
    return samples, notes


def _ffn_samples(model: Any, config: Any, layer_idx: int, grid: Grid, num_experts: int, device: Any,
                 timer: Timer) -> tuple[list[dict[str, Any]], list[str]]:
    import torch
    from vllm.forward_context import set_forward_context

    hidden, dtype = config.model_config.hf_text_config.hidden_size, config.model_config.dtype
    samples, notes = [], []
    with torch.inference_mode(), set_forward_context(None, config):
        for tokens in grid.tokens:
            states = torch.randn(tokens, hidden, device=device).to(dtype)
            timing = timer(lambda states=states: model.compute_ffn_output(states, layer_idx), f"the FFN at T {tokens}")
            samples.append({"tokens": tokens, "experts": num_experts, "ms": round(timing.median_ms, 4)})
            notes.append(f"ffn T {tokens}: {timing.spread()}")
    return samples, notes


def _step_samples(model: Any, config: Any, grid: Grid, device: Any,
                  timer: Timer) -> tuple[list[dict[str, Any]], list[str]]:
    import torch
    from vllm.forward_context import set_forward_context

    vocab = config.model_config.hf_text_config.vocab_size
    samples, notes = [], []
    with torch.inference_mode(), set_forward_context(None, config):
        for batch in grid.batches:
            ids = torch.randint(0, vocab, (batch,), device=device)
            residual = torch.zeros(batch, config.model_config.hf_text_config.hidden_size, device=device,
                                   dtype=config.model_config.dtype)

            def host_share(ids: Any = ids, residual: Any = residual) -> Any:
                states = model.embed_input_ids(ids)
                states, _ = model.model.norm(states, residual)
                return model.compute_logits(states).argmax(dim=-1)

            timing = timer(host_share, f"the step's host share at B {batch}")
            samples.append({"batch": batch, "ms": round(timing.median_ms, 4)})
            notes.append(f"step B {batch} (embedding, norm, logits, pick): {timing.spread()}")
    return samples, notes


def control_payload_ms(batch: int, grid: Grid) -> Timing:
    """One step's control payload: encode, frame header, checked decode (wire/messages.py), one stage."""
    from vllm_afd.wire.messages import ControlPayload, control_header, read_control

    def round_trip() -> Any:
        body = ControlPayload({0: (batch,)}, step_seq=1).encode()
        return read_control(control_header(body), body, num_stages=1, max_rows=batch)

    return time_call(round_trip, max(grid.warmup, 10), max(grid.repeats, 100))


def measure_profile(model_dir: Path, grid: Grid, *, device: str = "cpu", load_format: str = "auto",
                    num_layers: int | None = None, transport: bool = True, cold_cache: bool = True,
                    eager: bool = False, device_gib: float | None = None) -> tuple[dict[str, Any], list[str]]:
    """(the profile as JSON, per-sample notes with their spread); the profile passes `parse_profile`.

    `cold_cache` (CPU only): evict the caches before every timed call, as the engine's layers find them; False
    times a layer called back to back (its weights cached: the isolated layer's best case).  On CUDA every sample
    is a CUDA graph's replay unless `eager` (then the eager launch costs are in every sample).  The `memory` block
    (docs/planner.md#memory) is written for a device of `device_gib` (default on CUDA: GPU 0's; on CPU: none)."""
    import torch

    from vllm_afd.models.split import num_routed_experts

    halves = _build(model_dir, grid, device, load_format, num_layers)
    configs, hf, layer, where = halves.configs, halves.hf, halves.moe[0], halves.where
    full_layers = read_model_config(model_dir)["num_hidden_layers"]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    num_experts = num_routed_experts(hf)
    evict = CacheEvictor() if cold_cache and device == "cpu" else None
    timer = Timer(grid, sync, evict or _nothing, graphs=device == "cuda" and not eager)
    attention, notes = _attention_samples(halves.attention_model, configs["attention"], layer, grid, where, timer,
                                          SELF_ATTN_EXTRA_ARGS[halves.architecture])
    ffn, ffn_notes = _ffn_samples(halves.ffn_model, configs["ffn"], layer, grid, num_experts, where, timer)
    step, step_notes = _step_samples(halves.attention_model, configs["attention"], grid, where, timer)
    notes += ffn_notes + step_notes
    if device == "cuda" and device_gib is None:
        device_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    memory = None
    if device_gib is not None:
        spec = _attention_module(halves.attention_model.model.layers[layer].self_attn).get_kv_cache_spec(
            configs["attention"])
        memory, memory_note = memory_block(halves.param_bytes, spec.page_size_bytes // spec.block_size,
                                           halves.moe, full_moe_layers(model_dir), full_layers, device_gib)
        notes.append(memory_note)
    dtype = configs["ffn"].model_config.dtype
    model = {"name": Path(model_dir).name, "hidden_size": hf.hidden_size, "num_layers": full_layers,
             "num_experts": num_experts, "top_k": hf.num_experts_per_tok, "dtype_bytes": dtype.itemsize}
    control = control_payload_ms(max(grid.batches), grid)
    notes.append(f"control payload encode + decode: {control.spread()}")
    extra, wire = control.median_ms, []
    if transport:
        from .measure_wire import round_trips

        wire, publish, wire_notes = round_trips(device, hf.hidden_size, dtype, grid)
        extra += publish
        notes += wire_notes
    cache_text = (f"cold cache: {evict.num_bytes >> 20} MiB written before every timed call" if evict else
                  "warm cache: calls back to back")
    body = {"schema": SCHEMA, "version": VERSION,
            "device": f"{'CPU, 1 thread per role' if device == 'cpu' else torch.cuda.get_device_name(0)}",
            "platform": device,
            "source": f"afd_plan.py profile {model_dir} (load format {load_format}, {hf.num_hidden_layers} of "
                      f"{full_layers} layers built; layer {layer}; median of {grid.repeats} {timer.describe()} after "
                      f"{grid.warmup} warm-up; {cache_text})",
            "model": model, "attention": attention, "ffn": ffn, "transport": wire, "step": step,
            "afd_step_extra_ms": round(extra, 4)}
    if memory is not None:
        body["memory"] = memory
    if not wire:
        body["transport"] = [{"bytes": 0, "ms": 0.0}]
        notes.append("transport not measured (--no-transport): one 0 ms sample; plan with --link")
    parse_profile(body)  # what we write must read back
    return body, notes
