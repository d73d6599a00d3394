"""The recommendation's `vllm serve` commands: every rank on a host and a GPU, one command per role and host.

The placement is the one the cost model prices (docs/planner.md#the-printed-commands): hosts of `gpus_per_host`
GPUs filled in order, the FFN's ranks first (its collectives stay inside a host while it fits one), then the
attention's.  A role on several hosts runs vLLM's multi-node data parallelism (docs/operations.md#pools-across-hosts);
a host holding both roles gives each its own GPUs first in `CUDA_VISIBLE_DEVICES` (docs/config.md).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from .cost import EP_RINGS

__all__ = ["Cluster", "Share", "across_hosts", "afd_commands", "colocated_commands", "place"]

ONE_NODE_LINKS = ("nvlink", "pcie")  # links of one host, where CUDA IPC reaches the peer GPU
LOOPBACK = "127.0.0.1"
ROLE_NAMES = {"attention": "attention", "ffn": "FFN", "colocated": "vLLM"}
HTTP_PORT = {"attention": 8000, "ffn": 8001, "colocated": None}  # None: vLLM's default, 8000
DP_RPC_PORT = {"attention": 13346, "ffn": 13345, "colocated": 13345}  # vLLM's --data-parallel-rpc-port


@dataclass(frozen=True, slots=True)
class Share:
    """One role's ranks on one host."""

    role: str  # "ffn", "attention" or "colocated"
    host: int
    start_rank: int  # the role's first DP rank on this host
    gpus: tuple[int, ...]  # the host's GPU indices


def place(roles: list[tuple[str, int]], gpus_per_host: int) -> tuple[Share, ...]:
    """Each role's ranks take the next free GPUs, host by host, in the order given."""
    assert gpus_per_host >= 1, gpus_per_host
    shares, slot = [], 0
    for role, ranks in roles:
        rank = 0
        while rank < ranks:
            host, gpu = divmod(slot, gpus_per_host)
            n = min(ranks - rank, gpus_per_host - gpu)
            shares.append(Share(role, host, rank, tuple(range(gpu, gpu + n))))
            rank, slot = rank + n, slot + n
    return tuple(shares)


