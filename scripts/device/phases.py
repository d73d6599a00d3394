"""The phases of the GPU evidence run; `gpu_e2e.py` sequences them and records their results.

Each phase takes the `Run` (run_state.py: paths, deadline, environment, summary) and returns
a dict merged into `summary["phases"][name]`; an exception marks only that phase failed.
Subprocess work goes through `Run.run_cmd`, whose output lands in the log archive; servers go
through `serving.py`, one round per model with every variant up at once.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
import zipfile
from pathlib import Path
from typing import Any

import e2e_report as report
import install_overlay
import repo_paths  # noqa: F401 - scripts/ on sys.path (no pip on the device) for afd_planner below
import round_records
import serving
import stage_prediction
from afd_planner.measure import EXIT_CAPTURE_FAILED
from run_state import HARNESS, HERE, REPO, Run, guarded
IMPORT_CHECK = """
import importlib.metadata as m, json, torch, vllm
from vllm_afd.pin import check_installed_vllm
stamp = check_installed_vllm()
from vllm_afd.plugin import register
register()
print(json.dumps({"vllm": vllm.__version__, "vllm_file": vllm.__file__, "torch": torch.__version__,
                  "patches": [p["name"] for p in stamp["patches"]],
                  "entry_points": {e.name: e.value for e in m.entry_points(group="vllm.general_plugins")}}))
"""
DEVICE_PROBE = """
import json, torch
cuda = torch.cuda.is_available()
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": cuda,
                  "name": torch.cuda.get_device_name(0) if cuda else "cpu",
                  "capability": list(torch.cuda.get_device_capability(0)) if cuda else None}))
"""
STAMP = Path("vllm") / "_afd_provenance.json"


def last_json(text: str) -> Any:
    """The whole text as JSON, else the last line that parses as a JSON object; None if neither."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


# ---------------------------------------------------------------------------------------- phases

def probe_device(run: Run) -> None:
    """torch's view of the device (and nvidia-smi's), for the report header."""
    probe = run.run_cmd([sys.executable, "-c", DEVICE_PROBE], env=run.env(overlay=False, vllm=False),
                        timeout_s=120, log_name="device-probe")
    info = last_json(probe["stdout"]) or {"error": probe["tail"]}
    if shutil.which("nvidia-smi"):
        smi = run.run_cmd(["nvidia-smi", "--query-gpu=name,driver_version,memory.used,memory.total",
                           "--format=csv,noheader"], env=dict(os.environ), timeout_s=30, log_name="nvidia-smi")
        info["nvidia_smi"] = smi["stdout"].strip()
    run.summary["device"] = info


def reap_leftovers(run: Run) -> None:
    """Kill server process groups an earlier, killed invocation of this script left running.

    Servers run in their own sessions, which the device does not end when a command returns;
    only groups recorded in server-pgids.txt whose leader is still a vLLM server are killed.
    """
    if not run.pgid_file.is_file():
        return
    reaped = []
    for line in run.pgid_file.read_text().split():
        pgid = int(line)
        cmdline = Path(f"/proc/{pgid}/cmdline")
        try:
            alive_vllm = b"vllm" in cmdline.read_bytes()
        except OSError:
            alive_vllm = False
        if alive_vllm:
            try:
                os.killpg(pgid, signal.SIGKILL)
                reaped.append(pgid)
            except ProcessLookupError:
                pass
    run.pgid_file.unlink()
    if reaped:
        run.summary["notes"].append(f"killed leftover server process groups of an earlier run: {reaped}")


# Pure-Python tools the GPU image lacks, carried as wheels in --extra-wheels: unidiff for
# scripts/apply_patches.py, pytest (+ its dependencies) for the `gputests` phase.
TOOL_MODULES = ("unidiff", "pytest")


