"""vllm_afd.wire.ends: ``make_connector`` builds the end of the placement's role, and nothing else."""

from __future__ import annotations

import pytest

from tests.connectors._harness import QueueTransport, free_port, make_fingerprint, make_spec, new_wire

from vllm_afd.wire.attention_end import AttentionConnector
from vllm_afd.wire.ends import make_connector
from vllm_afd.wire.ffn_end import FFNConnector
from vllm_afd.role import Role
from vllm_afd.wire.placement import Placement


@pytest.mark.parametrize(("role", "end"), [("attention", AttentionConnector), ("ffn", FFNConnector),
                                           (Role.ATTENTION, AttentionConnector), (Role.FFN, FFNConnector)])
def test_the_factory_picks_the_end_by_the_placements_role(role, end):
    placement = Placement(role, 0, 1, 1)
    transport = QueueTransport(new_wire())
    spec = make_spec(free_port())

    connector = make_connector(spec, placement, transport, make_fingerprint(placement))

    assert type(connector) is end
    assert connector.placement.role is Role(role)
    assert (connector.spec, connector.transport) == (spec, transport)
    assert not connector.is_initialized and not connector.can_reform  # built only: nothing communicated


def test_the_factory_passes_the_connector_options_through():
    placement = Placement("ffn", 0, 1, 1)
    failures: list[BaseException] = []
    fresh = QueueTransport(new_wire())

    connector = make_connector(make_spec(free_port()), placement, QueueTransport(new_wire()),
                               make_fingerprint(placement), terminate=None, new_transport=lambda: fresh,
                               on_failure=failures.append)
    connector.fail(RuntimeError("lost"))

    assert connector.can_reform and connector._new_transport() is fresh
    assert [str(exc) for exc in failures] == ["lost"]
    connector.close()


def test_an_unknown_role_never_reaches_the_factory():
    with pytest.raises(ValueError, match="AFD placement: role must be 'attention' or 'ffn', got 'moe'"):
        Placement("moe", 0, 1, 1)
