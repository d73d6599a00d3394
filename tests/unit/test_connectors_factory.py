"""Connector registry, factory and the null connector (AFD_SPEC §4.1, §4.7); no vLLM needed."""

from __future__ import annotations

import pytest

from vllm_afd.config import AFDConfig
from vllm_afd.connectors import factory
from vllm_afd.connectors.base import AFDConnectorBase
from vllm_afd.connectors.null import NULL_CONNECTOR, NullAFDConnector


@pytest.fixture
def registry(monkeypatch):
    """A private copy of the (overlay-owned) registry, so test registrations do not leak."""
    monkeypatch.setattr(factory, "_REGISTRY", dict(factory._REGISTRY))
    return factory


def test_both_connectors_are_registered_lazily():
    assert factory.registered_connector_types() == ("P2pGlooAFDConnector", "P2pNcclAFDConnector")
    assert factory._REGISTRY["P2pNcclAFDConnector"] == "vllm_afd.connectors.nccl:P2pNcclAFDConnector"


def test_gloo_class_resolves_to_an_afd_connector():
    cls = factory.get_connector_class("P2pGlooAFDConnector")

    assert issubclass(cls, AFDConnectorBase)
    assert cls.__name__ == "P2pGlooAFDConnector"


def test_a_second_registration_of_a_name_is_rejected(registry):
    with pytest.raises(ValueError, match="connector 'P2pGlooAFDConnector' is already registered"):
        registry.register_connector_type("P2pGlooAFDConnector", "somewhere:Else")


def test_targets_must_name_module_and_class(registry):
    for target in ("no_colon", ":Class", "module:"):
        with pytest.raises(ValueError, match="is not 'module:Class'"):
            registry.register_connector_type("Broken", target)


def test_unknown_names_are_rejected_listing_the_registered_ones(registry):
    with pytest.raises(ValueError) as info:
        registry.get_connector_class("CAMP2pAFDConnector")

    assert str(info.value).startswith("unsupported AFD connector type: CAMP2pAFDConnector; registered: ")
    assert "P2pGlooAFDConnector" in str(info.value)


def test_a_class_that_is_not_a_connector_is_a_type_error(registry):
    registry.register_connector_type("NotAConnector", "collections:OrderedDict")

    with pytest.raises(TypeError, match="not an AFDConnectorBase subclass"):
        registry.get_connector_class("NotAConnector")


def test_factory_returns_the_null_connector_when_afd_is_off():
    assert factory.create_connector(0, 0, {"some_other_plugin": {}}) is NULL_CONNECTOR
    assert factory.create_connector(0, 0, None) is NULL_CONNECTOR


def test_factory_rejects_an_explicit_role_rank_out_of_range():
    afd = AFDConfig(role="attention", connector="P2pGlooAFDConnector", num_attention_ranks=2)

    with pytest.raises(ValueError, match="role_rank 2 is out of range for role attention"):
        factory.create_connector(0, 0, None, afd, role_rank=2)


def test_null_connector_is_idle_and_refuses_transfers():
    assert isinstance(NULL_CONNECTOR, NullAFDConnector)
    assert NULL_CONNECTOR.control_plane is None
    NULL_CONNECTOR.init_afd_connector()
    NULL_CONNECTOR.check_failed()
    NULL_CONNECTOR.close()
    NULL_CONNECTOR.close()
    assert not NULL_CONNECTOR.is_initialized

    for call in (lambda: NULL_CONNECTOR.send_attn_output(None, None), lambda: NULL_CONNECTOR.recv_ffn_output(None),
                 NULL_CONNECTOR.recv_attn_output, lambda: NULL_CONNECTOR.send_ffn_output(None, None)):
        with pytest.raises(RuntimeError, match="AFD is not active in this process"):
            call()
    with pytest.raises(RuntimeError, match="needs a control plane"):
        NULL_CONNECTOR.update_state_from_dp_metadata(None)


def test_extra_config_must_be_an_empty_mapping():
    cls = factory.get_connector_class("P2pGlooAFDConnector")

    assert dict(cls.parse_extra_config({})) == {}
    with pytest.raises(ValueError, match="P2pGlooAFDConnector does not support connector_extra_config"):
        cls.parse_extra_config({"buffer_mb": 4})
    with pytest.raises(TypeError, match="P2P connector_extra_config must be a mapping"):
        cls.parse_extra_config(["buffer_mb"])
