"""scripts/device/: the parts of the GPU evidence run that need no GPU, checked on CPU.

Device minutes are scarce, so whatever can fail before a server starts is tested here: the
overlay installer (vLLM finds plugins only through entry points), phase and size parsing,
the token comparison and rate arithmetic, the server flags of a round, log scanning, the
report, and the orchestrator's skeleton (outputs written, at most 8 files under $OUT).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

import e2e_report as report
import gpu_e2e
import install_overlay
import ipc_report
import phases
import round_records
import run_state
import serving
from bench_connector_rtt import parse_shapes, run_bench

ROOT = Path(__file__).resolve().parents[2]
DEVICE = ROOT / "scripts" / "device"


def test_read_project_of_the_overlay():
    info = install_overlay.read_project(ROOT)

    assert info.name == "vllm-afd"
    assert info.entry_points["vllm.general_plugins"] == {"afd": "vllm_afd.plugin:register"}
    assert info.package_root == ROOT / "overlay"
    assert (info.package_root / "vllm_afd" / "__init__.py").is_file()
    assert not (info.package_root / "vllm_afd" / "testing").exists()  # the harness is its own distribution


def test_device_scripts_find_the_test_harness():
    """The models phase puts run_state.HARNESS on build_models.py's PYTHONPATH; the device has no pip."""
    assert (run_state.HARNESS / "pyproject.toml").is_file()
    assert (run_state.HARNESS / "afd_harness" / "server.py").is_file()
    assert (run_state.HARNESS / "afd_harness" / "tiny_models.py").is_file()


