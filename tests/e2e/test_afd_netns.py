"""AFD with the roles on different hosts: each role in its own network namespace
(docs/connection.md#roles-on-different-hosts).

Two namespaces joined by a veth pair stand in for two machines (`afd_harness.netns`): the roles'
loopbacks are separate, so anything that only works on one host (a gloo pair or the rendezvous
store on 127.0.0.1) fails here.  The AFD `host` names the FFN namespace's address on that link.

How the test process (the client) reaches the roles' HTTP ports: each namespace also has an
"uplink" veth to the root namespace, and each server binds its uplink address, so health checks
and requests are ordinary `requests` calls from this process.  Running the client inside a
namespace (`ip netns exec` per request) would also work, but then every request is a subprocess
and `VllmServer`'s health polling would need a second path; the uplinks keep the harness as it is.
The uplinks cannot carry AFD traffic between the roles: a namespace has routes only to its own
two /30s (no default route), so the attention reaches the FFN only at its peer-link address (the
test also checks that link's byte counters).

No interface hint: the roles run without `GLOO_SOCKET_IFNAME`.  torch's gloo alone would bind its
pairs to the address the machine's hostname resolves to (127.0.0.1 here and in many containers,
127.0.1.1 on Debian-style hosts) and channel creation would fail with "Gloo connectFullMesh failed
... Connection refused, remote=[127.0.0.1]"; the gloo transport binds the address that routes to
`host` instead (docs/connection.md#roles-on-different-hosts), which this test proves.  vLLM needs
no hint for one rank per role: its own group uses a file:// rendezvous and loopback message
queues, hence `lo` up in each namespace.

Skips where namespaces cannot be made (not root, no `ip`, no CAP_NET_ADMIN): the reason is the
error of a real attempt.  Names and the address block are unique per run; the namespaces and
the root-side links are deleted when the test ends, pass or fail.
"""

from __future__ import annotations

import json

import pytest

from afd_harness.afd import afd_args
from afd_harness.netns import PEER_IFNAME, TwoHosts, exec_prefix, leftovers, link_bytes, netns_unavailable_reason
from afd_harness.server import VllmServer, complete, complete_batch, cpu_server_env

pytestmark = pytest.mark.e2e

PROMPTS = ["Hello, my name is", "The capital of France is", "In a shocking finding,",
           "1 2 3 4 5", "The experts said"]
MAX_TOKENS = 12
HTTP_PORT = 8000  # each namespace is fresh, so fixed ports are free
AFD_PORT = 6390
ARCH = "qwen3_moe"


def greedy_outputs(base_url: str) -> dict[str, list]:
    """Token ids of the prompts in one batch, and of the first prompt streamed."""
    batched = complete_batch(base_url, PROMPTS, MAX_TOKENS)
    streamed = complete(base_url, PROMPTS[0], MAX_TOKENS, stream=True)
    return {"batched": [g.token_ids for g in batched], "streamed": [streamed.text]}


@pytest.fixture(scope="module")
def two_hosts():
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(f"roles on different hosts need network namespaces: {reason}")
    hosts = TwoHosts()
    with hosts as plan:
        yield plan
    left = leftovers(plan)
    assert not left, f"netns: {left} survived teardown; delete them with `ip netns del` / `ip link del`"


PLAIN_REQUESTS = (greedy_outputs,)  # answered by the session's plain server (conftest.py)


@pytest.fixture(scope="module")
def plain(plain_outputs):
    return plain_outputs(ARCH, greedy_outputs)


