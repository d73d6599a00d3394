"""vllm_afd.wire.transports.nccl on CPU: the NCCL unique id crosses the store as raw bytes, checked, never unpickled.

The communicators themselves need GPUs (tests/connectors/test_connectors_cuda.py); what runs here is the
exchange in front of them (``exchange_unique_id``) on an in-process store, with hostile values written
by a third client as the attacker would.
"""

from __future__ import annotations

import pickle
import threading

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.distributed import HashStore, PrefixStore

from vllm_afd.wire.errors import AFDPeerLostError, AFDProtocolError
from vllm_afd.wire.transports.nccl import NCCL_UNIQUE_ID_BYTES, UNIQUE_ID_KEY, _identity, exchange_unique_id

MINTED = bytes(range(NCCL_UNIQUE_ID_BYTES))
RAN: list[str] = []  # what a hostile pickle would append to, were it ever unpickled


class Payload:
    def __reduce__(self):
        return RAN.append, ("code from the store ran",)


def channel_store() -> PrefixStore:
    return PrefixStore("afd/a2f/0", HashStore())


def test_group_rank_0_mints_once_and_every_other_rank_reads_the_same_bytes():
    store, got = channel_store(), {}
    minted = []

    def mint() -> bytes:
        minted.append(1)
        return MINTED

    readers = [threading.Thread(target=lambda r=r: got.__setitem__(r, exchange_unique_id(store, r, mint, 10.0, "a2f")))
               for r in (1, 2, 3)]
    for thread in readers:
        thread.start()
    got[0] = exchange_unique_id(store, 0, mint, 10.0, "a2f")
    for thread in readers:
        thread.join(10.0)

    assert got == {r: MINTED for r in range(4)} and minted == [1]
    assert store.get(UNIQUE_ID_KEY) == MINTED


def test_a_pickle_a_third_client_wrote_is_refused_and_never_runs():
    """The finding: a store client pre-set the key with a pickle; vLLM's StatelessProcessGroup ran it."""
    store = channel_store()
    store.set(UNIQUE_ID_KEY, pickle.dumps(Payload()))

    with pytest.raises(AFDProtocolError, match=f"has {len(pickle.dumps(Payload()))} bytes; expected the "
                                               f"{NCCL_UNIQUE_ID_BYTES} raw bytes of an ncclUniqueId"):
        exchange_unique_id(store, 1, lambda: MINTED, 1.0, "a2f")
    with pytest.raises(AFDProtocolError, match="the NCCL unique id key of the AFD a2f channel was set before this "
                                               "rank .group rank 0. minted it"):
        exchange_unique_id(store, 0, lambda: MINTED, 1.0, "a2f")
    assert RAN == []


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=4 * NCCL_UNIQUE_ID_BYTES))
@example(b"")
@example(bytes(NCCL_UNIQUE_ID_BYTES - 1))
@example(bytes(NCCL_UNIQUE_ID_BYTES + 1))
def test_a_value_of_any_other_length_is_a_protocol_error_and_the_right_length_is_taken_as_bytes(value):
    store = channel_store()
    store.set(UNIQUE_ID_KEY, value)

    if len(value) == NCCL_UNIQUE_ID_BYTES:
        assert exchange_unique_id(store, 2, lambda: MINTED, 1.0, "f2a") == value
    else:
        with pytest.raises(AFDProtocolError, match=f"the NCCL unique id of the AFD f2a channel in the store has "
                                                   f"{len(value)} bytes"):
            exchange_unique_id(store, 2, lambda: MINTED, 1.0, "f2a")


def test_a_missing_id_is_a_lost_peer_naming_the_channel():
    with pytest.raises(AFDPeerLostError, match="group rank 0 of the AFD f2a channel did not publish the channel's "
                                               "NCCL unique id within 0.2 s"):
        exchange_unique_id(channel_store(), 1, lambda: MINTED, 0.2, "f2a")


@pytest.mark.parametrize("raw", [b"\xff\xfe not utf-8", b"x" * 2000, "a str"])
def test_a_gpu_identity_that_is_not_bounded_utf8_is_a_protocol_error(raw):
    with pytest.raises(AFDProtocolError, match="store record afd/gpu/1 is .*; expected hostname/GPU-UUID"):
        _identity(raw, "afd/gpu/1")


def test_a_gpu_identity_is_read_as_text():
    assert _identity(b"node-1/GPU-1234", "afd/gpu/0") == "node-1/GPU-1234"