@dataclass(frozen=True, slots=True)
class Cluster:
    """The hosts a plan of `gpus` GPUs runs on, as the cost model sees them."""

    gpus: int  # devices: GPUs, or on CPU one core per rank (what a CPU profile measured)
    gpus_per_host: int
    one_node_link: bool  # the link inside a host is NVLink or PCIe
    addresses: tuple[str, ...] = ()  # host i's address (--hosts); empty: 127.0.0.1 on one host, else host0, host1, ...
    platform: str = "cuda"  # the profile's: "cuda" or "cpu"

    @classmethod
    def of(cls, gpus: int, gpus_per_host: int, link: str | None, host_link: str,
           addresses: tuple[str, ...] = (), platform: str = "cuda") -> Cluster:
        """`gpus_per_host` 0 (not given): one host where the wire is the profile's own or NVLink/PCIe, else one
        GPU per host (every collective on `link`, as the cost model then prices it)."""
        if gpus_per_host:
            return cls(gpus, gpus_per_host, host_link in ONE_NODE_LINKS, addresses, platform)
        if link is None or link in ONE_NODE_LINKS:
            return cls(gpus, max(gpus, 1), True, addresses, platform)
        return cls(gpus, 1, False, addresses, platform)

    @property
    def on_cpu(self) -> bool:
        return self.platform == "cpu"

    @property
    def unit(self) -> str:
        return "core" if self.on_cpu else "GPU"

    @property
    def num_hosts(self) -> int:
        return -(-self.gpus // self.gpus_per_host)

    def address(self, host: int) -> str:
        if self.addresses:
            return self.addresses[host]
        return LOOPBACK if self.num_hosts == 1 else f"host{host}"

    def problem(self) -> str | None:
        """A user error when --hosts names fewer hosts than the plan uses, else None."""
        if self.addresses and len(self.addresses) < self.num_hosts:
            return (f"--hosts names {len(self.addresses)} host(s) and the plan places its {self.gpus} GPUs on "
                    f"{self.num_hosts} hosts of {self.gpus_per_host}; give {self.num_hosts} addresses, host 0's "
                    "first")
        return None


def _devices(share: Share, shares: tuple[Share, ...], cluster: Cluster) -> str:
    """The environment that gives a share its devices.  CUDA, where its host holds another role:
    CUDA_VISIBLE_DEVICES with its own GPUs first, then the other's.  CPU: a core per rank, as the profile measured
    (VLLM_CPU_OMP_THREADS_BIND, one `|`-separated entry per local rank)."""
    if cluster.on_cpu:
        return f"VLLM_CPU_OMP_THREADS_BIND={shlex.quote('|'.join(map(str, share.gpus)))} "
    others = [g for s in shares if s.host == share.host and s.role != share.role for g in s.gpus]
    return f"CUDA_VISIBLE_DEVICES={','.join(map(str, share.gpus + tuple(others)))} " if others else ""


def _dp_flags(share: Share, mine: list[Share], size: int, cluster: Cluster) -> str:
    """--port and vLLM's data-parallel flags of one share: one server on one host, else a front and headless ranks."""
    front = mine[0]
    port = f" --port {HTTP_PORT[share.role]}" if share is front and HTTP_PORT[share.role] else ""
    if len(mine) == 1:
        return port + (f" --data-parallel-size {size}" if size > 1 else "")
    flags = (f" --data-parallel-size {size} --data-parallel-size-local {len(share.gpus)} "
             f"--data-parallel-address {cluster.address(front.host)} "
             f"--data-parallel-rpc-port {DP_RPC_PORT[share.role]}")
    return port + flags if share is front else f" --headless --data-parallel-start-rank {share.start_rank}{flags}"


def _where(share: Share, mine: list[Share], cluster: Cluster) -> str:
    last = share.start_rank + len(share.gpus) - 1
    ranks = f"rank {last}" if last == share.start_rank else f"ranks {share.start_rank}-{last}"
    what = "its API server" if share is mine[0] else "headless"
    return f"# {cluster.address(share.host)}: {ROLE_NAMES[share.role]} DP {ranks}, {what}"


def _commands(shares: tuple[Share, ...], role: str, size: int, cluster: Cluster, build) -> list[str]:
    mine = [s for s in shares if s.role == role]
    spans = len({s.host for s in shares}) > 1
    lines = []
    for share in mine:
        if spans:
            lines.append(_where(share, mine, cluster))
        lines.append(build(share, _devices(share, shares, cluster), _dp_flags(share, mine, size, cluster)))
    return lines


def afd_commands(attention_ranks: int, ffn_ranks: int, num_stages: int, model: str, cluster: Cluster,
                 port: int) -> list[str]:
    """`vllm serve` of the FFN role, then of the attention role, one per host (docs/config.md's keys)."""
    x, y = attention_ranks, ffn_ranks
    shares = place([("ffn", y), ("attention", x)], cluster.gpus_per_host)
    one_host = len({s.host for s in shares}) == 1
    if cluster.on_cpu:
        connector = "P2pGlooAFDConnector"
    else:
        connector = "P2pIpcAFDConnector" if one_host and cluster.one_node_link else "P2pNcclAFDConnector"
    common = {"num_attention_ranks": x, "num_ffn_ranks": y, "num_stages": num_stages, "connector": connector,
              "host": cluster.address(0), "port": port}
    # FFN DP > 1 runs eager, with reform_timeout_s 0, and the graph mode must match on both roles (config.md).
    graphs = ("--enforce-eager" if y > 1 or cluster.on_cpu else
              "--compilation-config '{\"cudagraph_mode\": \"FULL_DECODE_ONLY\"}'")
    configs = {"ffn": {"role": "ffn", **common, **({"reform_timeout_s": 0} if y > 1 else {})},
               "attention": {"role": "attention", **common}}

    def line(share: Share, env: str, dp: str) -> str:
        # the one EP backend AFD's FFN pool runs on CUDA (docs/config.md#ffn-data-parallelism), whatever vLLM's
        # default; vLLM's CPU communicator has one
        ep = " --enable-expert-parallel" if share.role == "ffn" and y > 1 else ""
        ep += f" --all2all-backend {EP_RINGS}" if ep and not cluster.on_cpu else ""
        return (f"{env}vllm serve {model}{dp}{ep} {graphs} \\\n  --additional-config "
                f"'{json.dumps({'afd': configs[share.role]})}'")

    return _commands(shares, "ffn", y, cluster, line) + _commands(shares, "attention", x, cluster, line)


def colocated_commands(label: str, gpus: int, model: str, cluster: Cluster, ep_all2all: str | None) -> list[str]:
    """`vllm serve` of a colocated deployment ("TP N" or "DP x EP N"), one per host; `ep_all2all`: the
    --all2all-backend to name (None: vLLM's default)."""
    shares = place([("colocated", gpus)], cluster.gpus_per_host)
    if label.startswith("TP"):
        hosts = len(shares)
        if hosts == 1:
            return [f"{_devices(shares[0], shares, cluster)}vllm serve {model} --tensor-parallel-size {gpus}"]
        if gpus % hosts:
            return [f"# TP {gpus} does not split evenly over {hosts} hosts (vLLM's --nnodes needs an equal share)"]
        local = gpus // hosts
        return [line for h in range(hosts) for line in (
            f"# {cluster.address(h)}: {cluster.unit}s {local * h}-{local * (h + 1) - 1} of TP {gpus}",
            f"{_devices(shares[h], shares, cluster)}vllm serve {model} --tensor-parallel-size {gpus} --nnodes {hosts} "
            f"--node-rank {h} "
            f"--master-addr {cluster.address(0)}{' --headless' if h else ''}")]
    ep = " --enable-expert-parallel" if gpus > 1 else ""
    ep += f" --all2all-backend {ep_all2all}" if gpus > 1 and ep_all2all and not cluster.on_cpu else ""
    return _commands(shares, "colocated", gpus, cluster,
                     lambda share, env, dp: f"{env}vllm serve {model}{dp}{ep}".rstrip())


def across_hosts(cluster: Cluster, afd: bool = True) -> list[str]:
    """What a deployment on several hosts needs beyond its commands (nothing on one host); `afd`: AFD commands
    were printed, whose roles need a shared secret."""
    if cluster.num_hosts == 1:
        return []
    named = "" if cluster.addresses else (" Hosts are named host0, host1, ...: pass --hosts with their addresses "
                                          "(vLLM's --data-parallel-address and --master-addr take an address).")
    per_host = (f"hosts of {cluster.gpus_per_host}" if cluster.gpus_per_host > 1 else
                f"hosts of one {cluster.unit} each")
    secret = (" Give both AFD roles the same secret across hosts (secret_file or VLLM_AFD_SECRET, docs/security.md)."
              if afd else "")
    sockets = "GLOO_SOCKET_IFNAME" if cluster.on_cpu else "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME"
    return ["", f"The commands place {cluster.gpus} {cluster.unit}s on {cluster.num_hosts} {per_host}.{named}{secret} "
            f"Where a host's name resolves to loopback, set {sockets} (docs/operations.md#pools-across-hosts)."]