@pytest.fixture(scope="module")
def deployment(two_hosts, tiny_model_dir, vllm_python, tmp_path_factory):
    """FFN and attention `vllm serve`, each inside its namespace; yields {role: VllmServer}."""
    from afd_harness.tiny_models import serve_env

    model = tiny_model_dir(ARCH)
    log_dir = tmp_path_factory.mktemp("afd-netns")
    # The FFN's address on the peer link: where FFN rank 0 hosts the rendezvous store.
    afd_fields = {"host": two_hosts.ffn.peer_address}
    servers = {}
    for role, host, cpus in (("ffn", two_hosts.ffn, "0"), ("attention", two_hosts.attention, "1")):
        servers[role] = VllmServer(
            model, python=vllm_python, launcher="cli", host=host.uplink_address, port=HTTP_PORT,
            command_prefix=exec_prefix(host.namespace), log_path=log_dir / f"{role}.log",
            extra_args=afd_args(role, AFD_PORT, **afd_fields), startup_timeout_s=300,
            env={**cpu_server_env(omp_cpus=cpus), **serve_env(model)},
        )
    try:
        for server in servers.values():
            server.spawn()
        for server in servers.values():
            server.wait_healthy()
        yield servers
    finally:
        for role in ("attention", "ffn"):  # attention first: a lost FFN is not the point here
            if servers[role].process is not None:
                servers[role].stop()


def test_afd_across_namespaces_equals_plain_vllm(two_hosts, plain, deployment, tiny_model_dir):
    before = link_bytes(two_hosts.attention.namespace, PEER_IFNAME)

    outputs = greedy_outputs(deployment["attention"].base_url)

    assert outputs == plain
    rx, tx = (after - start for after, start in
              zip(link_bytes(two_hosts.attention.namespace, PEER_IFNAME), before))
    # At least one bf16 row of hidden_size per generated token each way: the activations crossed
    # the peer link (the only route between the namespaces), not some loopback.
    config = json.loads((tiny_model_dir(ARCH) / "config.json").read_text())
    floor = MAX_TOKENS * config["hidden_size"] * 2
    assert rx >= floor and tx >= floor, (rx, tx, floor)


def test_a_cut_peer_link_is_an_outage_then_the_attention_heals(two_hosts, plain, deployment):
    """A partition (docs/failures.md#bounded-waits): the peer link goes down under an idle, paired attention, so
    nothing closes and no packet answers. The attention reports the lost FFN within peer_timeout_s (its
    heartbeat round does not return) and answers 503; once the link is back both roles pair again and the
    same attention serves plain vLLM's tokens. Runs after the token test: it needs the module's deployment."""
    import subprocess
    import time

    import requests

    from afd_harness.metrics import scrape, wait_for

    attention = deployment["attention"]
    url, model = attention.base_url, str(attention.model)
    attention_pid = attention.process.pid
    assert scrape(url)[("afd_peer_up", "attention")] == 1.0
    link = ["ip", "-n", two_hosts.attention.namespace, "link", "set", PEER_IFNAME]
    subprocess.run([*link, "down"], check=True)
    cut_at = time.monotonic()
    try:
        assert wait_for(lambda: scrape(url).get(("afd_peer_up", "attention")) == 0.0, timeout_s=60.0,
                        interval_s=0.2), attention.log_tail()
        detected_s = time.monotonic() - cut_at
        refused = requests.post(f"{url}/v1/completions", timeout=60,
                                json={"model": model, "prompt": PROMPTS[0], "max_tokens": 2})
    finally:
        subprocess.run([*link, "up"], check=True)
    healed_at = time.monotonic()

    def serves() -> bool:
        return requests.post(f"{url}/v1/completions", timeout=60,
                             json={"model": model, "prompt": PROMPTS[0], "max_tokens": 1}).status_code == 200

    assert wait_for(serves, timeout_s=240.0, interval_s=1.0), attention.log_tail()
    print(f"cut link: afd_peer_up 0 after {detected_s:.1f} s, serving again {time.monotonic() - healed_at:.1f} s "
          "after the link came back")

    assert detected_s < 5.0 + 10.0  # peer_timeout_s (the default) and a margin for a loaded machine
    assert refused.status_code == 503 and "re-forming" in refused.text, refused.text
    assert greedy_outputs(url) == plain
    assert attention.process.pid == attention_pid and attention.process.poll() is None
