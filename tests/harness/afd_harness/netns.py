"""Two network namespaces joined by a veth pair: the two AFD roles as if on two hosts.

One run's topology (names and the /28 address block are unique to the run; `B` = the block):

    root namespace (the test process: the HTTP client)
      afd<token>a  B+5/30 ── veth ── B+6/30  afd-up    namespace afd-<token>-attention
      afd<token>f  B+9/30 ── veth ── B+10/30 afd-up    namespace afd-<token>-ffn
    afd-<token>-attention: afd-peer B+2/30 ── veth ── B+1/30 afd-peer :afd-<token>-ffn

The roles talk only over the `afd-peer` link (a namespace has routes only to its own two /30s,
no default route), so the AFD `host` must be the FFN's `afd-peer` address.  The uplinks exist so
that the test process reaches both HTTP ports
(health checks, requests) without entering a namespace.  Interface names inside a namespace
are local to it, so `afd-peer` and `afd-up` are the same in both; only the root-side ends
carry the run's token.  Deleting the two namespaces deletes every link (a veth pair dies
with either end).

The block is picked at random among the /28s of ADDRESS_SPACE that no root-namespace address or
route overlaps, so concurrent runs on one machine get different names and addresses.  A run
killed with SIGKILL leaves its namespaces behind (`ip netns list`, names `afd-<token>-*`).

Pure (unit-tested): `make_plan`, `setup_commands`, `teardown_commands`, `exec_prefix`,
`pick_block`, `networks_in_use`.  Side effects: `netns_unavailable_reason` (a real probe),
`TwoHosts`, `leftovers`, `link_bytes`.
"""

from __future__ import annotations

import ipaddress
import random
import re
import secrets
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from typing import NamedTuple

ADDRESS_SPACE = ipaddress.IPv4Network("10.231.0.0/16")  # carved into /28 blocks, one per run
BLOCK_PREFIX = 28
PEER_IFNAME = "afd-peer"  # the role-to-role link, in both namespaces
UPLINK_IFNAME = "afd-up"  # the link to the root namespace, in both namespaces
IFNAME_MAX = 15  # Linux IFNAMSIZ - 1
IP_TIMEOUT_S = 30.0


class Host(NamedTuple):
    """One role's namespace and its addresses."""

    namespace: str  # e.g. afd-1a2b3c-ffn
    peer_address: str  # on afd-peer: what the other role reaches (the AFD `host` of the FFN)
    uplink_address: str  # on afd-up: what the test process reaches (HTTP)
    root_ifname: str  # the uplink's end in the root namespace
    root_address: str  # its address there


class NetnsPlan(NamedTuple):
    """Everything `setup_commands` creates; a pure value."""

    token: str
    block: ipaddress.IPv4Network  # the run's /28
    attention: Host
    ffn: Host

    @property
    def hosts(self) -> tuple[Host, Host]:
        return self.attention, self.ffn


def make_plan(token: str, block: ipaddress.IPv4Network) -> NetnsPlan:
    """Names and addresses of one run; `token` is short lowercase hex, `block` a /28 of ADDRESS_SPACE."""
    if re.fullmatch(r"[0-9a-z]{1,8}", token) is None:
        raise ValueError(f"netns: token must be 1-8 lowercase alphanumerics, got {token!r}")
    if block.prefixlen != BLOCK_PREFIX or not block.subnet_of(ADDRESS_SPACE):
        raise ValueError(f"netns: block must be a /{BLOCK_PREFIX} of {ADDRESS_SPACE}, got {block}")
    base = block.network_address

    def host(role: str, peer: int, uplink: int) -> Host:
        return Host(namespace=f"afd-{token}-{role}", peer_address=str(base + peer),
                    uplink_address=str(base + uplink), root_ifname=f"afd{token}{role[0]}",
                    root_address=str(base + uplink - 1))

    # /30s: peer link B+0 (ffn .1, attention .2), attention uplink B+4, ffn uplink B+8.
    return NetnsPlan(token, block, attention=host("attention", 2, 6), ffn=host("ffn", 1, 10))


def setup_commands(plan: NetnsPlan) -> list[list[str]]:
    """The `ip` commands that build `plan`, in order."""
    attention, ffn = plan.hosts
    commands = [["ip", "netns", "add", h.namespace] for h in plan.hosts]
    commands += [["ip", "-n", h.namespace, "link", "set", "lo", "up"] for h in plan.hosts]
    # NOTE: created inside the attention namespace (`-n`), so the root namespace never holds a
    # link named afd-peer that two concurrent runs could both try to create.
    commands.append(["ip", "-n", attention.namespace, "link", "add", PEER_IFNAME, "type", "veth",
                     "peer", "name", PEER_IFNAME, "netns", ffn.namespace])
    for h in plan.hosts:
        commands += [
            ["ip", "link", "add", h.root_ifname, "type", "veth", "peer", "name", UPLINK_IFNAME,
             "netns", h.namespace],
            ["ip", "addr", "add", f"{h.root_address}/30", "dev", h.root_ifname],
            ["ip", "link", "set", h.root_ifname, "up"],
            ["ip", "-n", h.namespace, "addr", "add", f"{h.peer_address}/30", "dev", PEER_IFNAME],
            ["ip", "-n", h.namespace, "addr", "add", f"{h.uplink_address}/30", "dev", UPLINK_IFNAME],
            ["ip", "-n", h.namespace, "link", "set", PEER_IFNAME, "up"],
            ["ip", "-n", h.namespace, "link", "set", UPLINK_IFNAME, "up"],
        ]
    return commands


