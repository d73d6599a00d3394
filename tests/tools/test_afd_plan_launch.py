"""afd_planner/launch.py: the printed `vllm serve` commands place every rank once, and vLLM's own parser takes them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import afd_plan
from afd_planner.launch import Cluster, across_hosts, afd_commands, colocated_commands, place
from tests.tools.test_afd_plan import FLAT, toy, write


@given(st.integers(1, 40), st.integers(1, 40), st.integers(1, 16))
@example(attention=9, ffn=7, gpus_per_host=8)  # a host holding both roles
def test_every_rank_takes_one_gpu_of_one_host(attention, ffn, gpus_per_host):
    shares = place([("ffn", ffn), ("attention", attention)], gpus_per_host)
    slots = [(s.host, g) for s in shares for g in s.gpus]
    assert len(slots) == len(set(slots)) == attention + ffn
    assert all(0 <= g < gpus_per_host for _, g in slots)
    for role, ranks in (("ffn", ffn), ("attention", attention)):
        mine = [s for s in shares if s.role == role]
        assert [r for s in mine for r in range(s.start_rank, s.start_rank + len(s.gpus))] == list(range(ranks))
    assert min(s.host for s in shares if s.role == "attention") >= max(s.host for s in shares if s.role == "ffn")
    assert shares[0].role == "ffn" and shares[0].host == 0 and shares[0].gpus[0] == 0  # FFN rank 0 hosts the store


@pytest.mark.parametrize(("gpus_per_host", "link", "hosts", "ipc"), [
    (0, None, 1, True),        # the profile's own wire: one host
    (0, "nvlink", 1, True),
    (0, "pcie", 1, True),
    (0, "ib", 8, False),       # every collective on --link: one GPU per host, as the cost model prices it
    (4, "ib", 2, True),        # hosts of 4 with NVLink inside
])
def test_the_cluster_is_the_one_the_cost_model_prices(gpus_per_host, link, hosts, ipc):
    cluster = Cluster.of(8, gpus_per_host, link, "nvlink")
    assert (cluster.num_hosts, cluster.one_node_link) == (hosts, ipc)
    assert cluster.address(0) == ("127.0.0.1" if hosts == 1 else "host0")


# NOTE: in a child process: building `vllm serve`'s parser loads vLLM's general plugins, and the overlay's routes
# the `vllm_afd` logger through vLLM's handlers for the rest of the process (plugin.py), which later tests'
# caplog would then miss (tests/overlay/test_plugin_logging.py runs its children the same way).
PARSE_CHILD = r"""
import json, shlex, sys
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.cli.serve import cmd_init
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm_afd.config import parse_afd_config

root = FlexibleArgumentParser()
subparsers = root.add_subparsers(dest="subparser")
for subcommand in cmd_init():
    subcommand.subparser_init(subparsers)
out = []
for command in json.load(sys.stdin):
    words = shlex.split(command)
    args = root.parse_args(words[words.index("vllm") + 1:])
    engine = EngineArgs.from_cli_args(args)
    config = parse_afd_config(engine)
    out.append({"env": dict(w.split("=", 1) for w in words[:words.index("vllm")]), "subparser": args.subparser,
                "headless": args.headless, "port": args.port, "afd": config and {
                    k: getattr(config, k) for k in ("role", "host", "port", "connector", "num_stages",
                                                    "reform_timeout_s")},
                **{k: getattr(engine, k) for k in ("data_parallel_size", "data_parallel_size_local",
                                                   "data_parallel_start_rank", "enable_expert_parallel",
                                                   "all2all_backend", "tensor_parallel_size", "enforce_eager")}})
print(json.dumps(out))
"""


def _parse(commands: list[str], model_dir) -> list[dict]:
    """What the installed vLLM's `vllm serve` parser makes of each command (and the overlay of its config)."""
    pytest.importorskip("vllm")
    commands = [c.replace(" M ", f" {model_dir} ", 1) for c in commands]
    result = subprocess.run([sys.executable, "-c", PARSE_CHILD], input=json.dumps(commands), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    parsed = json.loads(result.stdout.splitlines()[-1])
    assert [p["subparser"] for p in parsed] == ["serve"] * len(commands)
    return parsed


def _hosted(lines: list[str]) -> list[tuple[str, str]]:
    """(host comment, command) pairs; one host: no comments."""
    host, out = "", []
    for line in lines:
        if line.startswith("# "):
            host = line[2:].split(":")[0]
        else:
            out.append((host, line.replace("\\\n", " ")))
    return out


def _check_afd(lines: list[str], attention: int, ffn: int, gpus_per_host: int, tmp_path) -> list[dict]:
    """Parse every command; each role's DP ranks come out 0..N-1 once; a host's roles own disjoint GPUs."""
    hosted = _hosted(lines)
    parsed = _parse([command for _, command in hosted], tmp_path)
    ranks = {"ffn": [], "attention": []}
    owned: dict[str, list[str]] = {}
    for (host, _), p in zip(hosted, parsed):
        config = p["afd"]
        size = p["data_parallel_size"]
        assert size == (ffn if config["role"] == "ffn" else attention)
        local = p["data_parallel_size_local"] or size
        start = p["data_parallel_start_rank"] or 0
        ranks[config["role"]] += range(start, start + local)
        assert p["headless"] == (start > 0)
        assert p["port"] in (8000, 8001) or p["headless"]
        visible = p["env"].get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(local)))).split(",")
        owned.setdefault(host, []).extend(visible[:local])
        assert p["enable_expert_parallel"] == (config["role"] == "ffn" and ffn > 1)
        if p["enable_expert_parallel"]:
            assert p["all2all_backend"] == "allgather_reducescatter"  # what validation.py asks of a pool
    assert ranks == {"ffn": list(range(ffn)), "attention": list(range(attention))}
    for gpus in owned.values():
        assert len(gpus) == len(set(gpus)) <= gpus_per_host
    assert len({(p["afd"]["host"], p["afd"]["port"], p["afd"]["connector"], p["afd"]["num_stages"])
                for p in parsed}) == 1
    return [p["afd"] for p in parsed]


