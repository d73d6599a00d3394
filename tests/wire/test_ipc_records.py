"""vllm_afd.wire.transports.records: every IPC store record a hostile client could write is refused clearly.

Each parser is fuzzed with hostile values in each field and with arbitrary bytes: it returns a checked
record or raises ``AFDProtocolError`` naming the key, never another exception. The transport is then
opened against forged records (a third store client, as the attacker would write them): it refuses
before allocating, mapping or opening anything sized or named by them.
"""

from __future__ import annotations

import json
import os
import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.distributed import HashStore

from tests.wire._ipc_sim import FakeDriver, SimDevice, make_transport
from vllm_afd.wire.errors import AFDProtocolError
from vllm_afd.wire.placement import Placement
from vllm_afd.wire.transports.records import (
    MAX_RECORD_BYTES, MAX_ROWS, parse_access, parse_mailbox, parse_mem, parse_who,
)
from vllm_afd.wire.transports.shm import SHM_DIR, FlagBlock

WIDTHS = {"a2f": [32, 16], "f2a": [32]}
KEY = "afd/ipc/0/who/1"
HANDLE = "ab" * 64
PAGE = "afd-ipc-12-0123abcd"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
hostile_names = st.sampled_from(["../../etc/passwd", "/etc/passwd", "afd-ipc-1-0123abcd/../x", "afd-ipc-1-0123abcd\n",
                                 "afd-ipc-1-0123ABCD", "..", "", "afd-ipc--0123abcd", "afd-ipc-1-0123abcd\x00",
                                 "afd-ipc-" + "1" * 400 + "-0123abcd"]) | json_values


def who(**overrides):
    return {"host": "node", "pid": 7, "gpu": "GPU-0", "max_rows": 4, "num_stages": 2, "problem": None,
            "row_bytes": WIDTHS, **overrides}


def raw(value) -> bytes:
    return json.dumps(value).encode()


def is_int_in(value, low, high) -> bool:
    return type(value) is int and low <= value <= high


def is_text(value) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 1024


# ---- parsers ----------------------------------------------------------------------------------------


def test_a_valid_who_record_and_a_refusal_record_parse_to_themselves():
    assert parse_who(raw(who()), KEY, row_bytes=WIDTHS, num_stages=2) == who()
    refusal = {"problem": "no V2 memops"}
    assert parse_who(raw(refusal), KEY, row_bytes=WIDTHS, num_stages=2) == refusal


VALID = {"max_rows": lambda v: is_int_in(v, 1, MAX_ROWS), "pid": lambda v: is_int_in(v, 1, (1 << 31) - 1),
         "host": is_text, "gpu": is_text, "num_stages": lambda v: type(v) is int and v == 2,
         "row_bytes": lambda v: v == WIDTHS, "problem": lambda v: v is None}


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(VALID)), json_values | st.integers(-(1 << 70), 1 << 70))
@example("max_rows", -2)  # the finding: the FFN allocated 512 bytes where the peer's slot took 800
@example("max_rows", 0)
@example("max_rows", MAX_ROWS + 1)
@example("max_rows", True)
@example("max_rows", 4.0)
@example("max_rows", "4")
@example("num_stages", 1)
@example("row_bytes", {"a2f": [True, 16], "f2a": [32]})
@example("row_bytes", {"a2f": [32, 16], "f2a": [-32]})
@example("pid", 0)
def test_a_hostile_who_field_is_refused_naming_the_key_or_is_a_valid_value(field, value):
    try:
        parsed = parse_who(raw(who(**{field: value})), KEY, row_bytes=WIDTHS, num_stages=2)
    except AFDProtocolError as exc:
        assert str(exc).startswith(f"P2pIpcAFDConnector: store record {KEY}: ") and "expected" in str(exc)
        assert not VALID[field](value)
        return
    assert VALID[field](value) and parsed == who(**{field: value})


@pytest.mark.parametrize("record", [
    {k: v for k, v in who().items() if k != "max_rows"},  # a field missing
    {**who(), "extra": 1},  # a field too many
    [who()], "who", None, 3,
    {"problem": 5}, {"problem": ""}, {"problem": "x" * 2000},
    {**who(), "problem": "both a reason and the fields"},
])
def test_a_who_record_of_another_shape_is_refused(record):
    with pytest.raises(AFDProtocolError, match=f"store record {KEY}: "):
        parse_who(raw(record), KEY, row_bytes=WIDTHS, num_stages=2)