def ensure_tools(run: Run) -> list[str]:
    """PYTHONPATH entries that make TOOL_MODULES importable: the image's own, else the carried wheels."""
    target = run.work_dir / "tools"
    probe = "import " + ", ".join(TOOL_MODULES)
    for entries in ([], [str(target)]):  # importable as is, or from an earlier run's install
        env = dict(os.environ, PYTHONPATH=install_overlay.join_pythonpath(entries, os.environ.get("PYTHONPATH")))
        if run.run_cmd([sys.executable, "-c", probe], env=env, timeout_s=60, log_name="tools-probe")["rc"] == 0:
            return entries
    wheels = sorted(Path(run.args.extra_wheels).expanduser().glob("*.whl"))
    missing = [name for name in TOOL_MODULES if not any(w.name.startswith(f"{name}-") for w in wheels)]
    if missing:
        raise RuntimeError(
            f"gpu_e2e: {', '.join(missing)} not importable and {run.args.extra_wheels} holds no wheel for it; "
            "expected carried wheels. On the CPU machine: python3 -m pip download --no-deps --only-binary=:all: "
            "-d .devstage/extras -r scripts/device/extras.txt, then carry .devstage/extras with this run.")
    # NOTE: a pure-Python wheel is a zip of the installed tree: unpacking it needs no pip.
    shutil.rmtree(target, ignore_errors=True)
    for wheel_path in wheels:
        with zipfile.ZipFile(wheel_path) as wheel:
            wheel.extractall(target)
    return [str(target)]


def apply_patches(run: Run, *, reverse: bool) -> dict[str, Any]:
    run.tool_entries = ensure_tools(run)
    argv = [sys.executable, str(REPO / "scripts" / "apply_patches.py"), "--apply-to", str(run.vllm_site)]
    env = dict(os.environ, PYTHONPATH=install_overlay.join_pythonpath(run.tool_entries, os.environ.get("PYTHONPATH")))
    done = run.run_cmd(argv + (["--reverse"] if reverse else []), env=env, timeout_s=180,
                       log_name="apply-patches-reverse" if reverse else "apply-patches")
    if done["rc"] != 0:
        raise RuntimeError(f"apply_patches.py {'--reverse ' if reverse else ''}failed (rc {done['rc']}): "
                           f"{done['tail']}")
    return {"rc": done["rc"], "output": done["stdout"].strip()[-1500:]}


def phase_patch(run: Run) -> dict[str, Any]:
    result = {"apply": apply_patches(run, reverse=False)}
    check = run.run_cmd([sys.executable, "-c", IMPORT_CHECK], env=run.env(), timeout_s=240, log_name="import-check")
    result["import_check"] = last_json(check["stdout"]) or {"rc": check["rc"], "tail": check["tail"]}
    if check["rc"] != 0:
        raise RuntimeError(f"import check failed (rc {check['rc']}): {check['tail']}")
    return result


def phase_models(run: Run) -> dict[str, Any]:
    argv = [sys.executable, str(HERE / "build_models.py"), "--out", str(run.work_dir / "models")]
    for arch in run.args.models:
        argv += ["--arch", arch]
    if run.args.prebuilt_models:
        argv += ["--prebuilt", str(Path(run.args.prebuilt_models).expanduser().resolve())]
    done = run.run_cmd(argv, env=run.env(overlay=False, vllm=False, extra=[str(HARNESS)]), timeout_s=300,
                       log_name="build-models")
    built = last_json(done["stdout"]) or {}
    run.models = {arch: info for arch, info in built.items() if "error" not in info}
    if done["rc"] != 0 or not run.models:
        raise RuntimeError(f"build_models.py failed (rc {done['rc']}) for "
                           f"{sorted(set(run.args.models) - set(run.models))}: {done['tail']}")
    return {"models": built}


