"""Test-only vLLM general plugin that records when the patch series' hooks fire.

vLLM loads it through the `vllm.general_plugins` entry point in every process (front
end, engine core, workers, the model-inspection subprocess). It does nothing unless
`AFD_HOOK_PROBE_OUT=<dir>` is set; then it registers a VllmConfig hook, a forward-context
hook and (when `AFD_HOOK_PROBE_VETO=<message>` is set) a request veto, and every hook
appends one JSON line per call to `<dir>/events-<pid>.jsonl`; tests/hooks and
scripts/gpu_hook_check.py read those files and compare counts. The probe's workers and
runner live in `afd_hook_probe.cpu_worker`, `.gpu_worker` and `.mrv2`; the config hook
selects a worker only while `parallel_config.worker_cls` is still "auto".
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any

OUT_ENV = "AFD_HOOK_PROBE_OUT"
VETO_ENV = "AFD_HOOK_PROBE_VETO"
CPU_WORKER = "afd_hook_probe.cpu_worker.ProbeCPUWorker"
GPU_WORKER = "afd_hook_probe.gpu_worker.ProbeGPUWorker"

# NOTE: registration is per interpreter, not per pid: a forked child (vLLM's engine core under
# the `LLM` front end) inherits the parent's registered hooks, and registering them again there
# made every hook fire twice per call in the child.
_hooks_registered = False
_process_recorded_pid: int | None = None


def is_active() -> bool:
    """Whether the probe should record anything in this process."""
    return bool(os.environ.get(OUT_ENV))


def record(event: str, **fields: Any) -> None:
    """Append one event line to this process's file; no-op when the probe is inactive."""
    out = os.environ.get(OUT_ENV)
    if not out:
        return
    line = {"event": event, "pid": os.getpid(), **fields}
    path = Path(out) / f"events-{os.getpid()}.jsonl"
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(line, sort_keys=True) + "\n")


def register() -> None:
    """`vllm.general_plugins` entry point: install the hooks when the probe is active."""
    if is_active():
        install()


def install() -> None:
    """Register the probe's hooks once per interpreter (also called by the probe workers)."""
    global _hooks_registered, _process_recorded_pid
    if _process_recorded_pid != os.getpid():
        _process_recorded_pid = os.getpid()
        record(
            "process",
            process_name=multiprocessing.current_process().name,
            argv=sys.argv[:3],
            ppid=os.getppid(),
        )
    if _hooks_registered:
        return
    _hooks_registered = True
    from vllm.config.vllm import register_vllm_config_hook
    from vllm.forward_context import register_forward_context_hook

    register_vllm_config_hook(_on_vllm_config)
    register_forward_context_hook(_on_forward_context)
    message = os.environ.get(VETO_ENV)
    if message:
        from vllm.entrypoints.serve.engine.serving import register_request_veto

        def veto(request: Any) -> str:
            record("veto", request_type=type(request).__name__)
            return message

        register_request_veto(veto)


def _on_vllm_config(vllm_config: Any) -> None:
    """Pick the probe worker while the platform default is still unresolved."""
    from vllm.platforms import current_platform

    parallel_config = vllm_config.parallel_config
    worker_cls_before = parallel_config.worker_cls
    if worker_cls_before == "auto" and current_platform.is_cpu():
        parallel_config.worker_cls = CPU_WORKER
    elif worker_cls_before == "auto" and current_platform.is_cuda():
        parallel_config.worker_cls = GPU_WORKER
    record(
        "config_hook",
        worker_cls_before=str(worker_cls_before),
        worker_cls_after=str(parallel_config.worker_cls),
    )


def _on_forward_context(forward_context: Any) -> None:
    record(
        "forward_context",
        has_batch_descriptor=forward_context.batch_descriptor is not None,
        capturing=is_capturing(),
    )


def is_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
