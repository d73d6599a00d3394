"""Servers of one GPU end-to-end round: which `vllm serve` processes, their flags, and the requests.

One round serves one tiny model from up to eight processes at once on the one GPU, so that
every comparison is made between servers that are up at the same time and requests can
alternate between them (docs/conventions.md#measuring-performance):

    variant          servers                        flags
    plain_eager      plain_eager                    patched vLLM, no AFD, --enforce-eager (the baseline)
    plain_graphs     plain_graphs                   no AFD, FULL_DECODE_ONLY CUDA graphs
    afd_eager        afd_ffn + afd_attention        AFD over P2pGlooAFDConnector, eager
    afd_ipc_eager    afd_ipc_ffn + ..._attention    AFD over P2pIpcAFDConnector, eager
    afd_ipc_graphs   afd_ipcg_ffn + ..._attention   AFD over P2pIpcAFDConnector, FULL_DECODE_ONLY on both roles
    afd_ipc_{eager,graphs}_s{2,3}                   the same with num_stages 2 or 3 (docs/pingpong.md)

The FFN of a pair serves no requests.  NCCL refuses two ranks on one GPU and gloo cannot be
captured; the IPC connector is the one-node transport that is (wire/transports/ipc.py).  Every
server gets a fixed `--kv-cache-memory-bytes` (no memory profiling, so concurrent starts cannot
disturb each other's KV sizing: docs/failures.md#13-one-gpu-two-roles) and a low
`--gpu-memory-utilization`.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# paired_rounds.py sits in scripts/ (repo_paths puts it on sys.path on the GPU machine).
import repo_paths  # noqa: F401
from e2e_report import (BENCH_PROMPT_IDS, CHAT_MESSAGE, FIRST_PLAIN_TOKEN_ID, TEXT_PROMPTS, bench_prompt_ids,
                        decode_rate, median_rate)
from paired_rounds import Prompts

# variant name -> the server that answers its requests
AFD_CONNECTOR = "P2pGlooAFDConnector"
# AFD variant -> (connector, FULL_DECODE_ONLY graphs on both roles, server name prefix, num_stages)
AFD_VARIANTS = {"afd_eager": (AFD_CONNECTOR, False, "afd", 1),
                "afd_ipc_eager": ("P2pIpcAFDConnector", False, "afd_ipc", 1),
                "afd_ipc_graphs": ("P2pIpcAFDConnector", True, "afd_ipcg", 1),
                **{f"afd_ipc_{mode}_s{k}": ("P2pIpcAFDConnector", mode == "graphs",
                                            f"afd_ipc{'g' if mode == 'graphs' else ''}_s{k}", k)
                   for mode in ("eager", "graphs") for k in (2, 3)}}
# A split variant's one-stage twin: its tokens and tok/s are compared with it.
STAGE_TWINS = {variant: variant.rsplit("_s", 1)[0] for variant, spec in AFD_VARIANTS.items() if spec[3] > 1}
# min_tokens_per_stage of the split variants: every decode step of >= num_stages requests splits.
MIN_TOKENS_PER_STAGE = 1
VARIANT_SERVERS = {"plain_eager": "plain_eager", "plain_graphs": "plain_graphs", "pristine_eager": "pristine_eager",
                   **{variant: f"{spec[2]}_attention" for variant, spec in AFD_VARIANTS.items()}}
# --pin-servers: cores of one server (its API server and engine core processes).
CORES_PER_SERVER = 2
CUDA_ONLY_VARIANTS = ("plain_graphs", *(v for v, spec in AFD_VARIANTS.items() if spec[0] != AFD_CONNECTOR))


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeSettings:
    """Flags shared by every server of a round."""

    platform: str = "cuda"  # "cuda" (the H200) or "cpu" (a smoke run of this script)
    dtype: str | None = None  # None: the checkpoint's dtype
    max_model_len: int = 1024
    max_num_seqs: int = 64
    gpu_mem_util: float = 0.25
    kv_cache_bytes: int = 2 << 30
    capture_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    graph_compile: str = "none"  # "none": -cc.mode 0 (graphs without torch.compile); "vllm": vLLM's default
    rendezvous_timeout_s: float = 240.0
    extra_args: tuple[str, ...] = ()
    # Non-empty: every AFD variant's ranks append their timeline to <timeline_dir>/<variant>/ (docs/timeline.md).
    timeline_dir: str = ""


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """One `vllm serve` process of a round."""

    name: str
    # Variant whose requests it answers; None for the FFN role.
    variant: str | None
    args: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    # A server whose failed start dooms this one (the attention waits for its FFN until the
    # rendezvous times out): this one is stopped at once instead.
    needs: str | None = None
    # Non-empty: the process and its children run on these cores only (`taskset`, pin_cores).
    cores: tuple[int, ...] = ()


def afd_config_json(role: str, port: int, rendezvous_timeout_s: float, connector: str = AFD_CONNECTOR,
                    timeline_dir: str = "", num_stages: int = 1) -> str:
    config = {"role": role, "connector": connector, "host": "127.0.0.1", "port": port,
              "rendezvous_timeout_s": rendezvous_timeout_s}
    if num_stages > 1:
        # NOTE: every decode step of >= num_stages requests splits (the default, 4 tokens per stage, is
        # the CPU benchmark's); the token cases are small batches and must exercise the split.
        config.update(num_stages=num_stages, min_tokens_per_stage=MIN_TOKENS_PER_STAGE)
    if timeline_dir:
        config["timeline_dir"] = timeline_dir
    return json.dumps({"afd": config}, sort_keys=True)


def graph_compilation_json(settings: ServeSettings) -> str:
    config: dict[str, Any] = {"cudagraph_mode": "FULL_DECODE_ONLY",
                              "cudagraph_capture_sizes": sorted(settings.capture_sizes)}
    if settings.graph_compile == "none":
        config["mode"] = 0
    return json.dumps(config, sort_keys=True)


def server_specs(variants: Sequence[str], settings: ServeSettings, *, afd_port: int | Mapping[str, int],
                 cpu_env: Mapping[str, str] | None = None) -> list[ServerSpec]:
    """The processes that serve `variants` (a subset of VARIANT_SERVERS), in start order.

    `afd_port`: the rendezvous port of each AFD variant (a mapping), or one port when the round
    has one AFD variant.
    """
    unknown = sorted(set(variants) - set(VARIANT_SERVERS))
    if unknown:
        raise ValueError(f"server_specs: unknown variant(s) {unknown}; expected some of {sorted(VARIANT_SERVERS)}.")
    afd = [v for v in variants if v in AFD_VARIANTS]
    ports = afd_port if isinstance(afd_port, Mapping) else ({afd[0]: afd_port} if len(afd) == 1 else {})
    if sorted(ports) != sorted(afd):
        raise ValueError(f"server_specs: AFD variants {afd} need one rendezvous port each, got {afd_port!r}; "
                         "pass afd_port={variant: port}.")
    if settings.platform != "cuda" and set(variants) & set(CUDA_ONLY_VARIANTS):
        raise ValueError(f"server_specs: {sorted(set(variants) & set(CUDA_ONLY_VARIANTS))} needs CUDA; drop it on CPU.")
    common = ["--max-model-len", str(settings.max_model_len), "--max-num-seqs", str(settings.max_num_seqs),
              "--seed", "0", *(["--dtype", settings.dtype] if settings.dtype else [])]
    memory = []
    if settings.platform == "cuda":
        memory = ["--gpu-memory-utilization", str(settings.gpu_mem_util)]
    kv_bytes = ["--kv-cache-memory-bytes", str(settings.kv_cache_bytes)] if settings.platform == "cuda" else []
    eager = ["--enforce-eager"]
    specs = []
    cpu_env = dict(cpu_env or {})
    # NOTE: on CPU, each process gets its own core (docs/failures.md#14-cpu-co-location);
    # ignored on CUDA.
    cores = iter(["0", "1", "0", "1"])
    for variant in variants:
        if variant in ("plain_eager", "pristine_eager"):
            specs.append(ServerSpec(variant, variant, (*common, *memory, *kv_bytes, *eager),
                                    _cpu_env(settings, cpu_env, cores)))
        elif variant == "plain_graphs":
            specs.append(ServerSpec("plain_graphs", variant, (*common, *memory, *kv_bytes, "--compilation-config",
                                                              graph_compilation_json(settings))))
        else:
            connector, graphs, prefix, num_stages = AFD_VARIANTS[variant]
            mode = ["--compilation-config", graph_compilation_json(settings)] if graphs else eager
            for role in ("ffn", "attention"):
                timeline = f"{settings.timeline_dir}/{variant}" if settings.timeline_dir else ""
                config = afd_config_json(role, ports[variant], settings.rendezvous_timeout_s, connector, timeline,
                                         num_stages)
                role_kv = kv_bytes if role == "attention" else []
                specs.append(ServerSpec(f"{prefix}_{role}", variant if role == "attention" else None,
                                        (*common, *memory, *role_kv, *mode, "--additional-config", config),
                                        _cpu_env(settings, cpu_env, cores),
                                        needs=f"{prefix}_ffn" if role == "attention" else None))
    return [ServerSpec(s.name, s.variant, (*s.args, *settings.extra_args), s.env, s.needs) for s in specs]


def num_servers(variants: Sequence[str]) -> int:
    """Processes `server_specs` starts for `variants`: an FFN and an attention per AFD variant, one otherwise."""
    return sum(2 if variant in AFD_VARIANTS else 1 for variant in variants)


def cores_needed(num_servers: int) -> int:
    """Cores `pin_cores` needs: CORES_PER_SERVER per server and one for the client."""
    return CORES_PER_SERVER * num_servers + 1


def pin_cores(specs: Sequence[ServerSpec], cores: Sequence[int]) -> tuple[list[ServerSpec], tuple[int, ...]]:
    """Each server gets CORES_PER_SERVER cores of its own (its API server and engine core), the client the rest.

    So that no server and no client thread can take another's core; runs 53a-53e of evidence/gpu-log.md found
    one server's spread between repetitions the same pinned or not (a coefficient of variation of 0.06-0.23).
    """
    cores = sorted(set(cores))
    if len(cores) < cores_needed(len(specs)):
        raise ValueError(f"pin_cores: {len(specs)} servers need {cores_needed(len(specs))} cores ({CORES_PER_SERVER} "
                         f"each, one for the client), this process may run on {len(cores)}; serve fewer variants "
                         "or drop --pin-servers.")
    n = CORES_PER_SERVER
    pinned = [replace(spec, cores=tuple(cores[i * n:(i + 1) * n])) for i, spec in enumerate(specs)]
    return pinned, tuple(cores[n * len(specs):])


def launch_prefix(spec: ServerSpec) -> tuple[str, ...]:
    """The command a server's argv runs under: `taskset -c CORES` when pinned, nothing otherwise."""
    return ("taskset", "-c", ",".join(map(str, spec.cores))) if spec.cores else ()