def phase_rtt(run: Run) -> dict[str, Any]:
    out_file = run.work_dir / "rtt.json"
    out_file.unlink(missing_ok=True)
    device = "cuda" if run.args.platform == "cuda" else "cpu"
    argv = [sys.executable, str(HERE / "bench_connector_rtt.py"), "--device", device, "--shapes", run.args.rtt_shapes,
            "--steps", str(run.args.rtt_steps), "--out", str(out_file)]
    done = run.run_cmd(argv, env=run.env(overlay=False, vllm=False, extra=[str(REPO / "overlay")]), timeout_s=240,
                       log_name="bench-connector-rtt")
    if done["rc"] != 0 or not out_file.is_file():
        raise RuntimeError(f"bench_connector_rtt.py failed (rc {done['rc']}): {done['tail']}")
    result = json.loads(out_file.read_text())
    external = REPO / "scripts" / "bench_gloo_roundtrip.py"
    if external.is_file():
        helped = run.run_cmd([sys.executable, str(external), "--help"], env=run.env(), timeout_s=60,
                             log_name="bench-gloo-roundtrip-help")
        if "--device" in helped["stdout"]:
            ext = run.run_cmd([sys.executable, str(external), "--device", device,
                               *shlex.split(run.args.gloo_bench_args)],
                              env=run.env(overlay=False, vllm=False, extra=[str(REPO / "overlay")]), timeout_s=180,
                              log_name="bench-gloo-roundtrip")
            result["bench_gloo_roundtrip"] = {"rc": ext["rc"], "table": ext["stdout"].strip()[-3000:],
                                              "tail": None if ext["rc"] == 0 else ext["tail"]}
        else:
            result["bench_gloo_roundtrip"] = {"note": "present without --device; not run on the GPU"}
    else:
        result["bench_gloo_roundtrip"] = {"note": "missing"}
    return result


def phase_ipcfloor(run: Run) -> dict[str, Any]:
    """bench_ipc_floor.py: the per-layer round trip of the IPC transport, raw (graph, eager) and connector."""
    out_file = run.work_dir / "ipc_floor.json"
    out_file.unlink(missing_ok=True)
    budget_s = max(30.0, min(run.args.ipc_floor_timeout_s, run.time_left() - 15))
    argv = [sys.executable, str(HERE / "bench_ipc_floor.py"), "--shapes", run.args.ipc_floor_shapes,
            "--steps", str(run.args.ipc_floor_steps), "--timeout-s", str(int(budget_s - 10)), "--out", str(out_file)]
    done = run.run_cmd(argv, env=run.env(overlay=False, vllm=False, extra=[str(REPO / "overlay")]),
                       timeout_s=budget_s, log_name="bench-ipc-floor")
    if done["rc"] != 0 or not out_file.is_file():
        raise RuntimeError(f"bench_ipc_floor.py failed (rc {done['rc']}): {done['tail']}")
    return json.loads(out_file.read_text())


def phase_gputests(run: Run) -> dict[str, Any]:
    """The repo's GPU-marked pytest tests (CUDA-staged gloo, NCCL's one-GPU refusal) on the device."""
    if not run.tool_entries:
        run.tool_entries = ensure_tools(run)
    junit = run.work_dir / "gputests.xml"
    junit.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}",
            *shlex.split(run.args.gpu_tests)]
    done = run.run_cmd(argv, env=run.env(extra=run.tool_entries), timeout_s=300, log_name="gputests")
    text = junit.read_text() if junit.is_file() else None
    counts = report.junit_counts(text) if text else {}
    # NOTE: skips are listed, not failed; pytest's exit code already fails on failures and errors.
    ok = done["rc"] == 0 and counts.get("passed", 0) > 0
    return {"rc": done["rc"], "counts": counts, "tests": report.junit_cases(text) if text else [],
            "status": "ok" if ok else "failed", "error": None if ok else done["tail"][-2000:]}