def test_repo_paths_name_the_folders_their_modules_live_in():
    """gpu_e2e.py imports through repo_paths.ROOTS on the GPU machine, where nothing is installed."""
    import repo_paths

    for module, root in repo_paths.ROOTS.items():
        assert (root / module).is_dir() or (root / f"{module}.py").is_file(), (module, root)


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """An interpreter that has no vllm_afd of its own (a venv without site packages)."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    return str(venv / "bin" / "python")


def test_the_device_scripts_import_where_nothing_of_the_repo_is_installed(bare_python):
    """As on the GPU machine: gpu_e2e.py and every module it imports (phases -> afd_planner) find their roots."""
    done = subprocess.run([bare_python, str(ROOT / "scripts" / "device" / "gpu_e2e.py"), "--help"],
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture
def package_root(tmp_path):
    """The overlay package without the egg-info a local `pip install -e .` leaves in overlay/."""
    root = tmp_path / "pkgroot"
    shutil.copytree(ROOT / "overlay" / "vllm_afd", root / "vllm_afd", ignore=shutil.ignore_patterns("__pycache__"))
    return str(root)


def test_installed_entry_point_is_found_by_importlib_metadata(tmp_path, bare_python, package_root):
    entries = install_overlay.install(ROOT, tmp_path / "site")
    pythonpath = install_overlay.join_pythonpath([package_root], entries[1:])

    found = install_overlay.discover_entry_points(pythonpath, python=bare_python)

    assert found == {"afd": "vllm_afd.plugin:register"}
    # The entry point resolves to the real function, and names our dist-info's version.
    code = ("import importlib.metadata as m; "
            "(ep,) = m.entry_points(group='vllm.general_plugins', name='afd'); "
            "print(ep.load().__module__, ep.load().__name__, ep.dist.version)")
    done = subprocess.run([bare_python, "-c", code], env=dict(os.environ, PYTHONPATH=pythonpath),
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == ["vllm_afd.plugin", "register", "0.1.0"]


def test_entry_point_absent_without_the_dist_info(bare_python, package_root):
    """The check can fail: the package alone on the path registers no plugin."""
    assert install_overlay.discover_entry_points(package_root, python=bare_python) == {}


def test_reinstall_replaces_an_older_dist_info(tmp_path):
    site = tmp_path / "site"
    old = site / "vllm_afd-0.0.1.dist-info"
    old.mkdir(parents=True)
    (old / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-afd\nVersion: 0.0.1\n")

    install_overlay.install(ROOT, site)

    assert sorted(p.name for p in site.iterdir()) == ["vllm_afd-0.1.0.dist-info"]
    dist_info = site / "vllm_afd-0.1.0.dist-info"
    assert (dist_info / "entry_points.txt").read_text() == "[vllm.general_plugins]\nafd = vllm_afd.plugin:register\n"
    assert "Name: vllm-afd\nVersion: 0.1.0" in (dist_info / "METADATA").read_text()


def test_hook_probe_project_installs_too(tmp_path, bare_python):
    entries = install_overlay.install(ROOT / "tests" / "hook_probe", tmp_path / "probe-site")

    assert entries[0] == str(ROOT / "tests" / "hook_probe")
    found = install_overlay.discover_entry_points(os.pathsep.join(entries), python=bare_python)
    assert found == {"afd_hook_probe": "afd_hook_probe:register"}


def test_install_refuses_a_project_without_plugin_or_pyproject(tmp_path):
    with pytest.raises(FileNotFoundError, match="pyproject.toml does not exist"):
        install_overlay.install(tmp_path, tmp_path / "site")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\nversion = "1"\n')
    with pytest.raises(ValueError, match="declares no"):
        install_overlay.install(tmp_path, tmp_path / "site")


def test_join_pythonpath_keeps_order_and_drops_repeats():
    joined = install_overlay.join_pythonpath(["/a", "/b"], None, f"/b{os.pathsep}/c", [], ["/a", ""])

    assert joined.split(os.pathsep) == ["/a", "/b", "/c"]


def test_parse_phases_orders_and_rejects():
    assert report.parse_phases("tokens,patch, models") == ["models", "patch", "tokens"]
    assert report.parse_phases("all") == list(report.PHASES)
    assert report.parse_phases(",".join(report.DEFAULT_PHASES))[0] == "models"
    with pytest.raises(ValueError, match="unknown phase"):
        report.parse_phases("patch,tokenz")
    with pytest.raises(ValueError, match="none given"):
        report.parse_phases(" , ")


def test_parse_bytes_and_int_lists():
    for text, expected in (("2GiB", 2 << 30), ("512m", 512 << 20), ("1024", 1024), ("1.5 GiB", 3 << 29)):
        assert report.parse_bytes(text) == expected
    for bad in ("", "GiB", "2 TB", "-1G"):
        with pytest.raises(ValueError, match="not understood"):
            report.parse_bytes(bad)
    assert report.parse_int_list("1, 32", "--x") == [1, 32]
    for bad in ("", "0", "a,1", "-3"):
        with pytest.raises(ValueError, match="positive integers"):
            report.parse_int_list(bad, "--x")


def test_bench_prompts_are_deterministic_and_plain():
    prompts = report.bench_prompt_ids(32, 16, seed=5)

    assert prompts == report.bench_prompt_ids(32, 16, seed=5)
    assert prompts != report.bench_prompt_ids(32, 16, seed=6)
    assert {len(p) for p in prompts} == {16}
    assert all(report.FIRST_PLAIN_TOKEN_ID <= t < report.TINY_VOCAB_SIZE for p in prompts for t in p)


token_lists = st.lists(st.integers(0, 9), max_size=12)


@given(token_lists, token_lists)
def test_first_difference_is_the_first_disagreement(a, b):
    diff = report.first_difference(a, b)

    if a == b:
        assert diff is None
    else:
        assert diff is not None and a[:diff] == b[:diff]
        assert diff == min(len(a), len(b)) or a[diff] != b[diff]


def test_compare_case_reports_where_and_what():
    result = report.compare_case([[1, 2, 3, 4, 5], [7, 7], None], [[1, 2, 9, 4, 5], [7, 7], [1]])

    assert result["num_prompts"] == 3 and result["num_identical"] == 1
    first, missing = result["mismatches"]
    assert first["index"] == 0 and first["first_diff"] == 2
    assert first["ref_tokens"] == [1, 2, 3, 4, 5] and first["cand_tokens"] == [1, 2, 9, 4, 5]
    assert missing == {"index": 2, "first_diff": None, "error": "no token ids returned"}


def test_compare_variants_flags_any_mismatch_or_missing_case():
    ref = {"single": [[1, 2]], "batch": [[3], [4]]}

    assert report.compare_variants(ref, {"single": [[1, 2]], "batch": [[3], [4]]})["identical"]
    assert not report.compare_variants(ref, {"single": [[1, 2]], "batch": [[3], [5]]})["identical"]
    missing = report.compare_variants(ref, {"single": [[1, 2]]})
    assert not missing["identical"] and missing["cases_missing"] == ["batch"]
    assert not report.compare_variants(ref, {"single": [[1, 2]], "batch": [[3]]})["identical"]


def test_decode_rate_subtracts_the_one_token_request():
    rate = report.decode_rate(batch=32, max_tokens=129, full_s=1.5, prefill_s=0.5)

    assert rate == pytest.approx({"tok_s": 32 * 128 / 1.0, "tpot_ms": 1000 / 128})
    assert report.decode_rate(4, 10, full_s=0.5, prefill_s=0.6) is None
    assert report.decode_rate(4, 1, full_s=0.5, prefill_s=0.1) is None


def test_median_rate_ratios_and_percentiles():
    samples = [{"tok_s": 10.0, "tpot_ms": 3.0}, None, {"tok_s": 30.0, "tpot_ms": 1.0}, {"tok_s": 20.0, "tpot_ms": 2.0}]

    assert report.median_rate(samples) == {"tok_s": 20.0, "tpot_ms": 2.0, "tok_s_min": 10.0, "tok_s_max": 30.0,
                                           "num_samples": 3}
    assert report.median_rate([None]) is None
    assert report.ratio(3.0, 2.0) == 1.5 and report.ratio(None, 2.0) is None and report.ratio(1.0, 0.0) is None
    assert report.serving_per_layer_ms(8.0, 5.0, 3) == pytest.approx(1.0)
    assert report.serving_per_layer_ms(None, 5.0, 3) is None
    result = report.percentiles_ms([0.001 * i for i in range(1, 101)])
    assert result["p50"] == pytest.approx(50.5) and result["p99"] == pytest.approx(99.0)
    assert report.percentiles_ms([]) == {}


def test_render_markdown_shows_tables_and_ratios():
    comparison = report.compare_variants({"single": [[1, 2, 3]]}, {"single": [[1, 5, 3]]})
    same = report.compare_variants({"single": [[1]], "chat": [[2]]}, {"single": [[1]], "chat": [[2]]})
    rate = {"tok_s": 100.0, "tpot_ms": 10.0}
    summary = {
        "started_at": "2026-11-29T12:00:00+00:00", "device": {"name": "NVIDIA H200", "torch": "2.11.0"},
        "phases": {
            "patch": {"status": "ok", "seconds": 3.0},
            "tokens": {"status": "ok", "models": {"qwen3_moe": {"comparisons": {"afd_eager_vs_plain_eager": comparison,
                                                                            "plain_graphs_vs_plain_eager": same}}}},
            "bench": {"status": "ok", "models": {"qwen3_moe": {
                "batches": [32], "variants": {"plain_eager": {"32": rate}, "afd_eager": {"32": {**rate, "tok_s": 80.0}},
                                              "plain_graphs": {"32": {**rate, "tok_s": 200.0}}},
                "serving_per_layer_ms": {"32": 0.8}, "num_crossing_layers": 3, "hidden_size": 2048}}},
            "rtt": {"status": "ok", "rows": [{"rows": 64, "hidden": 2048, "raw_host_ms": {"p50": 0.4},
                                              "raw_staged_ms": {"p50": 0.5}, "connector_ms": {"p50": 0.6, "p99": 0.9}},
                                             {"rows": 32, "hidden": 2048, "raw_host_ms": {"p50": 0.4},
                                              "connector_ms": {"p50": 0.6}}]},
            "hooks": {"status": "missing", "result_status": "missing"},
        },
        "servers": {"qwen3_moe": {"afd_attention": {"status": "up", "startup_s": 41.0, "backends": ["FLASH_ATTN"]},
                                  "afd_ffn": {"status": "failed", "error": "ServerStartError: ...\nValueError: boom"}}},
    }

    text = report.render_markdown(summary)

    assert "NVIDIA H200" in text and "| qwen3_moe | afd_eager_vs_plain_eager | single | 0/1 | 1 |" in text
    assert "| qwen3_moe | plain_graphs_vs_plain_eager | all 2 cases | 2/2 | identical |" in text
    assert "| qwen3_moe | 32 | 100 | 200 | 80 | 0.8 | 0.4 | 2 |" in text
    assert "| 64x2048 | 0.4 | 0.5 | 0.6 | 0.9 | 1.2 |" in text
    assert "| qwen3_moe | 32 | 0.8 | 3 | 0.4 | 2 |" in text  # serving-derived vs the raw floor
    assert "FLASH_ATTN" in text and "status: missing" in text
    assert "### qwen3_moe / afd_ffn failed to start\n\n```\nServerStartError: ...\nValueError: boom\n```" in text
    assert ("- **qwen3_moe**: afd_eager vs plain_eager: **DIFFERENT**; plain_graphs vs plain_eager: identical; "
            "AFD/plain eager tok/s at B=32: 0.8") in text


def _args_after(args, flag):
    return args[args.index(flag) + 1]


def test_server_specs_of_a_cuda_round():
    settings = serving.ServeSettings(kv_cache_bytes=1 << 30, capture_sizes=(32, 1, 8))

    specs = {s.name: s for s in serving.server_specs(["plain_eager", "plain_graphs", "afd_eager"], settings,
                                                      afd_port=6390)}

    assert list(specs) == ["plain_eager", "plain_graphs", "afd_ffn", "afd_attention"]
    assert specs["afd_ffn"].variant is None and specs["afd_attention"].variant == "afd_eager"
    assert specs["afd_attention"].needs == "afd_ffn" and specs["plain_eager"].needs is None
    for name in ("plain_eager", "afd_ffn", "afd_attention"):
        assert "--enforce-eager" in specs[name].args
    graphs = json.loads(_args_after(specs["plain_graphs"].args, "--compilation-config"))
    assert graphs == {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 8, 32], "mode": 0}
    assert "--enforce-eager" not in specs["plain_graphs"].args
    for role in ("ffn", "attention"):
        afd = json.loads(_args_after(specs[f"afd_{role}"].args, "--additional-config"))["afd"]
        assert afd == {"role": role, "connector": "P2pGlooAFDConnector", "host": "127.0.0.1", "port": 6390,
                       "rendezvous_timeout_s": 240.0}
    assert _args_after(specs["afd_attention"].args, "--kv-cache-memory-bytes") == str(1 << 30)
    assert "--kv-cache-memory-bytes" not in specs["afd_ffn"].args
    assert all(_args_after(s.args, "--gpu-memory-utilization") == "0.25" for s in specs.values())
    assert all(s.env == {} for s in specs.values())


def test_server_specs_graph_compile_and_extra_args():
    settings = serving.ServeSettings(graph_compile="vllm", extra_args=("--foo", "1"))

    (spec,) = serving.server_specs(["plain_graphs"], settings, afd_port=1)

    assert "mode" not in json.loads(_args_after(spec.args, "--compilation-config"))
    assert spec.args[-2:] == ("--foo", "1")


def test_server_specs_on_cpu_pin_roles_to_cores_and_refuse_graphs():
    settings = serving.ServeSettings(platform="cpu")

    specs = serving.server_specs(["plain_eager", "afd_eager"], settings, afd_port=1,
                                 cpu_env={"VLLM_MLA_DISABLE": "1"})

    ffn, attention = specs[1], specs[2]
    assert ffn.env["VLLM_CPU_OMP_THREADS_BIND"] != attention.env["VLLM_CPU_OMP_THREADS_BIND"]
    assert all(s.env["VLLM_MLA_DISABLE"] == "1" for s in specs)
    assert all("--gpu-memory-utilization" not in s.args and "--kv-cache-memory-bytes" not in s.args for s in specs)
    with pytest.raises(ValueError, match="needs CUDA"):
        serving.server_specs(["plain_graphs"], settings, afd_port=1)
    with pytest.raises(ValueError, match="unknown variant"):
        serving.server_specs(["afd_graphs"], settings, afd_port=1)


def test_num_servers_counts_the_processes_server_specs_starts():
    variants = list(serving.VARIANT_SERVERS)
    afd = [v for v in variants if v in serving.AFD_VARIANTS]
    ports = {v: i for i, v in enumerate(afd)}

    for k in range(1, len(variants) + 1):
        chosen = variants[:k]
        specs = serving.server_specs(chosen, serving.ServeSettings(),
                                     afd_port={v: p for v, p in ports.items() if v in chosen})
        assert serving.num_servers(chosen) == len(specs)


def test_pin_cores_gives_each_server_cores_of_its_own_and_the_client_the_rest():
    specs = serving.server_specs(["plain_eager", "plain_graphs", "afd_ipc_graphs"], serving.ServeSettings(),
                                 afd_port=1)

    pinned, client = serving.pin_cores(specs, [15, *range(15)])

    assert [s.name for s in pinned] == [s.name for s in specs] and [s.args for s in pinned] == [s.args for s in specs]
    owned = [core for s in pinned for core in s.cores]
    assert all(len(s.cores) == serving.CORES_PER_SERVER for s in pinned) and len(set(owned)) == len(owned)
    assert set(client) == set(range(16)) - set(owned) and client
    assert serving.launch_prefix(pinned[0]) == ("taskset", "-c", "0,1") and serving.launch_prefix(specs[0]) == ()
    with pytest.raises(ValueError, match="4 servers need 9 cores"):
        serving.pin_cores(specs, range(8))


def test_a_pinned_server_command_runs_on_its_cores_only():
    core = max(os.sched_getaffinity(0))
    spec = serving.ServerSpec("x", None, (), cores=(core,))

    done = subprocess.run([*serving.launch_prefix(spec), sys.executable, "-c",
                           "import os; print(sorted(os.sched_getaffinity(0)))"],
                          capture_output=True, text=True, timeout=60, check=True)

    assert json.loads(done.stdout) == [core]


def test_scan_log():
    text = ("INFO 11-29 [cuda.py:538] Using FLASH_ATTN_MLA attention backend out of potential backends: ['A'].\n"
            "INFO 11-29 [unquantized.py:319] Using TRITON Unquantized MoE backend out of potential backends\n"
            "INFO 11-29 [unquantized.py:401] Using TritonExperts MoE backend\n"
            "INFO 11-29 [model_runner.py:1066] Graph capturing finished in 3 secs, took 0.05 GiB\n"
            "Traceback (most recent call last):\nERROR 11-29 [core.py:1] EngineCore failed to start.\n")

    facts = serving.scan_log(text)

    assert facts == {"backends": ["FLASH_ATTN_MLA"], "moe_backends": ["TritonExperts"], "graphs_captured": True,
                     "num_ffn_graphs": 0, "ffn_missing_graphs": [], "graph_capture_s": 3,
                     "num_tracebacks": 1, "last_error": "ERROR 11-29 [core.py:1] EngineCore failed to start."}
    assert serving.scan_log("nothing")["graphs_captured"] is False


def test_scan_log_counts_the_ffns_own_graphs_and_names_the_missing_ones():
    text = ("INFO [runner.py:140] AFD FFN: captured a CUDA graph for step counts ((0, (1,)),)\n"
            "INFO [runner.py:140] AFD FFN: captured a CUDA graph for step counts ((0, (2,)),)\n"
            "WARNING [runner.py:150] AFD FFN: the attention replays a CUDA graph for step counts ((0, (3,)),), "
            "which this FFN did not capture; running those steps eagerly\n")

    facts = serving.scan_log(text)

    assert facts["graphs_captured"] is True
    assert facts["num_ffn_graphs"] == 2
    assert facts["ffn_missing_graphs"] == ["((0, (3,)),)"]


def _parse(*argv, out="x"):
    parser = gpu_e2e.build_parser()
    args = parser.parse_args(["--out", out, *argv])
    gpu_e2e.check_args(parser, args)
    return args


def test_cli_defaults_and_checks(capsys):
    args = _parse()
    assert args.phases == ["models", "patch", "gputests", "rtt", "ipcfloor", "tokens", "bench", "hooks"]
    assert args.variants == ["plain_eager", "plain_graphs", "afd_eager", "afd_ipc_eager", "afd_ipc_graphs"]
    assert args.models == ["qwen3_moe", "deepseek_v2_mla"] and args.kv_cache_bytes == 2 << 30
    cpu = _parse("--platform", "cpu")
    assert cpu.variants == ["plain_eager", "afd_eager"] and "ipcfloor" not in cpu.phases  # nothing that needs CUDA
    assert _parse("--phases", "bench,patch").phases == ["models", "patch", "bench"]
    assert _parse("--phases", "patch,rtt").phases == ["patch", "rtt"]
    for argv, message in ((["--bench-batches", "1,128"], "exceeds --max-num-seqs"),
                          (["--phases", "tokens,gpu"], "unknown phase"),
                          (["--variants", "afd_eager"], "plain_eager plus"),
                          (["--kv-cache-bytes", "lots"], "not understood"),
                          (["--platform", "cpu", "--pin-servers"], "binds each role's threads")):
        with pytest.raises(SystemExit):
            _parse(*argv)
        assert message in capsys.readouterr().err


def test_cli_refuses_pinning_more_servers_than_cores(capsys, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)))

    assert _parse("--pin-servers", "--variants", "plain_eager,plain_graphs,afd_ipc_graphs").pin_servers
    with pytest.raises(SystemExit):
        _parse("--pin-servers", "--variants", "plain_eager,plain_graphs,afd_ipc_graphs,afd_ipc_graphs_s2")
    assert "6 servers need 13 cores" in capsys.readouterr().err


def test_run_skeleton_records_a_failed_phase_and_keeps_outputs_within_device_limits(tmp_path):
    """A patch phase on a directory without vllm/ fails; summary, report and log archive still come back."""
    out = tmp_path / "out"
    code = gpu_e2e.main(["--out", str(out), "--phases", "patch", "--platform", "cpu", "--work", str(tmp_path / "w"),
                         "--afd-site", str(tmp_path / "site"), "--vllm-site", str(tmp_path / "vs"),
                         "--budget-s", "120"])

    summary = json.loads((out / "summary.json").read_text())
    assert code == 1 and summary["phases"]["patch"]["status"] == "failed"
    assert "no vllm/ directory inside" in summary["phases"]["patch"]["error"]
    assert summary["device"]["cuda_available"] is False
    assert (tmp_path / "site" / "vllm_afd-0.1.0.dist-info" / "entry_points.txt").is_file()
    assert "| patch | failed |" in (out / "summary.md").read_text()
    files = [p for p in out.rglob("*") if p.is_file()]
    assert sorted(p.name for p in files) == ["logs.tar.gz", "summary.json", "summary.md"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert {"logs/device-probe.log", "logs/apply-patches.log"} <= set(tar.getnames())


def test_hook_phase_without_the_script_says_missing(tmp_path):
    run = run_state.Run(_parse("--work", str(tmp_path / "w"), "--afd-site", str(tmp_path / "site"),
                             "--hook-check-script", str(tmp_path / "absent.py"), out=str(tmp_path / "out")))
    run.models = {"qwen3_moe": {"path": str(tmp_path / "model")}}

    assert phases.phase_hooks(run) == {"result_status": "missing", "status": "missing"}


def test_the_profile_phase_writes_a_profile_per_model_that_comes_back(tmp_path):
    """On CPU the phase runs the same `afd_plan.py profile` the GPU run does (a tiny grid)."""
    pytest.importorskip("vllm")
    out = tmp_path / "out"
    code = gpu_e2e.main(["--out", str(out), "--phases", "profile", "--platform", "cpu", "--models", "qwen3_moe",
                         "--work", str(tmp_path / "w"), "--afd-site", str(tmp_path / "site"),
                         "--vllm-site", str(tmp_path / "vs"), "--budget-s", "280",
                         "--profile-args",
                         "--batches 1 --contexts 16 --tokens 1 --warmup 0 --repeats 1 --no-transport"])

    summary = json.loads((out / "summary.json").read_text())
    record = summary["phases"]["profile"]["models"]["qwen3_moe"]
    assert code == 0 and record["status"] == "ok", record["error"]
    assert record["file"] == "profiles/qwen3_moe.json" and len(record["notes"]) == 5
    assert "2 of 3 layers built; layer 1" in json.loads((out / record["file"]).read_text())["source"]


def test_a_profile_whose_graph_capture_fails_is_taken_again_eagerly(tmp_path):
    """One device run is all a session may get: a layer that cannot be captured costs the graphs, not the profile."""
    from afd_planner.measure import EXIT_CAPTURE_FAILED

    class CaptureFailsOnce(run_state.Run):
        def run_cmd(self, argv, *, env, timeout_s, log_name):
            self.calls.append((log_name, argv))
            if "--eager" not in argv:
                tail = "afd_plan: profile: capturing the FFN at T 8 in a CUDA graph failed"
                return {"rc": EXIT_CAPTURE_FAILED, "stdout": "", "tail": tail}
            Path(argv[argv.index("--out") + 1]).write_text("{}")
            return {"rc": 0, "stdout": "note: ffn T 8: 1.0 ms (1.0..1.0)\n", "tail": ""}

    run = CaptureFailsOnce(_parse("--work", str(tmp_path / "w"), "--afd-site", str(tmp_path / "site"),
                                  "--models", "qwen3_moe", out=str(tmp_path / "out")))
    run.calls, run.models = [], {"qwen3_moe": {"path": str(tmp_path / "model")}}

    result = phases.phase_profile(run)

    assert [name for name, _ in run.calls] == ["profile-qwen3_moe", "profile-qwen3_moe-eager"]
    record = result["models"]["qwen3_moe"]
    assert result["status"] == "ok" and record["timing"] == "eager: graph capture failed (profile-qwen3_moe.log)"
    assert record["notes"] == ["note: ffn T 8: 1.0 ms (1.0..1.0)"]


def test_a_profile_that_fails_otherwise_is_not_taken_again(tmp_path):
    """Only the capture's own exit status asks for --eager: any other failure is reported as it is."""
    class Fails(run_state.Run):
        def run_cmd(self, argv, *, env, timeout_s, log_name):
            self.calls.append(log_name)
            return {"rc": 1, "stdout": "", "tail": "afd_plan: profile: out of memory (not in a CUDA graph failed)"}

    run = Fails(_parse("--work", str(tmp_path / "w"), "--afd-site", str(tmp_path / "site"),
                       "--models", "qwen3_moe", out=str(tmp_path / "out")))
    run.calls, run.models = [], {"qwen3_moe": {"path": str(tmp_path / "model")}}

    result = phases.phase_profile(run)

    assert run.calls == ["profile-qwen3_moe"]
    assert result["status"] == "failed" and result["models"]["qwen3_moe"]["timing"] == "graphs"