def _cpu_env(settings: ServeSettings, cpu_env: Mapping[str, str], cores: Any) -> dict[str, str]:
    if settings.platform != "cpu":
        return {}
    return {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": next(cores), **cpu_env}


# ------------------------------------------------------------------------------------ processes

def start_servers(specs: Sequence[ServerSpec], model_dir: Path, *, base_env: Mapping[str, str], logs_dir: Path,
                  prefix: str, launcher: str, startup_timeout_s: float,
                  on_spawn: Callable[[int], None] = lambda pid: None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Start every spec at once (threads), wait for each to be healthy; returns (servers, infos).

    `on_spawn(pid)` is called (from this thread) for each process as soon as it exists: servers
    run in their own sessions, so the caller must be able to find them if this process is killed.
    """
    from afd_harness.server import VllmServer

    servers = {spec.name: VllmServer(model_dir, extra_args=spec.args, env={**base_env, **spec.env},
                                     python=sys.executable, log_path=logs_dir / f"{prefix}-{spec.name}.log",
                                     launcher=launcher, cpu_defaults=False, startup_timeout_s=startup_timeout_s,
                                     stop_wait_s=10.0, command_prefix=launch_prefix(spec))
               for spec in specs}
    infos: dict[str, Any] = {}

    def start(name: str) -> None:
        started = time.monotonic()
        try:
            servers[name].start()
            infos[name] = {"status": "up", "startup_s": round(time.monotonic() - started, 1)}
        except Exception as exc:  # noqa: BLE001 - recorded; the round continues with what is up
            infos[name] = {"status": "failed", "startup_s": round(time.monotonic() - started, 1),
                           "error": f"{type(exc).__name__}: {exc}"[-4000:]}

    seen: set[int] = set()
    with ThreadPoolExecutor(max_workers=max(1, len(specs))) as pool:
        futures = [pool.submit(start, name) for name in servers]
        try:
            while True:
                for server in servers.values():
                    if server.process is not None and server.process.pid not in seen:
                        seen.add(server.process.pid)
                        on_spawn(server.process.pid)
                if all(future.done() for future in futures):
                    break
                for spec in specs:
                    doomed = spec.needs is not None and infos.get(spec.needs, {}).get("status") == "failed"
                    if doomed and spec.name not in infos and servers[spec.name].process is not None:
                        servers[spec.name].stop()  # its start() then fails at once, naming the exit
                time.sleep(0.2)
        except BaseException:  # SIGTERM or Ctrl-C while starting: take every server down, then re-raise
            stop_servers(servers, infos)
            raise
    for name, server in servers.items():
        infos[name]["argv"] = server.argv[1:]
        infos[name]["port"] = server.port
    return servers, infos


def stop_servers(servers: Mapping[str, Any], infos: dict[str, Any]) -> None:
    """Stop every server at once (each escalates SIGINT -> SIGTERM -> SIGKILL); records exit codes."""
    def stop(name: str) -> None:
        try:
            infos.setdefault(name, {})["exit_code"] = servers[name].stop()
        except Exception as exc:  # noqa: BLE001 - a stuck server must not keep the others up
            infos.setdefault(name, {})["stop_error"] = f"{type(exc).__name__}: {exc}"

    with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
        list(pool.map(stop, list(servers)))


_BACKEND_RES = (re.compile(r"Using (\w+) attention backend"), re.compile(r"Using AttentionBackendEnum\.(\w+) backend"),
                re.compile(r"Using (\w+) backend\."))
_MOE_BACKEND_RE = re.compile(r"Using (\w+) MoE backend")
_GRAPHS_RE = re.compile(r"Graph capturing finished in (\d+) secs")
# The AFD FFN records its own graphs (one log line per step shape) and warns when it lacks one.
_FFN_GRAPH_RE = re.compile(r"AFD FFN: captured a CUDA graph")
_FFN_MISSING_GRAPH_RE = re.compile(r"AFD FFN: the attention replays a CUDA graph for step counts (.*?), which")


def scan_log(text: str) -> dict[str, Any]:
    """Facts a server log states: attention backends, CUDA-graph capture, tracebacks, last error line."""
    backends: list[str] = []
    for pattern in _BACKEND_RES:
        for match in pattern.finditer(text):
            if match.group(1) not in backends:
                backends.append(match.group(1))
    moe_backends = list(dict.fromkeys(match.group(1) for match in _MOE_BACKEND_RE.finditer(text)))
    errors = [line for line in text.splitlines() if " ERROR " in line or line.startswith("ERROR")]
    captured = _GRAPHS_RE.search(text)
    num_ffn_graphs = len(_FFN_GRAPH_RE.findall(text))
    return {"backends": backends, "moe_backends": moe_backends,
            "graphs_captured": captured is not None or num_ffn_graphs > 0,
            "num_ffn_graphs": num_ffn_graphs,
            "ffn_missing_graphs": _FFN_MISSING_GRAPH_RE.findall(text),
            "graph_capture_s": int(captured.group(1)) if captured else None,
            "num_tracebacks": text.count("Traceback (most recent call last)"),
            "last_error": errors[-1][-300:] if errors else None}


# ------------------------------------------------------------------------------------- requests

def run_token_cases(base_url: str, max_tokens: int, timeout_s: float) -> dict[str, list[list[int] | None]]:
    """Greedy token ids for the fixed cases: single, batched, streamed, token-id prompts, chat."""
    from afd_harness.server import chat, complete_batch

    cases: dict[str, list[list[int] | None]] = {}
    prompts = list(TEXT_PROMPTS)
    cases["single"] = [complete_batch(base_url, [p], max_tokens, timeout_s=timeout_s)[0].token_ids for p in prompts]
    cases["batch"] = [g.token_ids for g in complete_batch(base_url, prompts, max_tokens, timeout_s=timeout_s,
                                                          ignore_eos=True)]
    cases["batch_stream"] = [g.token_ids for g in complete_batch(base_url, prompts, max_tokens, stream=True,
                                                                 timeout_s=timeout_s, ignore_eos=True)]
    ids = bench_prompt_ids(8, 16, seed=1)
    cases["token_ids_batch"] = [g.token_ids for g in complete_batch(base_url, ids, max_tokens, timeout_s=timeout_s,
                                                                    ignore_eos=True)]
    cases["chat"] = [chat(base_url, CHAT_MESSAGE, max_tokens, timeout_s=timeout_s).token_ids]
    cases["chat_stream"] = [chat(base_url, CHAT_MESSAGE, max_tokens, stream=True, timeout_s=timeout_s).token_ids]
    return cases


def check_ffn_refuses(ffn_url: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """The FFN answers /health 200 and generation with HTTP 400 pointing to the attention
    (docs/ffn.md#ffn-api-server)."""
    import requests

    health = requests.get(f"{ffn_url}/health", timeout=timeout_s).status_code
    response = requests.post(f"{ffn_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=timeout_s)
    return {"health": health, "completion_status": response.status_code,
            "points_to_attention": "attention" in response.text and response.status_code == 400,
            "body": response.text[:400]}


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchPlan:
    batches: tuple[int, ...] = (1, 32)
    max_tokens: int = 128
    prompt_len: int = 32
    repeats: int = 3
    warmup: int = 1
    timeout_s: float = 120.0


def bench_prompts(length: int) -> Prompts:
    """The bench's prompts: `length` plain token ids of the tiny tokenizer each, none repeated in the run."""
    return Prompts(length, first_id=FIRST_PLAIN_TOKEN_ID, num_ids=BENCH_PROMPT_IDS)


def run_decode_bench(urls: Mapping[str, str], plan: BenchPlan, time_left: Callable[[], float],
                     reserve_s: float = 30.0, prompt_lens: Sequence[int] = (),
                     send: Callable[..., Any] | None = None) -> dict[str, Any]:
    """The bench at ``plan.prompt_len``; with ``prompt_lens``, once per prompt length (same servers), the
    first one's result at the top level and every one under ``by_prompt_len``.  No prompt repeats in the run,
    across lengths included; `send`: afd_harness.server.complete_batch unless given (tests)."""
    prompts = bench_prompts(plan.prompt_len)
    if not prompt_lens:
        return _decode_bench(urls, plan, time_left, reserve_s, prompts, send)
    results = {}
    for prompt_len in prompt_lens:
        prompts.length = prompt_len  # the count of prompts issued goes on: no length repeats another's prompts
        results[str(prompt_len)] = _decode_bench(
            urls, BenchPlan(batches=plan.batches, max_tokens=plan.max_tokens, prompt_len=prompt_len,
                            repeats=plan.repeats, warmup=plan.warmup, timeout_s=plan.timeout_s),
            time_left, reserve_s, prompts, send)
    return {**results[str(prompt_lens[0])], "by_prompt_len": results}


def _decode_bench(urls: Mapping[str, str], plan: BenchPlan, time_left: Callable[[], float], reserve_s: float,
                  prompts: Prompts, send: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Interleaved decode timing: rep -> batch -> variant (rotated per rep), max_tokens vs 1-token requests.

    Every request (the 1-token one too) has prompts of its own (`prompts`), so with prefix caching off both
    requests of a sample compute the same prefill.  `per_rep_tok_s[variant][batch]` holds one entry per
    recorded rep, None where the variant had no rate (its request failed, or an earlier one did), so that
    ratios pair by rep (round_records.paired_records); `variants` keeps the median of the rates.
    `windows_ns` records when each measured max_tokens request ran (time.perf_counter_ns: CLOCK_MONOTONIC,
    the clock of the servers' timeline records too), so that stage_prediction.py finds its decode steps.
    """
    if send is None:
        from afd_harness.server import complete_batch as send

    variants = list(urls)
    samples: dict[str, dict[int, list[Any]]] = {v: {b: [] for b in plan.batches} for v in variants}
    per_rep: dict[str, dict[int, list[float | None]]] = {v: {b: [] for b in plan.batches} for v in variants}
    windows: dict[str, dict[int, list[list[int]]]] = {v: {b: [] for b in plan.batches} for v in variants}
    errors: dict[str, str] = {}
    token_counts_ok = True
    completed_reps = 0
    for rep in range(plan.warmup + plan.repeats):
        if time_left() < reserve_s:
            break
        recorded = rep >= plan.warmup
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        for batch in plan.batches:
            for variant in order:
                rate = None
                if variant not in errors:
                    try:
                        full_prompts, prefill_prompts = prompts.batch(batch), prompts.batch(batch)
                        started, started_ns = time.perf_counter(), time.perf_counter_ns()
                        full = send(urls[variant], full_prompts, plan.max_tokens, timeout_s=plan.timeout_s,
                                    ignore_eos=True)
                        full_s, window = time.perf_counter() - started, [started_ns, time.perf_counter_ns()]
                        started = time.perf_counter()
                        send(urls[variant], prefill_prompts, 1, timeout_s=plan.timeout_s, ignore_eos=True)
                        prefill_s = time.perf_counter() - started
                    except Exception as exc:  # noqa: BLE001 - one broken server must not void the others
                        errors[variant] = f"{type(exc).__name__}: {exc}"[-2000:]
                    else:
                        token_counts_ok &= all(len(g.token_ids or []) == plan.max_tokens for g in full)
                        rate = decode_rate(batch, plan.max_tokens, full_s, prefill_s)
                        if recorded:
                            samples[variant][batch].append(rate)
                            windows[variant][batch].append(window)
                if recorded:
                    per_rep[variant][batch].append(rate["tok_s"] if rate else None)
        completed_reps += 1
    return {"batches": list(plan.batches), "max_tokens": plan.max_tokens, "prompt_len": plan.prompt_len,
            "completed_reps": completed_reps, "warmup": plan.warmup, "token_counts_ok": token_counts_ok,
            "errors": errors, "prompts": "unique per request",
            "variants": {v: {str(b): median_rate(s) for b, s in by_batch.items()} for v, by_batch in samples.items()},
            "per_rep_tok_s": {v: {str(b): reps for b, reps in by_batch.items()} for v, by_batch in per_rep.items()},
            "windows_ns": {v: {str(b): spans for b, spans in by_batch.items()} for v, by_batch in windows.items()}}