def serve_round(run: Run, arch: str, variants: list[str], *, do_tokens: bool, do_bench: bool, prefix: str,
                env: dict[str, str]) -> dict[str, Any]:
    """Start the round's servers together, run the requests, stop them; per-step errors are recorded."""
    model = run.models[arch]
    args = run.args
    settings = serving.ServeSettings(
        platform=args.platform, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        gpu_mem_util=args.gpu_mem_util, kv_cache_bytes=args.kv_cache_bytes,
        capture_sizes=tuple(sorted({1, 2, 4, 8, 16, 32, 64, *args.bench_batches} - {0})),
        graph_compile=args.graph_compile, rendezvous_timeout_s=max(60.0, args.startup_timeout_s - 30),
        extra_args=(*model.get("serve_args", ()), *shlex.split(args.serve_args)),
        timeline_dir=str(run.logs_dir / "timeline" / arch) if args.timeline else "")
    cpu_env = model.get("serve_env", {}) if args.platform == "cpu" else {}
    ports = {variant: _free_port() for variant in variants if variant in serving.AFD_VARIANTS}
    specs = serving.server_specs(variants, settings, afd_port=ports, cpu_env=cpu_env)
    startup_timeout = max(30.0, min(args.startup_timeout_s, run.time_left() - 60))
    result: dict[str, Any] = {"variants": variants}
    own_cores = os.sched_getaffinity(0)
    if args.pin_servers:
        specs, client_cores = serving.pin_cores(specs, sorted(own_cores))
        os.sched_setaffinity(0, client_cores)  # the bench's requests and this script: the cores left over
        result["cores"] = {**{spec.name: list(spec.cores) for spec in specs}, "client": list(client_cores)}
    servers, infos = serving.start_servers(specs, Path(model["path"]), base_env=env, logs_dir=run.logs_dir,
                                           prefix=prefix, launcher=args.launcher, startup_timeout_s=startup_timeout,
                                           on_spawn=run.register_server)
    run.summary["servers"][f"{prefix}"] = infos
    try:
        urls = {spec.variant: servers[spec.name].base_url for spec in specs
                if spec.variant and infos[spec.name]["status"] == "up"}
        result["variants_up"] = sorted(urls)
        ffn = next((spec.name for spec in specs if spec.name.endswith("_ffn") and infos[spec.name]["status"] == "up"),
                   None)
        if ffn is not None:
            result["ffn_refuses_requests"] = guarded(lambda: serving.check_ffn_refuses(servers[ffn].base_url))
        if do_tokens:
            result["outputs"] = {}
            for variant, url in urls.items():
                result["outputs"][variant] = guarded(
                    lambda url=url: serving.run_token_cases(url, args.token_max_tokens, args.request_timeout_s))
        if do_bench and urls and run.time_left() > 45:
            plan = serving.BenchPlan(batches=tuple(args.bench_batches), max_tokens=args.bench_tokens,
                                     prompt_len=args.bench_prompt_len[0], repeats=args.bench_repeats,
                                     timeout_s=args.request_timeout_s)
            result["bench"] = serving.run_decode_bench(
                urls, plan, run.time_left, prompt_lens=args.bench_prompt_len if len(args.bench_prompt_len) > 1 else ())
    finally:
        # NOTE: logs up to here show the serving window; what follows is shutdown (the FFN, for one,
        # reports its lost attention peer by design), so tracebacks are counted for both spans.
        serving_sizes = {name: _size(server.log_path) for name, server in servers.items()}
        serving.stop_servers(servers, infos)
        os.sched_setaffinity(0, own_cores)
        for name, server in servers.items():
            if server.log_path.is_file():
                text = server.log_path.read_text(errors="replace")
                infos[name].update(serving.scan_log(text))
                infos[name]["num_tracebacks_serving"] = serving.scan_log(text[:serving_sizes[name]])["num_tracebacks"]
        if settings.timeline_dir:
            result["timeline"] = guarded(lambda: timeline_reports(Path(settings.timeline_dir)))
            if isinstance(result.get("bench"), dict):  # the ranks' files are complete once their servers stopped
                stage_predictions(result["bench"], Path(settings.timeline_dir))
    return result


def timeline_reports(root: Path) -> dict[str, str]:
    """scripts/timeline_report.py on each AFD variant's timeline files: markdown per variant (+ md and png)."""
    tables = {}
    # vllm_afd.wire reads the records (it imports no vLLM); the device has the overlay on no path of its own.
    overlay_env = dict(os.environ, PYTHONPATH=install_overlay.join_pythonpath([str(REPO / "overlay")],
                                                                              os.environ.get("PYTHONPATH")))
    for directory in sorted(p for p in root.iterdir() if p.is_dir()):
        done = subprocess.run([sys.executable, str(REPO / "scripts" / "timeline_report.py"), str(directory),
                               "--png", str(directory / "timeline.png"), "--markdown", str(directory / "timeline.md")],
                              capture_output=True, text=True, timeout=120, env=overlay_env)
        tables[directory.name] = done.stdout if done.returncode == 0 else f"failed: {done.stderr[-2000:]}"
    return tables