PARSERS = {
    "who": lambda data: parse_who(data, KEY, row_bytes=WIDTHS, num_stages=2),
    "access": lambda data: parse_access(data, KEY),
    "mem": lambda data: parse_mem(data, KEY, nbytes=1024, has_flags=True),
    "mailbox": lambda data: parse_mailbox(data, KEY),
}


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(PARSERS)), st.binary(max_size=200) | json_values.map(raw))
@example("who", b"[" * 100_000)  # nested without end: RecursionError inside json
@example("mem", b"9" * 5000)  # more digits than int() converts
@example("access", b"\xff\xfe\x00")
@example("mailbox", b" " * (MAX_RECORD_BYTES + 1))
@example("who", b"\x80\x03cbuiltins\nprint\nq\x00X\x03\x00\x00\x00ranq\x01\x85q\x02Rq\x03.")  # a pickle
def test_arbitrary_bytes_are_a_checked_record_or_a_protocol_error(kind, data):
    try:
        PARSERS[kind](data)
    except AFDProtocolError as exc:
        assert f"store record {KEY}" in str(exc)


def test_a_valid_access_mem_and_mailbox_record_parse():
    mailbox = {"name": PAGE, "host": "node", "slots": 8, "slot_bytes": 65536}

    assert parse_access(raw(None), KEY) is None and parse_access(raw("no peer access"), KEY) == "no peer access"
    assert parse_mem(raw({"handle": HANDLE, "bytes": 1024, "flags": PAGE}), KEY, nbytes=1024, has_flags=True) == {
        "handle": bytes.fromhex(HANDLE), "bytes": 1024, "flags": PAGE}
    attention_mem = {"handle": HANDLE, "bytes": 0, "flags": None}
    assert parse_mem(raw(attention_mem), KEY, nbytes=0, has_flags=False)["flags"] is None
    assert parse_mailbox(raw(mailbox), KEY) == mailbox


@pytest.mark.parametrize("record, expected", [
    ({"handle": "ab" * 63, "bytes": 1024, "flags": PAGE}, "handle is"),
    ({"handle": "AB" * 64, "bytes": 1024, "flags": PAGE}, "handle is"),
    ({"handle": "zz" * 64, "bytes": 1024, "flags": PAGE}, "handle is"),
    ({"handle": 5, "bytes": 1024, "flags": PAGE}, "handle is"),
    ({"handle": HANDLE, "bytes": 512, "flags": PAGE}, "bytes (its slot allocation) is 512; expected 1024"),
    ({"handle": HANDLE, "bytes": -1, "flags": PAGE}, "bytes (its slot allocation) is -1"),
    ({"handle": HANDLE, "bytes": True, "flags": PAGE}, "bytes (its slot allocation) is True"),
    ({"handle": HANDLE, "bytes": 1024, "flags": None}, "names the shared-memory page None"),
])
def test_a_hostile_mem_record_is_refused(record, expected):
    with pytest.raises(AFDProtocolError, match=f"store record {KEY}.*{re.escape(expected)}"):
        parse_mem(raw(record), KEY, nbytes=1024, has_flags=True)


@settings(max_examples=200, deadline=None)
@given(hostile_names)
def test_a_page_name_other_than_the_creators_pattern_is_refused(name):
    mem = {"handle": HANDLE, "bytes": 1024, "flags": name}
    mailbox = {"name": name, "host": "node", "slots": 8, "slot_bytes": 65536}

    with pytest.raises(AFDProtocolError, match="names the shared-memory page .*; expected a name of the form"):
        parse_mem(raw(mem), KEY, nbytes=1024, has_flags=True)
    with pytest.raises(AFDProtocolError, match="names the shared-memory page"):
        parse_mailbox(raw(mailbox), KEY)
    with pytest.raises(AFDProtocolError, match="names the shared-memory page"):
        FlagBlock.attach(name, 64)


def test_only_the_ffn_names_a_flag_page():
    with pytest.raises(AFDProtocolError, match="flags is 'afd-ipc-12-0123abcd'; expected null"):
        parse_mem(raw({"handle": HANDLE, "bytes": 8, "flags": PAGE}), KEY, nbytes=8, has_flags=False)


