"""The control mailbox (wire/transports/mailbox.py): order, framing, flow control, torn reads, abort, refusals."""

from __future__ import annotations

import json
import struct
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed import HashStore

from vllm_afd.wire.errors import AFDProtocolError
from vllm_afd.wire.placement import CONTROL, Placement
from vllm_afd.wire.transports.mailbox import HEADER_BYTES, SLOT_HEADER, MailboxTransport


def opened_pair(**kwargs):
    """FFN 0 and attention 0 of a 1 x 1 deployment, opened on one in-process store."""
    store = HashStore()
    ffn, attention = MailboxTransport(**kwargs), MailboxTransport(**kwargs)
    thread = threading.Thread(target=ffn.open, args=(store, Placement("ffn", 0, 1, 1, 1, 1), 10.0))
    thread.start()
    attention.open(store, Placement("attention", 0, 1, 1, 1, 1), 10.0)
    thread.join(10.0)
    return ffn, attention


def message(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.binary(min_size=0, max_size=300), min_size=1, max_size=30))
def test_messages_arrive_in_order_and_exact_across_ring_wraps(payloads):
    ffn, attention = opened_pair(slots=4, slot_bytes=512)
    received = []

    def reader():
        for data in payloads:
            out = torch.empty(len(data), dtype=torch.uint8)
            ffn.recv(CONTROL, out, 1)
            received.append(out.numpy().tobytes())

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for data in payloads:  # more messages than slots: the writer waits for the reader
            attention.send(CONTROL, message(data), 0)
        thread.join(10.0)
    finally:
        ffn.close()
        attention.close()
    assert received == payloads


def test_an_int64_length_then_a_body_as_the_connector_frames_them():
    ffn, attention = opened_pair()
    try:
        attention.send(CONTROL, torch.tensor([5], dtype=torch.int64), 0)
        attention.send(CONTROL, message(b"hello"), 0)
        length = torch.empty(1, dtype=torch.int64)
        ffn.recv(CONTROL, length, 1)
        body = torch.empty(int(length.item()), dtype=torch.uint8)
        ffn.recv(CONTROL, body, 1)
    finally:
        ffn.close()
        attention.close()
    assert body.numpy().tobytes() == b"hello"


def test_a_full_mailbox_holds_the_writer_until_the_reader_takes_one():
    ffn, attention = opened_pair(slots=2, slot_bytes=64)
    try:
        attention.send(CONTROL, message(b"a"), 0)
        attention.send(CONTROL, message(b"b"), 0)
        third = threading.Thread(target=attention.send, args=(CONTROL, message(b"c"), 0))
        third.start()
        third.join(0.2)
        assert third.is_alive()  # no slot free
        out = torch.empty(1, dtype=torch.uint8)
        ffn.recv(CONTROL, out, 1)
        third.join(5.0)
        assert not third.is_alive() and out.numpy().tobytes() == b"a"
    finally:
        ffn.close()
        attention.close()


def test_a_slot_read_mid_write_is_read_again_not_taken():
    """seq already written but the payload not yet (a store order the reader may see): the CRC refuses it."""
    ffn, attention = opened_pair(slots=2, slot_bytes=64)
    view = attention._view
    offset = HEADER_BYTES
    view[offset + SLOT_HEADER.size:offset + SLOT_HEADER.size + 3] = b"xyz"
    struct.pack_into("<QII", view, offset, 1, 3, 12345)  # seq 1, but a CRC that does not match yet
    out = torch.empty(3, dtype=torch.uint8)
    thread = threading.Thread(target=ffn.recv, args=(CONTROL, out, 1))
    thread.start()
    thread.join(0.2)
    try:
        assert thread.is_alive()
        import zlib

        struct.pack_into("<I", view, offset + 12, zlib.crc32(b"xyz"))  # the write completes
        thread.join(5.0)
        assert not thread.is_alive() and out.numpy().tobytes() == b"xyz"
    finally:
        ffn.close()
        attention.close()


def test_abort_releases_a_blocked_receive_with_an_error():
    ffn, attention = opened_pair()
    errors = []

    def reader():
        try:
            ffn.recv(CONTROL, torch.empty(1, dtype=torch.int64), 1)
        except RuntimeError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(0.1)
    started = time.monotonic()
    ffn.abort()
    thread.join(5.0)
    try:
        assert not thread.is_alive() and time.monotonic() - started < 1.0
        assert "aborted or closed the mailbox" in errors[0]
    finally:
        ffn.close()
        attention.close()


