"""afd_harness.netns, the pure parts: names, addresses and `ip` commands of a two-host run."""

from __future__ import annotations

import ipaddress
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from afd_harness.netns import (
    ADDRESS_SPACE,
    BLOCK_PREFIX,
    IFNAME_MAX,
    PEER_IFNAME,
    UPLINK_IFNAME,
    exec_prefix,
    make_plan,
    networks_in_use,
    pick_block,
    setup_commands,
    teardown_commands,
)

BLOCKS = list(ADDRESS_SPACE.subnets(new_prefix=BLOCK_PREFIX))
tokens = st.text("0123456789abcdef", min_size=1, max_size=8)
blocks = st.sampled_from(BLOCKS)


@given(tokens, blocks)
def test_plan_addresses_pair_up_in_their_own_30s_inside_the_block(token, block):
    plan = make_plan(token, block)
    attention, ffn = plan.hosts

    def net(address):
        return ipaddress.IPv4Network(f"{address}/30", strict=False)

    assert net(attention.peer_address) == net(ffn.peer_address)  # the role-to-role link
    for host in plan.hosts:
        assert net(host.uplink_address) == net(host.root_address)  # the host's link to the client
    subnets = {net(ffn.peer_address), net(attention.uplink_address), net(ffn.uplink_address)}
    assert len(subnets) == 3 and all(s.subnet_of(block) for s in subnets)
    addresses = [a for h in plan.hosts for a in (h.peer_address, h.uplink_address, h.root_address)]
    assert len(set(addresses)) == 6
    for address in addresses:  # neither the network nor the broadcast address of its /30
        assert address not in (str(net(address).network_address), str(net(address).broadcast_address))


@given(tokens, blocks)
def test_root_side_names_carry_the_token_and_fit_ifnamsiz(token, block):
    plan = make_plan(token, block)

    names = [h.root_ifname for h in plan.hosts]
    assert len(set(names)) == 2 and all(token in n and len(n) <= IFNAME_MAX for n in names)
    assert all(len(n) <= IFNAME_MAX for n in (PEER_IFNAME, UPLINK_IFNAME))
    assert len({h.namespace for h in plan.hosts}) == 2
    assert all(token in h.namespace for h in plan.hosts)


@example(["10.231.0.1/30"])
@settings(deadline=None)  # 4096 candidate blocks; a loaded CI machine must not fail it on time
@given(st.lists(st.sampled_from(BLOCKS).map(lambda b: str(b.network_address + 5) + "/30"), max_size=50))
def test_pick_block_avoids_every_network_in_use(in_use):
    networks = [ipaddress.IPv4Network(n, strict=False) for n in in_use]

    block = pick_block(networks, random.Random(0))

    assert block.prefixlen == BLOCK_PREFIX and block.subnet_of(ADDRESS_SPACE)
    assert not any(block.overlaps(n) for n in networks)


@settings(deadline=None)
@given(st.lists(st.integers(18, 32).flatmap(
    lambda prefix: st.sampled_from(BLOCKS).map(lambda b: ipaddress.IPv4Network((int(b.network_address), prefix),
                                                                                strict=False))), max_size=3))
def test_pick_block_avoids_networks_of_any_size_inside_the_space(networks):
    """Up to 3 networks of /18 or narrower cover at most 3/4 of the /16: a block is always left."""
    block = pick_block(networks, random.Random(0))

    assert not any(block.overlaps(n) for n in networks)


def test_pick_block_ignores_networks_wider_than_the_space_and_raises_when_full():
    wide = [ipaddress.IPv4Network("0.0.0.0/0"), ipaddress.IPv4Network("10.0.0.0/8")]
    assert pick_block(wide, random.Random(0)).subnet_of(ADDRESS_SPACE)

    with pytest.raises(RuntimeError, match="overlaps a network in use"):
        pick_block([ADDRESS_SPACE], random.Random(0))


def test_networks_in_use_reads_ip_addr_and_route_output():
    output = (
        "2: eth0    inet 192.0.2.2/24 brd 192.0.2.255 scope global eth0\\       valid_lft forever\n"
        "default via 192.0.2.1 dev eth0\n"
        "10.231.7.4/30 dev afd1a2b3ca proto kernel scope link src 10.231.7.5\n"
    )

    found = {str(n) for n in networks_in_use(output)}

    assert {"192.0.2.0/24", "10.231.7.4/30", "10.231.7.5/32", "192.0.2.1/32"} <= found
    assert "default" not in found


def test_setup_brings_lo_up_in_each_namespace_and_teardown_deletes_everything_it_made():
    plan = make_plan("1a2b3c", BLOCKS[0])
    setup = setup_commands(plan)

    for host in plan.hosts:
        assert ["ip", "netns", "add", host.namespace] in setup
        assert ["ip", "-n", host.namespace, "link", "set", "lo", "up"] in setup
        assert ["ip", "-n", host.namespace, "link", "set", PEER_IFNAME, "up"] in setup
    # Namespaces first, then links into them; the example addresses for block 0.
    assert setup.index(["ip", "netns", "add", plan.ffn.namespace]) < 2
    assert (plan.ffn.peer_address, plan.attention.peer_address) == ("10.231.0.1", "10.231.0.2")
    teardown = teardown_commands(plan)
    made = {c[3] for c in setup if c[1:3] == ["netns", "add"]}
    made |= {c[3] for c in setup if c[1:3] == ["link", "add"]}
    deleted = {c[3] for c in teardown}
    assert made == deleted


def test_every_link_in_the_root_namespace_is_named_by_the_run():
    """Two concurrent runs collide only on names they share; the root ends are unique per token."""
    plan = make_plan("1a2b3c", BLOCKS[0])

    root_commands = [c for c in setup_commands(plan) if c[1] in ("link", "addr")]
    for command in root_commands:
        assert any(h.root_ifname in command for h in plan.hosts), command


def test_exec_prefix_runs_inside_the_namespace():
    assert exec_prefix("afd-1a2b3c-ffn") == ["ip", "netns", "exec", "afd-1a2b3c-ffn"]


@pytest.mark.parametrize("token", ["", "ABC", "a-b", "123456789"])
def test_make_plan_rejects_tokens_that_could_break_names(token):
    with pytest.raises(ValueError, match="token"):
        make_plan(token, BLOCKS[0])


def test_make_plan_rejects_blocks_outside_the_space():
    with pytest.raises(ValueError, match="block"):
        make_plan("ab", ipaddress.IPv4Network("192.168.0.0/28"))