def test_one_host_gives_each_role_its_own_gpus_first(tmp_path):
    lines = afd_commands(7, 1, 2, "M", Cluster.of(8, 0, "nvlink", "nvlink"), 6390)
    assert lines[0].startswith("CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 vllm serve M --port 8001 ")
    assert lines[1].startswith("CUDA_VISIBLE_DEVICES=1,2,3,4,5,6,7,0 vllm serve M --port 8000 --data-parallel-size 7 ")
    configs = _check_afd(lines, 7, 1, 8, tmp_path)
    assert {(c["connector"], c["host"]) for c in configs} == {("P2pIpcAFDConnector", "127.0.0.1")}


def test_an_ffn_pool_on_two_hosts_runs_a_front_and_a_headless_rank(tmp_path):
    """operations.md's pool across hosts: FFN rank 0's host holds the store; the attention on hosts of its own."""
    cluster = Cluster.of(16, 4, "ib", "nvlink", ("10.0.0.5", "10.0.0.6", "10.0.0.7", "10.0.0.8"))
    lines = afd_commands(8, 8, 1, "M", cluster, 6390)
    hosted = _hosted(lines)
    assert [h for h, _ in hosted] == ["10.0.0.5", "10.0.0.6", "10.0.0.7", "10.0.0.8"]
    assert ("--port 8001 --data-parallel-size 8 --data-parallel-size-local 4 --data-parallel-address 10.0.0.5 "
            "--data-parallel-rpc-port 13345 --enable-expert-parallel --all2all-backend allgather_reducescatter "
            "--enforce-eager") in hosted[0][1]
    assert "--headless --data-parallel-start-rank 4 --data-parallel-size 8 --data-parallel-size-local 4" in hosted[1][1]
    assert ("--port 8000 --data-parallel-size 8 --data-parallel-size-local 4 --data-parallel-address 10.0.0.7 "
            "--data-parallel-rpc-port 13346 --enforce-eager") in hosted[2][1]
    assert "CUDA_VISIBLE_DEVICES" not in "".join(lines)
    configs = _check_afd(lines, 8, 8, 4, tmp_path)
    assert {(c["host"], c["connector"], c["reform_timeout_s"] if c["role"] == "ffn" else 0) for c in configs} == {
        ("10.0.0.5", "P2pNcclAFDConnector", 0)}


def test_a_host_holding_both_roles_splits_its_gpus(tmp_path):
    """9A:7F on hosts of 8: host 0 runs FFN ranks 0-6 and attention rank 0 (the attention's front)."""
    lines = afd_commands(9, 7, 1, "M", Cluster.of(16, 8, "ib", "nvlink"), 6390)
    hosted = _hosted(lines)
    assert [h for h, _ in hosted] == ["host0", "host0", "host1"]
    assert hosted[0][1].startswith("CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 vllm serve M --port 8001 "
                                   "--data-parallel-size 7 ")
    assert hosted[1][1].startswith("CUDA_VISIBLE_DEVICES=7,0,1,2,3,4,5,6 vllm serve M --port 8000 "
                                   "--data-parallel-size 9 --data-parallel-size-local 1 --data-parallel-address host0 ")
    assert hosted[2][1].startswith("vllm serve M --headless --data-parallel-start-rank 1 --data-parallel-size 9 "
                                   "--data-parallel-size-local 8 --data-parallel-address host0 "
                                   "--data-parallel-rpc-port 13346")
    _check_afd(lines, 9, 7, 8, tmp_path)


@given(st.integers(1, 24), st.integers(1, 24), st.sampled_from([1, 2, 4, 8]))
def test_every_split_prints_commands_that_place_each_rank_once(attention, ffn, gpus_per_host):
    """Pure text, any A and F (the config's A >= F rule is the overlay's, checked where vLLM parses them above)."""
    lines = afd_commands(attention, ffn, 1, "M", Cluster.of(attention + ffn, gpus_per_host, "ib", "nvlink"), 6390)
    ranks = {"ffn": [], "attention": []}
    for _, command in _hosted(lines):
        config = json.loads(command.split("'")[-2])["afd"]
        words = command.split()
        size = int(words[words.index("--data-parallel-size") + 1]) if "--data-parallel-size" in words else 1
        local = int(words[words.index("--data-parallel-size-local") + 1]) if "--data-parallel-size-local" in words \
            else size
        start = int(words[words.index("--data-parallel-start-rank") + 1]) if "--headless" in words else 0
        ranks[config["role"]] += range(start, start + local)
    assert ranks == {"ffn": list(range(ffn)), "attention": list(range(attention))}