def teardown_commands(plan: NetnsPlan) -> list[list[str]]:
    """Undo `setup_commands` from any partial state; each may fail harmlessly (already gone)."""
    # Deleting a namespace deletes its veth ends and so their peers; the root ends are deleted
    # explicitly too, for a setup that failed between `link add` and moving nothing.
    return ([["ip", "netns", "del", h.namespace] for h in plan.hosts]
            + [["ip", "link", "del", h.root_ifname] for h in plan.hosts])


def exec_prefix(namespace: str) -> list[str]:
    """The command prefix that runs a program inside `namespace`."""
    return ["ip", "netns", "exec", namespace]


def networks_in_use(ip_output: str) -> list[ipaddress.IPv4Network]:
    """IPv4 networks and addresses named in `ip -o -4 addr` or `ip -4 route` output."""
    networks = []
    for word in ip_output.split():
        if word.count(".") != 3:
            continue
        try:
            networks.append(ipaddress.IPv4Network(word, strict=False))
        except ValueError:
            continue
    return networks


def pick_block(in_use: Iterable[ipaddress.IPv4Network], rng: random.Random) -> ipaddress.IPv4Network:
    """A random /28 of ADDRESS_SPACE that overlaps none of `in_use` (random: concurrent runs differ).

    Networks wider than ADDRESS_SPACE (a default route, a 10.0.0.0/8) are ignored: the run's /30
    routes are more specific, and avoiding them would leave nothing to pick.
    """
    first = int(ADDRESS_SPACE.network_address)
    block_size = 1 << (32 - BLOCK_PREFIX)
    taken: set[int] = set()  # block indices
    for network in in_use:
        if network.prefixlen < ADDRESS_SPACE.prefixlen or not network.overlaps(ADDRESS_SPACE):
            continue
        start = (int(network.network_address) - first) // block_size
        stop = (int(network.broadcast_address) - first) // block_size
        taken.update(range(start, stop + 1))
    free = [i for i in range(ADDRESS_SPACE.num_addresses // block_size) if i not in taken]
    if not free:
        raise RuntimeError(f"netns: every /{BLOCK_PREFIX} of {ADDRESS_SPACE} overlaps a network in use")
    return ipaddress.IPv4Network((first + rng.choice(free) * block_size, BLOCK_PREFIX))


def netns_unavailable_reason() -> str | None:
    """None if this process can create namespaces and veth pairs; else why not (a skip reason).

    Probes by doing it: a namespace with a veth pair to a second one and a program run inside it
    (`ip netns exec` mounts /sys), deleted again, so a missing capability (CAP_NET_ADMIN,
    CAP_SYS_ADMIN for the mounts), a read-only /run or a kernel without veth all show up as the
    `ip` error they cause.
    """
    if shutil.which("ip") is None:
        return "no `ip` binary (iproute2) on PATH"
    probe = make_plan(secrets.token_hex(3), ipaddress.IPv4Network("10.231.0.0/28"))
    attention, ffn = probe.hosts
    commands = [["ip", "netns", "add", attention.namespace], ["ip", "netns", "add", ffn.namespace],
                ["ip", "-n", attention.namespace, "link", "add", PEER_IFNAME, "type", "veth", "peer",
                 "name", PEER_IFNAME, "netns", ffn.namespace],
                [*exec_prefix(attention.namespace), "ip", "link", "set", "lo", "up"]]
    try:
        for command in commands:
            done = _ip(command, check=False)
            if done.returncode != 0:
                return (f"cannot create network namespaces: `{' '.join(command)}` failed "
                        f"({done.stderr.strip() or done.returncode}); needs root or CAP_NET_ADMIN + CAP_SYS_ADMIN")
    finally:
        for command in teardown_commands(probe)[:2]:
            _ip(command, check=False)
    return None


class TwoHosts:
    """Build a fresh `NetnsPlan` on entry, delete it on exit (also when the body raises)."""

    def __init__(self, plan: NetnsPlan | None = None) -> None:
        self.plan = plan or make_plan(secrets.token_hex(3), pick_block(_root_networks(), random.Random()))

    def __enter__(self) -> NetnsPlan:
        try:
            for command in setup_commands(self.plan):
                _ip(command)
        except BaseException:
            self.close()
            raise
        return self.plan

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> list[str]:
        """Delete every namespace and link of the plan; return what is left (should be nothing)."""
        for command in teardown_commands(self.plan):
            _ip(command, check=False)
        return leftovers(self.plan)


def leftovers(plan: NetnsPlan) -> list[str]:
    """Namespaces and root-side links of `plan` that still exist."""
    namespaces = _ip(["ip", "netns", "list"], check=False).stdout.split()
    links = _ip(["ip", "-o", "link", "show"], check=False).stdout
    left = [h.namespace for h in plan.hosts if h.namespace in namespaces]
    return left + [h.root_ifname for h in plan.hosts if f" {h.root_ifname}@" in links
                   or f" {h.root_ifname}:" in links]


def link_bytes(namespace: str, ifname: str) -> tuple[int, int]:
    """(rx, tx) byte counters of a link inside `namespace`, from /sys as that namespace sees it."""
    counters = []
    for direction in ("rx", "tx"):
        done = _ip([*exec_prefix(namespace), "cat", f"/sys/class/net/{ifname}/statistics/{direction}_bytes"])
        counters.append(int(done.stdout.strip()))
    return counters[0], counters[1]


def _root_networks() -> list[ipaddress.IPv4Network]:
    output = _ip(["ip", "-o", "-4", "addr", "show"], check=False).stdout
    output += _ip(["ip", "-4", "route", "show", "table", "all"], check=False).stdout
    return networks_in_use(output)


def _ip(command: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(command), capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and done.returncode != 0:
        raise RuntimeError(
            f"netns: `{' '.join(command)}` failed (exit {done.returncode}): {done.stderr.strip()}; "
            "expected it to succeed as root (see netns_unavailable_reason)"
        )
    return done
