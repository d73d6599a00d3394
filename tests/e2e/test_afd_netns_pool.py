"""The FFN pool across hosts: FFN DP rank 0 and FFN DP rank 1 in two network namespaces, joined by vLLM's
own multi-node data parallelism (docs/operations.md#pools-across-hosts).

Two namespaces stand in for two machines (`afd_harness.netns`, as in test_afd_netns.py, whose skip and
teardown this module repeats); their only route to each other is the peer link:

    host 0 (B+1 on the peer link)                        host 1 (B+2)
      FFN server: API server + FFN DP rank 0               FFN DP rank 1: `vllm serve --headless
        (`--data-parallel-size 2 --data-parallel-size-         --data-parallel-start-rank 1 ...`
        local 1 --data-parallel-address B+1`), hosts the       finds the store at `host` = B+1
        AFD store at `host` = B+1
      attention server: DP 2 (attention ranks 0, 1)

2A2F with `--enable-expert-parallel`: attention rank 1's data goes to FFN rank 1 on host 1, and each layer's
MoE all-gather / reduce-scatter between the FFN DP ranks crosses the link too (vLLM's DP and EP groups).
Float32 everywhere, as in test_afd_pool.py: expert parallelism sums the experts in another order, and only
in float32 the greedy tokens are plain vLLM's for sure.

The second test kills host 1's FFN rank under the same deployment: with `reform_timeout_s` 0 the attention
stops and FFN rank 0 exits by themselves (the failure paragraph of docs/operations.md#pools-across-hosts).
The module takes 5.5-8 min on the 2-core CI box beside other e2e tests (the plain float32 baseline, three
servers' start-up, 10-60 s for the failure).

Only vLLM's own cross-host groups get an interface hint (`GLOO_SOCKET_IFNAME` on the FFN servers, as vLLM's
multi-node set-up on CPU needs: torch's gloo would publish the hostname's 127.0.0.1); the AFD groups find
their addresses from the store's `host` alone (test_afd_netns.py proves that without any hint).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest

from afd_harness.afd import afd_args
from afd_harness.metrics import scrape_ranks, wait_for
from afd_harness.netns import PEER_IFNAME, TwoHosts, exec_prefix, leftovers, link_bytes, netns_unavailable_reason
from afd_harness.server import ServerStartError, VllmServer, cpu_server_env, greedy_tokens

pytestmark = pytest.mark.e2e

FLOAT32 = ["--dtype", "float32"]
ARCH = "qwen3_moe"
# Each namespace is fresh, so fixed ports are free.
ATTENTION_HTTP_PORT = 8000
FFN_HTTP_PORT = 8001
AFD_PORT = 6390  # FFN rank 0's AFD store (config `port`)
DP_RPC_PORT = 13345  # vLLM's --data-parallel-rpc-port: the FFN front end's handshake with remote DP engines
AFD_FIELDS = {"num_attention_ranks": 2, "num_ffn_ranks": 2, "reform_timeout_s": 0, "step_timeout_s": 60}


@pytest.fixture(scope="module")
def two_hosts():
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(f"an FFN pool across hosts needs network namespaces: {reason}")
    with TwoHosts() as plan:
        # NOTE: the plan names its namespaces after the two roles; here its "ffn" namespace is host 0
        # (FFN rank 0 and the attention) and its "attention" namespace is host 1 (FFN rank 1).
        yield plan.ffn, plan.attention
    left = leftovers(plan)
    assert not left, f"netns: {left} survived teardown; delete them with `ip netns del` / `ip link del`"


def ffn_dp_args(host0_address: str, *, start_rank: int | None) -> list[str]:
    """vLLM's multi-node DP flags of one FFN host (start_rank None: the host with the API server)."""
    args = ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-address",
            host0_address, "--data-parallel-rpc-port", str(DP_RPC_PORT), "--enable-expert-parallel", *FLOAT32]
    if start_rank is not None:
        args = ["--headless", "--data-parallel-start-rank", str(start_rank), *args]
    return args