def test_colocated_commands_span_hosts_with_vllms_multi_node_flags(tmp_path):
    cluster = Cluster.of(16, 8, "ib", "nvlink", ("10.0.0.1", "10.0.0.2"))
    tp = colocated_commands("TP 16", 16, "M", cluster, None)
    assert tp[1::2] == [
        "vllm serve M --tensor-parallel-size 16 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1",
        "vllm serve M --tensor-parallel-size 16 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --headless"]
    dp = colocated_commands("DP x EP 16", 16, "M", cluster, "deepep_low_latency")
    assert dp[1] == ("vllm serve M --data-parallel-size 16 --data-parallel-size-local 8 --data-parallel-address "
                     "10.0.0.1 --data-parallel-rpc-port 13345 --enable-expert-parallel --all2all-backend "
                     "deepep_low_latency")
    assert tp[0] == "# 10.0.0.1: GPUs 0-7 of TP 16" and dp[2] == "# 10.0.0.2: vLLM DP ranks 8-15, headless"
    for p in _parse(tp[1::2] + dp[1::2], tmp_path):
        assert p["tensor_parallel_size"] * p["data_parallel_size"] == 16 and p["afd"] is None
    assert colocated_commands("TP 4", 4, "M", Cluster.of(4, 8, "ib", "nvlink"), None) == [
        "vllm serve M --tensor-parallel-size 4"]
    assert "does not split evenly" in colocated_commands("TP 9", 9, "M", Cluster.of(9, 8, "ib", "nvlink"), None)[0]


def test_plan_across_hosts_names_them_and_says_what_else_they_need(tmp_path, capsys):
    profile = write(tmp_path, toy(**FLAT))
    afd_plan.main(["plan", profile, "--gpus", "4", "--link", "eth", "--max-batch", "64"])
    out = capsys.readouterr().out
    assert "# host0: FFN DP rank 0, its API server" in out and "# host3: attention DP rank 2, headless" in out
    assert "pass --hosts with their addresses" in out and "docs/security.md" in out
    with pytest.raises(SystemExit, match="--hosts names 2 host.s. and the plan places its 4 GPUs on 4 hosts of 1"):
        afd_plan.main(["plan", profile, "--gpus", "4", "--link", "eth", "--hosts", "10.0.0.1,10.0.0.2"])
    with pytest.raises(SystemExit):
        afd_plan.main(["plan", profile, "--gpus", "4", "--hosts", "10.0.0.1,,"])
    afd_plan.main(["plan", profile, "--gpus", "4", "--link", "nvlink", "--max-batch", "64"])
    assert "host0" not in (one_host := capsys.readouterr().out) and "--hosts" not in one_host


def test_a_cpu_profile_prints_gloo_eager_and_a_core_per_rank(tmp_path):
    """What the CPU profile measured (one thread per rank) is what the commands ask for, quoted for the shell."""
    lines = afd_commands(3, 1, 2, "M", Cluster.of(4, 2, "eth", "nvlink", platform="cpu"), 6390)
    assert "VLLM_CPU_OMP_THREADS_BIND='0|1' vllm serve M --headless --data-parallel-start-rank 1" in "".join(lines)
    for p in _parse([command for _, command in _hosted(lines)], tmp_path):
        cores = p["env"]["VLLM_CPU_OMP_THREADS_BIND"].split("|")
        assert len(cores) == (p["data_parallel_size_local"] or p["data_parallel_size"])
        assert p["enforce_eager"] and p["afd"]["connector"] == "P2pGlooAFDConnector"
    pool = afd_commands(2, 2, 1, "M", Cluster.of(4, 0, None, "nvlink", platform="cpu"), 6390)
    assert "--enable-expert-parallel --enforce-eager" in pool[0]  # vLLM's CPU communicator has one EP backend
    assert colocated_commands("TP 2", 2, "M", Cluster.of(2, 0, None, "nvlink", platform="cpu"), None) == [
        "VLLM_CPU_OMP_THREADS_BIND='0|1' vllm serve M --tensor-parallel-size 2"]
    assert "--all2all-backend" not in colocated_commands("DP x EP 2", 2, "M", Cluster.of(2, 0, None, "nvlink",
                                                                                         platform="cpu"), "x")[0]


def test_the_note_across_hosts_names_the_secret_only_beside_afd_commands():
    two_hosts = Cluster.of(16, 8, "ib", "nvlink", ("a", "b"))
    assert "secret" in across_hosts(two_hosts)[1] and "secret" not in across_hosts(two_hosts, afd=False)[1]
    assert "pass --hosts" not in across_hosts(two_hosts)[1]
    assert across_hosts(Cluster.of(8, 8, "ib", "nvlink")) == []