def test_refusals_name_the_fix():
    ffn, attention = opened_pair(slot_bytes=16)
    try:
        with pytest.raises(ValueError, match="control message of 17 bytes does not fit the mailbox's 16-byte"):
            attention.send(CONTROL, message(b"x" * 17), 0)
        with pytest.raises(ValueError, match="carries the 'ctrl' channel only, got 'a2f'"):
            attention.send("a2f", message(b"x"), 0)
        attention.send(CONTROL, message(b"abcd"), 0)
        with pytest.raises(RuntimeError, match="has 4 bytes, the receive expects 8"):
            ffn.recv(CONTROL, torch.empty(1, dtype=torch.int64), 1)
    finally:
        ffn.close()
        attention.close()
    with pytest.raises(RuntimeError, match="control mailbox is not open"):
        MailboxTransport().send(CONTROL, message(b"x"), 0)


def test_a_control_pair_on_two_hosts_is_refused_naming_both():
    store = HashStore()
    store.set("afd/mailbox/0", '{"name": "afd-ipc-1-0123abcd", "host": "other-host", "slots": 8, "slot_bytes": 65536}')

    with pytest.raises(RuntimeError, match="its control peer, FFN rank 0, on other-host; the control mailbox is shared "
                                           "memory of one host"):
        MailboxTransport().open(store, Placement("attention", 0, 1, 1, 1, 1), 1.0)


@pytest.mark.parametrize("record, expected", [
    ({"name": "../../tmp/afd-victim", "host": "h", "slots": 8, "slot_bytes": 65536}, "names the shared-memory page"),
    ({"name": "/tmp/afd-victim", "host": "h", "slots": 8, "slot_bytes": 65536}, "names the shared-memory page"),
    ({"name": "afd-ipc-1-0123abcd", "host": "h", "slots": -1, "slot_bytes": 65536}, "slots is -1"),
    ({"name": "afd-ipc-1-0123abcd", "host": "h", "slots": 8}, "its set of fields is"),
    ("not an object", "expected a JSON object"),
])
def test_a_forged_mailbox_record_is_refused_before_any_file_is_opened(tmp_path, record, expected):
    """A third store client names the page: an absolute or ../ name once made the attention map and write a file."""
    store = HashStore()
    store.set("afd/mailbox/0", json.dumps(record))

    with pytest.raises(AFDProtocolError, match=f"store record afd/mailbox/0.*{expected}"):
        MailboxTransport().open(store, Placement("attention", 0, 1, 1, 1, 1), 1.0)

    assert not store.check(["afd/mailbox/0/attached"])


def test_attention_ranks_beyond_f_open_nothing():
    MailboxTransport().open(HashStore(), Placement("attention", 1, 2, 1, 2, 1), 0.1)


def test_the_connector_publishes_and_adopts_through_the_mailbox():
    """AFDConnector's control framing (int64 length, then the body) over the mailbox, data in memory."""

    from tests.connectors._harness import (QueueTransport, free_port, init_all, make_connector, make_placement,
                                           make_spec, new_wire)

    class MailboxControl(QueueTransport):
        def __init__(self, wire):
            super().__init__(wire)
            self.mailbox = MailboxTransport()

        def open(self, store, placement, timeout_s):
            super().open(store, placement, timeout_s)
            self.mailbox.open(store, placement, timeout_s)

        def send(self, channel, tensor, dst):
            (self.mailbox.send if channel == CONTROL else super().send)(channel, tensor, dst)

        def recv(self, channel, tensor, src):
            (self.mailbox.recv if channel == CONTROL else super().recv)(channel, tensor, src)

        def abort(self):
            self.mailbox.abort()

        def close(self):
            self.mailbox.close()

    port, wire = free_port(), new_wire()
    spec = make_spec(port, exchanges_per_stage=1)
    ffn = make_connector(spec, make_placement("ffn", 0, 1, 1), transport=MailboxControl(wire))
    attention = make_connector(spec, make_placement("attention", 0, 1, 1), transport=MailboxControl(wire))
    init_all([ffn, attention])
    try:
        adopted = []
        reader = threading.Thread(target=lambda: adopted.extend(ffn.next_step() for _ in range(20)))
        reader.start()  # 20 payloads are 40 messages: more than the mailbox holds, so the FFN reads meanwhile
        published = [attention.publish({0: [n]}, is_graph_replaying=n % 2 == 0) for n in range(1, 21)]
        reader.join(20.0)
    finally:
        attention.close()
        ffn.close()
    assert adopted == published
