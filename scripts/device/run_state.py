"""The state of one `gpu_e2e.py` invocation, shared by the orchestrator and its phases.

`Run` holds the paths, the deadline, the subprocess environment and the summary being
written; `gpu_e2e.py` creates it and sequences the phases, `phases.py` and `heal.py` receive it.
They import this module, and it imports none of them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import install_overlay
import ipc_report

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# The test harness distribution (afd_harness: vLLM servers, tiny checkpoints), put on a subprocess's
# PYTHONPATH where needed (repo_paths.py puts it on this process's sys.path): the device has no pip.
HARNESS = REPO / "tests" / "harness"

# Seconds kept free at the end of a device command: stopping servers and packing the logs.
COMMAND_RESERVE_S = 45.0

# Folders inside the staged site that a site directory's .pth file would add to sys.path, but
# PYTHONPATH entries never read .pth files: CuTe DSL (`nvidia-cutlass-dsl`, vLLM 0.34.0's kernel
# warm-up imports `cutlass`) keeps its packages here and adds them by `nvidia_cutlass_dsl_packages.pth`.
PTH_ONLY_DIRS = ("nvidia_cutlass_dsl/dsl_packages",)


def staged_site_entries(site: Path) -> list[str]:
    """The staged site and those of its .pth-only folders it holds, in PYTHONPATH order."""
    return [str(site), *(str(site / rel) for rel in PTH_ONLY_DIRS if (site / rel).is_dir())]


class Run:
    """State of one invocation: paths, deadline, environment and the summary being written."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.monotonic()
        self.deadline = self.started + args.budget_s
        if args.command_start is not None:
            # NOTE: the device kills the whole command at its limit; staging and bootstrap ran before us.
            command_left = args.command_start + args.command_limit_s - COMMAND_RESERVE_S - time.time()
            self.deadline = min(self.deadline, self.started + command_left)
        self.out_dir = Path(args.out).expanduser().resolve()
        self.work_dir = Path(args.work).expanduser().resolve()
        self.logs_dir = self.work_dir / "logs"
        shutil.rmtree(self.logs_dir, ignore_errors=True)
        for path in (self.out_dir, self.logs_dir):
            path.mkdir(parents=True, exist_ok=True)
        self.vllm_site = Path(args.vllm_site).expanduser().resolve()
        self.tool_entries: list[str] = []
        self.overlay_entries = install_overlay.install(REPO, Path(args.afd_site).expanduser())
        self.models: dict[str, dict[str, Any]] = {}
        self.summary: dict[str, Any] = {
            "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "argv": sys.argv, "platform": args.platform, "vllm_site": str(self.vllm_site),
            "overlay_pythonpath": self.overlay_entries, "budget_s": round(self.time_left(), 1),
            "device": {}, "phases": {}, "servers": {}, "notes": [],
        }

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def env(self, *, overlay: bool = True, vllm: bool = True, extra: list[str] | None = None) -> dict[str, str]:
        """Environment for subprocesses: staged vLLM first, then the overlay and its dist-info.

        `vllm=False` keeps ~/vllm-site off the path (model building and the connector bench use the
        image's own torch/transformers stack only).
        """
        env = dict(os.environ)
        env["PYTHONPATH"] = install_overlay.join_pythonpath(
            staged_site_entries(self.vllm_site) if vllm else [], self.overlay_entries if overlay else [], extra or [],
            os.environ.get("PYTHONPATH"))
        env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                   DO_NOT_TRACK="1", VLLM_ENGINE_READY_TIMEOUT_S=str(int(self.args.startup_timeout_s) + 60))
        if self.args.platform == "cuda":
            env.update(CUDA_VISIBLE_DEVICES=self.args.cuda_devices, VLLM_USE_FLASHINFER_SAMPLER="0")
        return env

    def run_cmd(self, argv: list[str], *, env: dict[str, str], timeout_s: float, log_name: str) -> dict[str, Any]:
        """Run a subprocess with its output in logs/<log_name>.log; never raises on a non-zero exit."""
        log_path = self.logs_dir / f"{log_name}.log"
        timeout_s = max(5.0, min(timeout_s, self.time_left() - 10))
        started = time.monotonic()
        try:
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
            rc, stdout, stderr = done.returncode, done.stdout, done.stderr
        except subprocess.TimeoutExpired as exc:
            rc, stdout, stderr = None, _text(exc.stdout), _text(exc.stderr) + f"\n[timed out after {timeout_s:.0f} s]"
        log_path.write_text(f"$ {shlex.join(argv)}\n--- stdout\n{stdout}\n--- stderr\n{stderr}\n")
        return {"rc": rc, "seconds": round(time.monotonic() - started, 1), "stdout": stdout, "stderr": stderr,
                "tail": (stdout + stderr)[-3000:]}

    @property
    def pgid_file(self) -> Path:
        return self.work_dir / "server-pgids.txt"

    def register_server(self, pid: int) -> None:
        """Remember a server's process group (its pid: start_new_session) for reap_leftovers."""
        with self.pgid_file.open("a") as f:
            f.write(f"{pid}\n")

    def save(self) -> None:
        """summary.json, summary.md and logs.tar.gz, each written to a temp name and renamed."""
        self.summary["elapsed_s"] = round(time.monotonic() - self.started, 1)
        _atomic_write(self.out_dir / "summary.json", json.dumps(self.summary, indent=1, default=str) + "\n")
        try:
            markdown = ipc_report.render_markdown(self.summary)
        except Exception:  # noqa: BLE001 - the JSON is written; a report bug must not end the run
            markdown = f"# summary.md could not be rendered\n\n```\n{traceback.format_exc()}```\n"
        _atomic_write(self.out_dir / "summary.md", markdown)
        tmp = self.out_dir / ".logs.tar.gz.tmp"
        try:
            with tarfile.open(tmp, "w:gz") as tar:
                tar.add(self.logs_dir, arcname="logs")
            tmp.replace(self.out_dir / "logs.tar.gz")
        except OSError as exc:
            self.summary["notes"].append(f"packing logs failed: {exc}")


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def guarded(call: Callable[[], Any]) -> Any:
    """The call's result, or the exception it raised as ``{"error": ...}``: recorded next to the other
    variants' and phases' results instead of ending the phase."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - recorded, not raised
        return {"error": f"{type(exc).__name__}: {exc}"[-3000:]}