def test_subprocesses_find_cute_dsl_packages_that_only_a_pth_file_names(tmp_path):
    """PYTHONPATH skips .pth files: the staged site's CuTe DSL folder is named on it, once staged."""
    site = tmp_path / "vs"
    (site / "vllm").mkdir(parents=True)
    args = _parse("--work", str(tmp_path / "w"), "--afd-site", str(tmp_path / "site"), "--vllm-site", str(site),
                  out=str(tmp_path / "out"))
    assert run_state.Run(args).env()["PYTHONPATH"].split(os.pathsep)[0] == str(site)
    assert "dsl_packages" not in run_state.Run(args).env()["PYTHONPATH"]

    (site / "nvidia_cutlass_dsl" / "dsl_packages" / "cutlass").mkdir(parents=True)
    (site / "nvidia_cutlass_dsl" / "dsl_packages" / "cutlass" / "__init__.py").write_text("STAGED = True\n")
    env = run_state.Run(args).env()
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [str(site), str(site / "nvidia_cutlass_dsl" / "dsl_packages")]
    assert run_state.Run(args).env(vllm=False)["PYTHONPATH"].find(str(site)) == -1
    done = subprocess.run([sys.executable, "-c", "import cutlass; print(cutlass.STAGED)"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "True", done.stderr


def test_run_keeps_inside_the_device_command_limit(tmp_path):
    """--command-start: a command that began 590 s ago has no time left, so phases are skipped."""
    out = tmp_path / "out"
    gpu_e2e.main(["--out", str(out), "--phases", "hooks", "--platform", "cpu", "--work", str(tmp_path / "w"),
                  "--afd-site", str(tmp_path / "site"), "--vllm-site", str(tmp_path / "vs"),
                  "--command-start", str(time.time() - 590), "--command-limit-s", "600"])

    summary = json.loads((out / "summary.json").read_text())
    assert summary["budget_s"] < 0
    assert summary["phases"]["hooks"]["status"] == "skipped"


def test_parse_shapes_and_last_json():
    assert phases.last_json('{"a": 1}') == {"a": 1}
    assert phases.last_json('noise\n{"b": 2}\n{"c": 3}\ntrailer') == {"c": 3}
    assert phases.last_json("no json") is None
    assert parse_shapes("1x128, 64X2048") == [(1, 128), (64, 2048)]
    for bad in ("1x", "0x128", "ax2"):
        with pytest.raises(ValueError, match="ROWSxHIDDEN"):
            parse_shapes(bad)


def _local_imports(path: Path, local: set[str]) -> set[str]:
    """The sibling modules `path` imports anywhere (TYPE_CHECKING blocks and functions included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names & local


def test_device_imports_point_one_way():
    """No cycle among scripts/device modules: each can be read knowing only what it imports."""
    modules = {path.stem: path for path in DEVICE.glob("*.py")}
    graph = {name: _local_imports(path, set(modules) - {name}) for name, path in modules.items()}
    assert graph["phases"] >= {"run_state", "serving"} and "gpu_e2e" not in graph["phases"]
    order: list[str] = []
    while len(order) < len(graph):
        ready = sorted(name for name, deps in graph.items() if name not in order and deps <= set(order))
        assert ready, f"import cycle among {sorted(set(graph) - set(order))}: {graph}"
        order += ready


def test_connector_bench_runs_on_cpu():
    """Drives the real gloo protocol between two processes: catches drift of the connector API."""
    result = run_bench("cpu", [(2, 64)], layers=2, steps=3, warmup=1, timeout_s=120)

    (row,) = result["rows"]
    assert row["rows"] == 2 and row["hidden"] == 64 and row["bytes"] == 256
    assert row["raw_host_ms"]["p50"] > 0 and row["connector_ms"]["p50"] > 0
    assert row["connector_over_raw_p50"] > 0 and "raw_staged_ms" not in row



def test_server_specs_give_each_afd_variant_its_own_timeline_dir():
    settings = serving.ServeSettings(timeline_dir="/w/logs/timeline/qwen3_moe")

    specs = {s.name: s for s in serving.server_specs(["plain_eager", "afd_ipc_graphs"], settings, afd_port=7)}

    for role in ("ffn", "attention"):
        afd = json.loads(_args_after(specs[f"afd_ipcg_{role}"].args, "--additional-config"))["afd"]
        assert afd["timeline_dir"] == "/w/logs/timeline/qwen3_moe/afd_ipc_graphs"
    assert "--additional-config" not in specs["plain_eager"].args


def test_the_report_has_a_row_per_prompt_length_and_the_timeline_tables():
    rate = {"tok_s": 100.0, "tpot_ms": 10.0}
    by_len = {"512": {"batches": [1],
                      "variants": {"plain_graphs": {"1": rate}, "afd_ipc_graphs": {"1": {**rate, "tok_s": 80.0}}},
                      "serving_per_layer_ms_by_variant": {"afd_ipc_graphs": {"1": 0.5}}}}
    summary = {"phases": {"bench": {"status": "ok", "models": {"qwen3_30b_a3b_4l": {
        "batches": [1], "variants": by_len["512"]["variants"], "by_prompt_len": by_len}}}},
        "timeline": {"qwen3_30b_a3b_4l": {"afd_ipc_graphs": "| kind | rows |\n|---|---|\n| graph replay | 1 |"}}}

    text = report.render_markdown(summary)

    assert "| qwen3_30b_a3b_4l | 512 | 1 | — | 100 | 80 | 0.8 | 0.5 |" in text
    assert "### Timeline, qwen3_30b_a3b_4l" in text and "| graph replay | 1 |" in text


def test_bench_prompt_lengths_parse_as_a_list(capsys):
    args = gpu_e2e.build_parser().parse_args(["--out", "/tmp/x", "--bench-prompt-len", "512,8192", "--timeline"])

    assert args.bench_prompt_len == [512, 8192] and args.timeline


# ---- the decode bench's method: unique prompts, per-rep samples, ratios paired by rep ----------------------


class FakeServers:
    """Stands in for afd_harness.server.complete_batch: records every request; a max_tokens request takes
    `full_s`, a 1-token one nothing; the server at `failing_url` raises from its `failing_from`-th request on."""

    def __init__(self, full_s: float = 0.0, failing_url: str = "", failing_from: int = 0) -> None:
        self.full_s, self.failing_url, self.failing_from = full_s, failing_url, failing_from
        self.requests: list[tuple[str, list[tuple[int, ...]], int]] = []

    def __call__(self, url, prompts, max_tokens, *, timeout_s, ignore_eos):
        self.requests.append((url, [tuple(p) for p in prompts], max_tokens))
        if url == self.failing_url and sum(r[0] == url for r in self.requests) >= self.failing_from:
            raise ConnectionError("server gone")
        if max_tokens > 1:
            time.sleep(self.full_s)
        return [SimpleNamespace(token_ids=[7] * max_tokens) for _ in prompts]


URLS = {"plain_eager": "http://eager", "plain_graphs": "http://graphs", "afd_ipc_graphs": "http://afd"}


def test_no_prompt_repeats_over_a_whole_bench_plan():
    """Every request (the 1-token one too), every rep (warm-up included), every prompt length: its own prompts."""
    fake = FakeServers()
    plan = serving.BenchPlan(batches=(1, 4), max_tokens=3, prompt_len=5, repeats=2, warmup=1)

    result = serving.run_decode_bench(URLS, plan, lambda: 1e9, prompt_lens=(5, 7), send=fake)

    prompts = [p for _, batch, _ in fake.requests for p in batch]
    assert len(prompts) == 2 * 3 * (1 + 4) * 3 * 2  # lengths x reps x rows x variants x (full, 1-token)
    assert len(set(prompts)) == len(prompts)
    assert len({p[:2] for p in prompts}) == len(prompts)  # no two share a first block, across lengths too
    assert sorted({len(p) for p in prompts}) == [5, 7]
    assert all(report.FIRST_PLAIN_TOKEN_ID <= i < report.TINY_VOCAB_SIZE for p in prompts for i in p)
    assert sorted(result["by_prompt_len"]) == ["5", "7"] and result["completed_reps"] == 3


def test_the_bench_prompts_fit_every_models_vocabulary():
    """The tiny and the real-shape models share the tiny tokenizer: ids 6..511 are plain tokens in all of them."""
    from afd_harness import tiny_models

    assert tiny_models.VOCAB_SIZE == report.TINY_VOCAB_SIZE
    assert len(tiny_models.SPECIAL_TOKENS) == report.FIRST_PLAIN_TOKEN_ID
    assert all("vocab_size" not in arch.config for arch in tiny_models.TINY_ARCHS.values())
    prompts = serving.bench_prompts(3)
    assert prompts.capacity == (report.TINY_VOCAB_SIZE - report.FIRST_PLAIN_TOKEN_ID) ** 2
    assert max(i for p in prompts.batch(600) for i in p) == report.TINY_VOCAB_SIZE - 1


def test_an_erroring_variant_keeps_its_place_in_every_rep_as_none():
    # The AFD server answers the warm-up rep and the first recorded one (4 requests each), then fails.
    fake = FakeServers(full_s=0.03, failing_url=URLS["afd_ipc_graphs"], failing_from=9)
    plan = serving.BenchPlan(batches=(1, 2), max_tokens=3, prompt_len=4, repeats=3, warmup=1)

    result = serving.run_decode_bench(URLS, plan, lambda: 1e9, send=fake)

    per_rep = result["per_rep_tok_s"]
    assert set(per_rep) == set(URLS) and result["completed_reps"] == 4
    for batch in ("1", "2"):
        assert all(len(per_rep[v][batch]) == 3 for v in URLS)  # the warm-up rep is not recorded
        assert all(isinstance(x, float) for v in ("plain_eager", "plain_graphs") for x in per_rep[v][batch])
        assert isinstance(per_rep["afd_ipc_graphs"][batch][0], float)
        assert per_rep["afd_ipc_graphs"][batch][1:] == [None, None]
        assert len(result["windows_ns"]["afd_ipc_graphs"][batch]) == 1
        assert result["variants"]["afd_ipc_graphs"][batch]["num_samples"] == 1
    assert "ConnectionError: server gone" in result["errors"]["afd_ipc_graphs"]

    bench = round_records.bench_record({"bench": result}, {"config": {"num_hidden_layers": 3, "hidden_size": 128}})

    cell = bench["paired"]["afd_ipc_graphs/plain_graphs"]["2"]
    assert (cell["num_paired"], cell["num_missing"]) == (1, 2)
    assert cell["ratios"][1:] == [None, None] and cell["median"] == cell["ratios"][0]
    assert cell["first_half"] is None and cell["halves_differ"] is None  # one paired rep has no halves
    assert bench["paired"]["plain_graphs/plain_eager"]["2"]["num_paired"] == 3


def _rates(values):
    return report.median_rate([{"tok_s": v, "tpot_ms": 1000.0 / v} for v in values])


def _bench_with_reps(per_rep, batch=32, prompt_len=32):
    return {"batches": [batch], "prompt_len": prompt_len,
            "variants": {v: {str(batch): _rates(reps)} for v, reps in per_rep.items()},
            "per_rep_tok_s": {v: {str(batch): list(reps)} for v, reps in per_rep.items()}}


MODEL = {"config": {"num_hidden_layers": 3, "hidden_size": 128}}
# Per-rep ratios AFD ÷ plain graphs 0.95, 0.8, 1.1, 0.5: median 0.875, halves 0.875 and 0.8; the median rates give
# 53 / 65 = 0.815; rates paired after sorting (not by rep) would give 0.821.
REPS = {"plain_eager": [50.0, 25.0, 30.0, 35.0], "plain_graphs": [100.0, 50.0, 60.0, 70.0],
        "afd_ipc_graphs": [95.0, 40.0, 66.0, 35.0]}


def test_ratios_pair_by_rep_with_their_spread_halves_and_the_old_ratio_of_medians():
    bench = round_records.bench_record({"bench": _bench_with_reps(REPS)}, MODEL)

    assert sorted(bench["paired"]) == ["afd_ipc_graphs/plain_eager", "afd_ipc_graphs/plain_graphs",
                                       "plain_graphs/plain_eager"]
    cell = bench["paired"]["afd_ipc_graphs/plain_graphs"]["32"]
    assert cell["ratios"] == pytest.approx([0.95, 0.8, 1.1, 0.5])
    assert cell["median"] == pytest.approx(0.875)
    assert (cell["min"], cell["max"]) == pytest.approx((0.5, 1.1))
    assert (cell["first_half"], cell["second_half"]) == pytest.approx((0.875, 0.8))
    assert cell["halves_differ"] == pytest.approx(0.09375)
    assert cell["median_of_rates"] == pytest.approx(53.0 / 65.0)
    assert (cell["num_paired"], cell["num_missing"]) == (4, 0)
    assert bench["paired"]["plain_graphs/plain_eager"]["32"]["median"] == pytest.approx(2.0)
    # The old keys stand: median rates per variant, the serving cost per layer.
    assert bench["variants"]["afd_ipc_graphs"]["32"]["tok_s"] == pytest.approx(53.0)
    assert set(bench["serving_per_layer_ms_by_variant"]) == {"afd_ipc_graphs"}


def test_every_prompt_length_gets_its_own_paired_ratios_and_an_old_bench_none():
    parts = {"512": _bench_with_reps(REPS, prompt_len=512),
             "8192": _bench_with_reps({**REPS, "afd_ipc_graphs": [50.0, 25.0, 30.0, 35.0]}, prompt_len=8192)}
    bench = round_records.bench_record({"bench": {**parts["512"], "by_prompt_len": parts}}, MODEL)

    assert bench["by_prompt_len"]["8192"]["paired"]["afd_ipc_graphs/plain_graphs"]["32"]["median"] == 0.5
    assert bench["by_prompt_len"]["512"]["paired"]["afd_ipc_graphs/plain_graphs"]["32"]["median"] == 0.875
    old = {"batches": [32], "variants": {v: {"32": _rates(r)} for v, r in REPS.items()}}
    assert round_records.bench_record({"bench": old}, MODEL)["paired"] == {}


def test_the_report_prints_each_per_rep_ratio_with_its_spread_and_halves():
    bench = round_records.bench_record({"bench": _bench_with_reps(REPS)}, MODEL)

    text = report.render_markdown({"phases": {"bench": {"status": "ok", "models": {"m": bench}}}})

    assert "### Decode throughput ratios per repetition" in text
    assert ("| m | 32 | 32 | afd_ipc_graphs ÷ plain_graphs | 0.875 | 0.5–1.1 | 0.875 | 0.8 | 9.4 % | 0.815 | 4/4 |"
            in text)
    assert "| m | 32 | 32 | plain_graphs ÷ plain_eager | 2 | 2–2 | 2 | 2 | 0.0 % | 2 | 4/4 |" in text
    assert "| m | 32 | 32.5 | 65 | — | — | — | 2 |" in text  # the rates' table: tok/s medians
    # ...whose ratios are the paired medians: 0.875 and 1.75, not the median rates' 53 / 65 and 53 / 32.5
    ipc_text = "\n".join(ipc_report.throughput_lines({"models": {"m": bench}}))
    assert "| m | 32 | 53 | — | 0.875 | 1.75 | — | — |" in ipc_text


def test_each_servers_rate_spread_between_repetitions_is_recorded_and_printed():
    reps = {**REPS, "afd_ipc_graphs": [95.0, None, 40.0, None], "plain_eager": [50.0, None, None, None]}
    bench = round_records.bench_record({"bench": _bench_with_reps(REPS)
                                        | {"per_rep_tok_s": {v: {"32": r} for v, r in reps.items()}}}, MODEL)

    # plain graphs 100, 50, 60, 70: mean 70, population deviation sqrt(350), median 65
    assert bench["rate_spread"]["plain_graphs"]["32"] == pytest.approx(
        {"num_reps": 4, "cv": 350 ** 0.5 / 70, "slowest": 50 / 65, "fastest": 100 / 65})
    assert bench["rate_spread"]["afd_ipc_graphs"]["32"]["num_reps"] == 2  # the reps without a rate left out
    assert "plain_eager" not in bench["rate_spread"]  # one rate: no spread
    text = report.render_markdown({"phases": {"bench": {"status": "ok", "models": {"m": bench}}}})
    assert "### Each server's rate between repetitions" in text
    assert "| m | 32 | 32 | plain_graphs | 4 | 0.267 | 0.77 | 1.54 |" in text


def test_the_report_of_a_short_bench_prints_dashes_for_missing_halves():
    reps = {"plain_graphs": [100.0, None], "afd_ipc_graphs": [80.0, 90.0]}
    bench = round_records.bench_record({"bench": _bench_with_reps({"plain_graphs": [100.0], "afd_ipc_graphs": [80.0]})
                                        | {"per_rep_tok_s": {v: {"32": r} for v, r in reps.items()}}}, MODEL)

    text = report.render_markdown({"phases": {"bench": {"status": "ok", "models": {"m": bench}}}})

    assert "| m | 32 | 32 | afd_ipc_graphs ÷ plain_graphs | 0.8 | 0.8–0.8 | — | — | — | 0.8 | 1/2 |" in text


def test_the_paired_ratios_name_only_variants_the_round_knows():
    assert set(report.AFD_VARIANTS) == set(serving.AFD_VARIANTS)
    names = {name for pair in report.PAIRED_RATIOS for name in pair}
    assert names <= set(serving.VARIANT_SERVERS) and len(set(report.PAIRED_RATIOS)) == len(report.PAIRED_RATIOS)
    assert ("afd_ipc_graphs_s2", "afd_ipc_graphs") in report.PAIRED_RATIOS
    assert ("afd_ipc_graphs", "plain_graphs") in report.PAIRED_RATIOS


def test_a_run_with_the_bench_serves_without_prefix_caching_unless_asked(capsys):
    assert _parse("--phases", "tokens,bench").serve_args == "--no-enable-prefix-caching"
    assert _parse().serve_args == "--no-enable-prefix-caching"  # the default phases include the bench
    assert _parse("--phases", "tokens").serve_args == ""
    assert _parse("--phases", "bench", "--bench-prefix-caching").serve_args == ""
    assert _parse("--phases", "bench", "--serve-args=--enable-prefix-caching").serve_args == "--enable-prefix-caching"
    assert _parse("--phases", "bench", "--serve-args=--seed 1").serve_args == "--seed 1 --no-enable-prefix-caching"
    for argv, message in ((["--bench-prompt-len", "1,512"], "pass lengths >= 2"),
                          (["--bench-batches", "64", "--bench-repeats", "500"], "unique ones the tiny vocabulary")):
        with pytest.raises(SystemExit):
            _parse(*argv)
        assert message in capsys.readouterr().err