@pytest.fixture(scope="module")
def pool(two_hosts, tiny_model_dir, vllm_python, tmp_path_factory):
    """{"ffn0", "ffn1", "attention"}: VllmServer each, in its namespace; ffn1 is headless (no HTTP)."""
    from afd_harness.tiny_models import serve_env

    host0, host1 = two_hosts
    model = tiny_model_dir(ARCH)
    log_dir = tmp_path_factory.mktemp("afd-netns-pool")
    store = {"host": host0.peer_address, **AFD_FIELDS}

    def server(name, host, port, role, args, cpus, env=()):
        return VllmServer(
            model, python=vllm_python, launcher="cli", host=host.uplink_address, port=port,
            command_prefix=exec_prefix(host.namespace), log_path=log_dir / f"{name}.log",
            extra_args=[*afd_args(role, AFD_PORT, **store), *args], startup_timeout_s=400,
            env={**cpu_server_env(omp_cpus=cpus), **serve_env(model), **dict(env)},
        )

    # vLLM's own DP / EP groups between the FFN hosts: gloo must publish the peer link's address.
    vllm_hint = {"GLOO_SOCKET_IFNAME": PEER_IFNAME}
    servers = {
        "ffn0": server("ffn0", host0, FFN_HTTP_PORT, "ffn", ffn_dp_args(host0.peer_address, start_rank=None), "0",
                       vllm_hint),
        "ffn1": server("ffn1", host1, FFN_HTTP_PORT, "ffn", ffn_dp_args(host0.peer_address, start_rank=1), "0",
                       vllm_hint),
        "attention": server("attention", host0, ATTENTION_HTTP_PORT, "attention",
                            ["--data-parallel-size", "2", *FLOAT32], "1|1"),
    }
    try:
        for each in servers.values():
            each.spawn()
        for name in ("ffn0", "attention"):  # FFN rank 0's front end is healthy once the headless engine joined
            try:
                servers[name].wait_healthy()
            except ServerStartError as exc:
                raise ServerStartError(f"{exc}\n--- ffn1 (headless) log, last lines:\n"
                                       f"{servers['ffn1'].log_tail()}") from exc
        assert servers["ffn1"].is_running(), servers["ffn1"].log_tail()
        yield servers
    finally:
        for name in ("attention", "ffn1", "ffn0"):
            if servers[name].process is not None:
                servers[name].stop()


def test_ffn_dp_ranks_on_two_hosts_equal_plain_float32(two_hosts, plain_float32, pool, tiny_model_dir):
    _, host1 = two_hosts
    before = link_bytes(host1.namespace, PEER_IFNAME)

    tokens = greedy_tokens(pool["attention"].base_url, plain_float32.prompts, plain_float32.max_tokens)

    assert tokens == plain_float32
    # FFN rank 0's page: its own rank computed and is paired (the headless rank serves no /metrics).
    page_ok = wait_for(lambda: scrape_ranks(pool["ffn0"].base_url).get(("afd_ffn_compute_seconds_count", "ffn", "0"),
                                                                         0) > 0)
    page = scrape_ranks(pool["ffn0"].base_url)
    assert page_ok and page[("afd_peer_up", "ffn", "0")] == 1.0, page
    # FFN rank 1 serves attention rank 1 across the link: at least one float32 row of hidden_size per
    # generated token each way went over host 1's only link.
    rx, tx = (after - start for after, start in zip(link_bytes(host1.namespace, PEER_IFNAME), before))
    hidden = json.loads((tiny_model_dir(ARCH) / "config.json").read_text())["hidden_size"]
    floor = plain_float32.max_tokens * hidden * 4
    assert rx >= floor and tx >= floor, (rx, tx, floor)
    for name in ("ffn0", "ffn1", "attention"):
        log = pool[name].log_path.read_text()
        assert "Traceback" not in log, f"{name}: {log[-4000:]}"


def health_status(base_url: str) -> int | None:
    """/health's status code, or None when nothing answers."""
    import requests

    try:
        return requests.get(f"{base_url}/health", timeout=5).status_code
    except (requests.ConnectionError, requests.Timeout):
        return None


def exited(server: VllmServer) -> bool:
    """Every process of the server's group is gone (the leader reaped: a zombie still counts as a group)."""
    server.process.poll()
    return not server.is_running()


def first_held(conditions: dict[str, Callable[[], bool]], timeout_s: float) -> dict[str, float]:
    """Seconds until each condition first held (polled together every 0.5 s), for those that did in time."""
    started = time.monotonic()
    seen: dict[str, float] = {}
    while len(seen) < len(conditions) and time.monotonic() - started < timeout_s:
        for name, holds in conditions.items():
            if name not in seen and holds():
                seen[name] = time.monotonic() - started
        time.sleep(0.5)
    return seen


def test_a_lost_ffn_host_ends_the_pool_and_the_attention_reports_it(pool, record_timing):
    # Runs after the equality test (same module-scoped deployment): host 1's FFN DP rank dies at once.
    pool["ffn1"].kill()

    # FFN rank 0 exits (reform_timeout_s 0: it loses its attention peer, or its DP peer mid-collective), and the
    # attention, which cannot heal at DP 2 in one server, stops: /health no longer answers 200.
    seen = first_held({"FFN rank 0 exited": lambda: exited(pool["ffn0"]),
                       "attention /health not 200": lambda: health_status(pool["attention"].base_url) != 200},
                      timeout_s=180)
    assert "FFN rank 0 exited" in seen, f"FFN rank 0 still running 180 s after host 1's rank died:\n" \
                                        f"{pool['ffn0'].log_tail()}"
    assert "attention /health not 200" in seen, f"attention /health still 200:\n{pool['attention'].log_tail()}"
    record_timing("FFN pool across hosts, FFN DP rank 1 killed: "
                  + ", ".join(f"{name} after {seconds:.1f} s" for name, seconds in seen.items()))