# ---- the transport against forged records ------------------------------------------------------------


FFN, ATTENTION = Placement("ffn", 0, 1, 1), Placement("attention", 0, 1, 1)
FFN_WIDTHS = {"a2f": [32, 16], "f2a": [32]}  # make_transport's: hidden 8 x fp32, 4 router logits x fp32


def forged_store(records: dict[str, object]) -> HashStore:
    """A store in which a third client already wrote ``records`` (values JSON-encoded unless bytes)."""
    store = HashStore()
    for key, value in records.items():
        store.set(key, value if isinstance(value, bytes) else json.dumps(value))
    return store


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(json_values | st.integers(-(1 << 40), 1 << 40))
@example(-2)
@example(MAX_ROWS + 1)
def test_the_ffn_refuses_a_forged_max_rows_before_allocating(max_rows):
    if is_int_in(max_rows, 1, MAX_ROWS):
        return
    driver = FakeDriver(SimDevice(), pid=1)
    store = forged_store({"afd/ipc/0/who/1": who(pid=2, max_rows=max_rows, num_stages=1, row_bytes=FFN_WIDTHS)})

    with pytest.raises(AFDProtocolError, match="store record afd/ipc/0/who/1: "):
        make_transport(driver).open(store, FFN, 1.0)

    assert "alloc" not in driver.calls and not driver.live


def test_a_rank_whose_own_record_was_overwritten_refuses():
    class RacingStore(HashStore):
        """The attacker rewrites the attention's record right after the attention set it."""

        def set(self, key, value):
            super().set(key, value)
            if key == "afd/ipc/0/who/1":
                super().set(key, json.dumps(who(pid=1, max_rows=4000, num_stages=1, row_bytes=FFN_WIDTHS)))

    driver = FakeDriver(SimDevice(), pid=1)
    store = RacingStore()
    store.set("afd/ipc/0/who/0", json.dumps(who(pid=2, row_bytes=FFN_WIDTHS, num_stages=1)))

    with pytest.raises(AFDProtocolError, match="store record afd/ipc/0/who/1: this rank's own record is"):
        make_transport(driver).open(store, ATTENTION, 1.0)

    assert "alloc" not in driver.calls


def ffn_records(driver: FakeDriver, flags: str, handle: bytes, nbytes: int) -> dict[str, object]:
    return {"afd/ipc/0/who/0": who(pid=2, num_stages=1, row_bytes=FFN_WIDTHS), "afd/ipc/0/access/0": None,
            "afd/ipc/0/mem/0": {"handle": handle.hex(), "bytes": nbytes, "flags": flags}}


def test_the_attention_refuses_a_forged_flag_page_path_before_opening_it(tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    sim = SimDevice()
    attention, forger = FakeDriver(sim, pid=1), FakeDriver(sim, pid=2)
    slots = forger.alloc(512)  # the FFN's plan for one peer of max_rows 4: two a2f slots of 256 bytes
    name = os.path.relpath(target, SHM_DIR)  # ../tmp/.../victim, joined onto /dev/shm

    with pytest.raises(AFDProtocolError, match="names the shared-memory page '../"):
        make_transport(attention).open(forged_store(ffn_records(forger, name, forger.ipc_handle(slots), 512)),
                                       ATTENTION, 1.0)

    assert target.read_bytes() == b"precious" and not attention.live


def test_the_attention_refuses_an_allocation_smaller_than_its_plan_before_writing():
    """The store may claim any size; the driver's size of the mapped allocation is what counts."""
    sim = SimDevice()
    attention, forger = FakeDriver(sim, pid=1), FakeDriver(sim, pid=2)
    small = forger.alloc(256)
    page = FlagBlock.create(3 * 16 * 4)  # the plan's 3 flags
    try:
        store = forged_store(ffn_records(forger, page.name, forger.ipc_handle(small), 512))
        with pytest.raises(AFDProtocolError, match="mapped here has 256 bytes; the slot plan needs 512"):
            make_transport(attention).open(store, ATTENTION, 1.0)
    finally:
        page.unlink()
        page.close()

    assert not attention.live and "enqueue" not in attention.calls