def stage_predictions(bench: dict[str, Any], root: Path) -> None:
    """stage_prediction.annotate on the round's bench; a failure is recorded there, the bench's rates stand."""
    failed = guarded(lambda: stage_prediction.annotate(bench, root))
    if failed:
        bench["stage_prediction"] = failed


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def _free_port() -> int:
    from afd_harness.server import free_port

    return free_port()


def phase_serve(run: Run, do_tokens: bool, do_bench: bool) -> None:
    """tokens / bench: one round per model; records both phases model by model."""
    records = {name: run.summary["phases"].setdefault(name, {"status": "running", "models": {}})
               for name, wanted in (("tokens", do_tokens), ("bench", do_bench)) if wanted}
    started = time.monotonic()
    failures = []
    for arch in run.args.models:
        if arch not in run.models:
            failures.append(f"{arch}: no model (models phase failed or not run)")
            continue
        if run.time_left() < run.args.min_round_s:
            failures.append(f"{arch}: skipped, {run.time_left():.0f} s left < --min-round-s {run.args.min_round_s}")
            continue
        try:
            result = serve_round(run, arch, run.args.variants, do_tokens=do_tokens, do_bench=do_bench,
                                 prefix=arch, env=run.env())
        except Exception as exc:  # noqa: BLE001 - the next model still runs
            failures.append(f"{arch}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            continue
        finally:
            run.save()
        not_up = sorted(set(result["variants"]) - set(result.get("variants_up", [])))
        if not_up:
            failures.append(f"{arch}: servers not up for {', '.join(not_up)} (see the Servers table)")
        if "timeline" in result:
            run.summary.setdefault("timeline", {})[arch] = result["timeline"]
        if do_tokens:
            records["tokens"]["models"][arch] = round_records.tokens_record(result)
        if do_bench:
            records["bench"]["models"][arch] = round_records.bench_record(result, run.models[arch])
        run.save()
    for record in records.values():
        record["seconds"] = round(time.monotonic() - started, 1)
        done = [m for m in record["models"] if "error" not in record["models"][m]]
        record["status"] = "ok" if not failures and done else ("partial" if done else "failed")
        record["error"] = "\n".join(failures) or None


def phase_pristine(run: Run) -> dict[str, Any]:
    """Plain vLLM on the unpatched tree (overlay not on the path), first model only; `patch` re-applies."""
    if (run.vllm_site / STAMP).is_file():
        apply_patches(run, reverse=True)
    arch = next(a for a in run.args.models if a in run.models)
    result = serve_round(run, arch, ["pristine_eager"], do_tokens=True, do_bench="bench" in run.args.phases,
                         prefix=f"pristine-{arch}", env=run.env(overlay=False))
    return {"model": arch, "outputs": result.get("outputs"), "bench": result.get("bench")}


def phase_hooks(run: Run) -> dict[str, Any]:
    """scripts/gpu_hook_check.py (MRV2 hooks fire right, eager and FULL_DECODE_ONLY) on the first model."""
    script = Path(run.args.hook_check_script)
    if not script.is_file():
        return {"result_status": "missing", "status": "missing"}
    arch = next((a for a in run.args.models if a in run.models), None)
    if arch is None:
        raise RuntimeError("gpu_hook_check needs a tiny model; the models phase built none")
    probe_entries = install_overlay.install(REPO / "tests" / "hook_probe", run.work_dir / "probe-site")
    hook_out = run.logs_dir / "hook_check"  # inside the log archive: per-mode vLLM logs and events
    budget_s = max(30.0, min(run.args.hook_timeout_s, run.time_left() - 20))
    fields = {"model_dir": run.models[arch]["path"], "hook_out": hook_out, "json_out": hook_out / "gpu_hook_check.json",
              "work": run.work_dir, "timeout_s": int(budget_s / 2)}  # two vLLM runs: eager, then graphs
    extra = shlex.split(run.args.hook_check_args.format(**fields))
    done = run.run_cmd([sys.executable, str(script), *extra], env=run.env(extra=probe_entries),
                       timeout_s=budget_s, log_name="gpu-hook-check")
    json_out = Path(fields["json_out"])
    parsed = json.loads(json_out.read_text()) if json_out.is_file() else last_json(done["stdout"])
    ok = done["rc"] == 0
    return {"rc": done["rc"], "model": arch, "result": parsed,
            "result_status": "passed" if ok else f"rc {done['rc']}", "status": "ok" if ok else "failed",
            "error": None if ok else done["tail"][-1500:]}


def phase_profile(run: Run) -> dict[str, Any]:
    """afd_plan.py profile on the device for each model (dummy weights, up to its first MoE layer): OUT/profiles/."""
    out_dir = run.out_dir / "profiles"
    out_dir.mkdir(exist_ok=True)
    device = "cuda" if run.args.platform == "cuda" else "cpu"
    results: dict[str, Any] = {}
    for arch in [a for a in run.args.models if a in run.models]:
        if run.time_left() < 30:
            results[arch] = {"status": "skipped", "error": f"budget: {run.time_left():.0f} s left"}
            continue
        out_file = out_dir / f"{arch}.json"
        argv = [sys.executable, str(REPO / "scripts" / "afd_plan.py"), "profile", run.models[arch]["path"],
                "--device", device, "--load-format", "dummy", "--layers", "first-moe", "--out", str(out_file),
                *shlex.split(run.args.profile_args)]
        done = run.run_cmd(argv, env=run.env(), timeout_s=max(30.0, run.time_left() - 15),
                           log_name=f"profile-{arch}")
        timing = "eager" if device == "cpu" or "--eager" in argv else "graphs"
        if done["rc"] == EXIT_CAPTURE_FAILED and run.time_left() >= 30:
            # one device run is all a session may get: an eager profile (launch costs in) beats none
            timing = f"eager: graph capture failed (profile-{arch}.log)"
            done = run.run_cmd([*argv, "--eager"], env=run.env(), timeout_s=max(30.0, run.time_left() - 15),
                               log_name=f"profile-{arch}-eager")
        ok = done["rc"] == 0 and out_file.is_file()
        results[arch] = {"rc": done["rc"], "status": "ok" if ok else "failed", "timing": timing,
                         "file": f"profiles/{out_file.name}" if ok else None,
                         "notes": [line for line in done["stdout"].splitlines() if line.startswith("note: ")],
                         "error": None if ok else done["tail"][-2000:]}
    failed = sorted(arch for arch, result in results.items() if result["status"] != "ok")
    status = "ok" if not failed else "failed" if len(failed) == len(results) else "partial"
    return {"models": results, "status": status, "error": f"no profile for {', '.join(failed)}" if failed else None}


def finalize(run: Run) -> None:
    """Cross-phase comparisons: pristine vs patched plain vLLM (tokens and tok/s)."""
    pristine = run.summary["phases"].get("pristine", {})
    tokens = run.summary["phases"].get("tokens", {}).get("models", {})
    arch = pristine.get("model")
    if arch and arch in tokens and pristine.get("outputs"):
        patched = tokens[arch]["outputs"].get("plain_eager")
        unpatched = pristine["outputs"].get("pristine_eager")
        if patched and unpatched and "error" not in patched and "error" not in unpatched:
            pristine["tokens_vs_patched_plain_eager"] = report.compare_variants(patched, unpatched)
    bench = run.summary["phases"].get("bench", {}).get("models", {})
    if arch and arch in bench and pristine.get("bench"):
        patched_rates = bench[arch].get("variants", {}).get("plain_eager", {})
        pristine_rates = pristine["bench"].get("variants", {}).get("pristine_eager", {})
        pristine["patched_over_pristine_tok_s"] = {
            batch: report.ratio((patched_rates.get(batch) or {}).get("tok_s"), (rate or {}).get("tok_s"))
            for batch, rate in pristine_rates.items()}
        run.summary["notes"].append("pristine and patched plain vLLM ran one after the other, not interleaved.")
