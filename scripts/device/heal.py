"""The heal phase of the GPU evidence run: an FFN killed and restarted under the same attention.

Per AFD variant (docs/connection.md#healing-attention): a long stream is decoding when the FFN dies, the
attention answers 503 with the re-forming notice meanwhile, keeps its pid, and serves plain vLLM's tokens
again once a new FFN pairs with it; with CUDA graphs it records them again in its first step after
re-forming.  `gpu_e2e.py` runs it like the other phases (phases.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import e2e_report as report
import serving
from run_state import Run, guarded

HEAL_VARIANTS = ("plain_eager", "afd_eager", "afd_ipc_eager", "afd_ipc_graphs")


def phase_heal(run: Run) -> dict[str, Any]:
    """An FFN killed and restarted under the same attention, per AFD variant (docs/connection.md#healing-attention):
    every variant heals (same pid, 503 with the re-forming notice meanwhile, plain tokens after); one with CUDA
    graphs records them again in its first step after re-forming (timed as first_batch_after_heal_s)."""
    from afd_harness.server import complete_batch, free_port

    arch = run.args.models[0]
    model = run.models[arch]
    args = run.args
    settings = serving.ServeSettings(
        platform=args.platform, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        gpu_mem_util=args.gpu_mem_util, kv_cache_bytes=args.kv_cache_bytes, graph_compile=args.graph_compile,
        rendezvous_timeout_s=max(60.0, args.startup_timeout_s - 30), extra_args=tuple(model.get("serve_args", ())))
    variants = [v for v in args.heal_variants if args.platform == "cuda" or v not in serving.CUDA_ONLY_VARIANTS]
    ports = {v: free_port() for v in variants if v in serving.AFD_VARIANTS}
    specs = serving.server_specs(variants, settings, afd_port=ports)
    servers, infos = serving.start_servers(specs, Path(model["path"]), base_env=run.env(), logs_dir=run.logs_dir,
                                           prefix="heal", launcher=args.launcher,
                                           startup_timeout_s=max(30.0, min(args.startup_timeout_s,
                                                                           run.time_left() - 60)),
                                           on_spawn=run.register_server)
    run.summary["servers"]["heal"] = infos
    prompts = list(report.TEXT_PROMPTS)

    def tokens(url: str) -> list[list[int]]:
        return [g.token_ids for g in complete_batch(url, prompts, args.token_max_tokens,
                                                    timeout_s=args.request_timeout_s, ignore_eos=True)]

    result: dict[str, Any] = {"model": arch, "variants": {}}
    try:
        plain = tokens(servers["plain_eager"].base_url)
        for variant in variants[1:]:
            prefix = serving.AFD_VARIANTS[variant][2]
            attention, ffn = servers[f"{prefix}_attention"], servers[f"{prefix}_ffn"]
            if run.time_left() < 150 or infos[f"{prefix}_attention"]["status"] != "up":
                result["variants"][variant] = {"skipped": f"{run.time_left():.0f} s left or not up"}
                continue
            rounds = [guarded(lambda attention=attention, ffn=ffn: _heal_once(attention, ffn, plain, tokens, run))
                      for _ in range(args.heal_rounds) if run.time_left() >= 150]
            result["variants"][variant] = rounds[0] if len(rounds) == 1 else {
                "rounds": rounds, "tokens_equal_plain": all(isinstance(r, dict) and r.get("tokens_equal_plain")
                                                            for r in rounds)}
    finally:
        serving.stop_servers(servers, infos)
    healed = [v for v, r in result["variants"].items() if isinstance(r, dict) and r.get("tokens_equal_plain")]
    result["status"] = "ok" if {v for v in variants if v in serving.AFD_VARIANTS} <= set(healed) else "failed"
    return result


def _heal_once(attention: Any, ffn: Any, plain: list[list[int]], tokens: Callable[[str], list[list[int]]],
               run: Run) -> dict[str, Any]:
    import threading

    url = attention.base_url
    started = time.monotonic()
    record: dict[str, Any] = {"tokens_before_equal_plain": tokens(url) == plain,
                              "batch_before_s": round(time.monotonic() - started, 2)}
    pid = attention.process.pid
    # NOTE: a long stream is decoding when the FFN dies, so the step observes the loss (vLLM's fault-tolerance
    # retry path); an idle attention would re-form in the background instead.
    streams: list[str] = []
    reader = threading.Thread(target=lambda: streams.append(_stream_end(url)), daemon=True)
    reader.start()
    time.sleep(2.0)
    killed = time.monotonic()
    ffn.kill()
    reader.join(60)
    record["in_flight_stream_ended"] = streams[0] if streams else "still open after 60 s"
    status, message = _wait_status(url, {503}, 60.0)
    record.update(outage_status=status, outage_message=message[:400],
                  outage_after_s=round(time.monotonic() - killed, 1))
    ffn.start()
    ffn_up = time.monotonic()
    status, message = _wait_status(url, {200}, min(180.0, run.time_left() - 40))
    record.update(ffn_startup_s=round(ffn.startup_s or 0.0, 1), after_restart_status=status,
                  serving_again_after_ffn_up_s=round(time.monotonic() - ffn_up, 1),
                  attention_pid_kept=attention.process.pid == pid and attention.process.poll() is None)
    if status == 200:
        started = time.monotonic()
        record["tokens_equal_plain"] = tokens(url) == plain
        record["first_batch_after_heal_s"] = round(time.monotonic() - started, 2)
        record["gpu_memory_used_mib_after"] = _gpu_memory_used_mib()
    else:
        record["after_restart_message"] = message[:400]
    return record


def _gpu_memory_used_mib() -> int | None:
    """The device's used memory (every process on it), to see whether repeated heals leak."""
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=False).stdout.split()
    return int(out[0]) if out and out[0].isdigit() else None


def _stream_end(url: str) -> str:
    """How a long greedy stream ended: its last finish_reason, an error chunk, a refusal or a broken connection."""
    import requests

    finish = "none"
    try:
        with requests.post(f"{url}/v1/completions", stream=True, timeout=60,
                           json={"prompt": report.TEXT_PROMPTS[0], "max_tokens": 900, "ignore_eos": True,
                                 "temperature": 0, "stream": True}) as response:
            if response.status_code != 200:
                return f"HTTP {response.status_code}: {response.text[:200]}"
            for line in response.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[len("data: "):])
                if "error" in payload:
                    return f"error: {str(payload['error'])[:200]}"
                finish = next((c.get("finish_reason") for c in payload.get("choices", []) if c.get("finish_reason")),
                              finish)
    except requests.RequestException as exc:
        return f"connection: {exc}"[:200]
    return f"finish_reason {finish}"


def _wait_status(url: str, wanted: set[int], timeout_s: float) -> tuple[int | None, str]:
    """Poll a one-token completion until its status is in `wanted`; the last (status, body)."""
    import requests

    deadline = time.monotonic() + timeout_s
    status, body = None, ""
    while True:
        try:
            response = requests.post(f"{url}/v1/completions", timeout=30,
                                     json={"prompt": report.TEXT_PROMPTS[0], "max_tokens": 1, "temperature": 0})
            status, body = response.status_code, response.text
        except requests.RequestException as exc:
            status, body = None, str(exc)
        if status in wanted or time.monotonic() > deadline:
            return status, body
        time.sleep(0.5)
