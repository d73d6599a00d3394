"""P2pProtocol in one process: channel plans, lifecycle edges, checks that need no peer (AFD_SPEC §3.2-3.6, §4)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "connectors"))
from _harness import free_port, make_protocol, make_settings  # noqa: E402

from vllm_afd.connectors.channels import ChannelPlan  # noqa: E402
from vllm_afd.connectors.metadata import (  # noqa: E402
    AFDControlPayload,
    AFDDPMetadata,
    AFDTransferContext,
    AFDTransferMetadata,
)
from vllm_afd.errors import AFDProtocolError, AFDRendezvousTimeout  # noqa: E402


@pytest.mark.parametrize(
    ("num_attention", "num_ffn", "role", "rank", "expected"),
    [
        # (afd_rank, subgroup, members, control_rank, control_size)
        (1, 1, "attention", 0, (1, 0, (0, 1), 1, 2)),
        (2, 1, "attention", 1, (2, 0, (0, 1, 2), None, 2)),
        (2, 2, "attention", 1, (3, 1, (1, 3), 3, 4)),
        (3, 2, "attention", 1, (3, 0, (0, 2, 3), 3, 4)),  # data to FFN 0, control to FFN 1
        (3, 2, "attention", 2, (4, 1, (1, 4), None, 4)),
        (4, 2, "attention", 2, (4, 1, (1, 4, 5), None, 4)),
        (4, 2, "ffn", 1, (1, 1, (1, 4, 5), 1, 4)),
        (4, 4, "attention", 3, (7, 3, (3, 7), 7, 8)),
    ],
)
def test_channel_plan_follows_the_pairing_rules(num_attention, num_ffn, role, rank, expected):
    plan = ChannelPlan.for_rank(role, rank, num_attention, num_ffn)

    assert (plan.afd_rank, plan.subgroup, plan.subgroup_members, plan.control_rank, plan.control_size) == expected
    assert plan.subgroup_members[plan.subgroup_rank] == plan.afd_rank


def test_close_is_safe_uninitialised_and_repeated():
    protocol = make_protocol(make_settings("attention", 0, 1, 1, free_port()))

    protocol.close()
    protocol.close()

    assert not protocol.is_initialized
    with pytest.raises(RuntimeError, match="P2P connector is closed"):
        protocol.check_failed() or protocol.recv_ffn_output(torch.zeros(1, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="after close"):
        protocol.init()


def test_every_call_before_init_says_not_initialized():
    protocol = make_protocol(make_settings("ffn", 0, 1, 1, free_port()))
    payload = AFDControlPayload({0: AFDDPMetadata((1,))})
    context = AFDTransferContext(AFDTransferMetadata.create_ffn_metadata(0, 0, [1]))
    calls = [
        lambda: protocol.update_state_from_dp_metadata(payload),
        lambda: protocol.send_dp_metadata_list(payload),
        protocol.recv_dp_metadata_list,
        protocol.recv_attn_output,
        lambda: protocol.send_ffn_output(torch.zeros(1, 64, dtype=torch.bfloat16), context),
        protocol.mark_startup_done,
    ]

    for call in calls:
        with pytest.raises(RuntimeError, match="P2P connector is not initialized"):
            call()


def test_close_after_a_failed_rendezvous_releases_everything():
    port = free_port()
    protocol = make_protocol(make_settings("ffn", 0, 1, 1, port, rendezvous_timeout_s=0.5))
    threads_before = threading.active_count()

    with pytest.raises(AFDRendezvousTimeout, match="missing: attention \\[0\\]"):
        protocol.init()
    protocol.close()
    protocol.close()

    assert not protocol.is_initialized
    assert threading.active_count() <= threads_before
    again = make_protocol(make_settings("ffn", 0, 1, 1, port, rendezvous_timeout_s=0.5))
    with pytest.raises(AFDRendezvousTimeout):  # the port is free again: the store was released
        again.init()
    again.close()


def test_close_cancels_a_pending_init_without_waiting_for_it():
    protocol = make_protocol(make_settings("ffn", 0, 1, 1, free_port(), rendezvous_timeout_s=30.0))
    errors = []

    def init():
        try:
            protocol.init()
        except Exception as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    thread = threading.Thread(target=init)
    thread.start()
    time.sleep(0.5)  # FFN rank 0 is waiting for an attention rank that never comes
    started = time.monotonic()
    protocol.close()

    assert time.monotonic() - started < 5.0
    thread.join(5.0)
    assert not thread.is_alive()
    assert "cancelled: the connector was closed" in str(errors[0])


@pytest.fixture
def pair():
    """An initialised 1A1F pair in this process (gloo over loopback), closed afterwards."""
    port = free_port()
    protocols = [make_protocol(make_settings(role, 0, 1, 1, port)) for role in ("ffn", "attention")]
    threads = [threading.Thread(target=p.init) for p in protocols]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20.0)
    assert all(p.is_initialized for p in protocols)
    yield protocols
    for protocol in reversed(protocols):
        protocol.close()


def serve_one_step(ffn, transform):
    """The FFN's side of one single-layer step, on a thread (gloo sends wait for the matching receive)."""
    def body():
        ffn.update_state_from_dp_metadata(ffn.recv_dp_metadata_list())
        received = ffn.recv_attn_output()
        ffn.send_ffn_output(transform(received.hidden_states), received.context)
    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def test_role_and_shape_checks_raise_before_sending(pair):
    ffn, attention = pair
    server = serve_one_step(ffn, lambda hidden: hidden + 1)
    attention.send_dp_metadata({0: [3]})
    good = torch.zeros(3, 64, dtype=torch.bfloat16)
    context = AFDTransferContext(AFDTransferMetadata.create_attention_metadata(0, 0, 3))
    bad = {
        "rank 1": torch.zeros(3 * 64, dtype=torch.bfloat16),
        "width 32": torch.zeros(3, 32, dtype=torch.bfloat16),
        "dtype torch.float32": torch.zeros(3, 64),
    }

    for expected, tensor in bad.items():
        with pytest.raises(ValueError, match=expected):
            attention.send_attn_output(tensor, context)
    with pytest.raises(ValueError, match="compute_gate_on_attention=false"):
        attention.send_attn_output(good, context, torch.zeros(3, 8))
    with pytest.raises(RuntimeError, match="is a ffn-side call"):
        attention.recv_attn_output()
    with pytest.raises(RuntimeError, match="no published state for stage 1"):
        attention.send_attn_output(good, AFDTransferContext(AFDTransferMetadata.create_attention_metadata(0, 1, 3)))

    attention.send_attn_output(good, context)  # nothing bad reached the wire: the FFN sees exactly this
    assert torch.equal(attention.recv_ffn_output(good), torch.ones(3, 64, dtype=torch.bfloat16))
    server.join(10.0)
    with pytest.raises(AFDProtocolError, match="has 2 DP counts"):
        attention.update_state_from_dp_metadata(AFDControlPayload({0: AFDDPMetadata((1, 2))}))


def test_result_goes_to_a_new_tensor_when_ref_tensor_does_not_fit(pair):
    ffn, attention = pair
    server = serve_one_step(ffn, lambda hidden: hidden * 2)
    attention.send_dp_metadata({0: [2]})
    hidden = torch.arange(128, dtype=torch.bfloat16).reshape(2, 64)
    attention.send_attn_output(hidden, AFDTransferContext(AFDTransferMetadata.create_attention_metadata(0, 0, 2)))

    ref = torch.zeros(2, 64, dtype=torch.float32)  # same rows, other dtype: not a receive buffer
    out = attention.recv_ffn_output(ref)

    assert out is not ref and out.dtype == torch.bfloat16
    assert torch.equal(out, hidden * 2)
    server.join(10.0)


def test_mark_startup_done_arms_step_timeouts_on_both_sides(pair):
    ffn, attention = pair

    attention.mark_startup_done()
    attention.mark_startup_done()  # counted once per attention rank
    deadline = time.monotonic() + 5.0
    while not (ffn._watchdog.armed and attention._watchdog.armed):
        assert time.monotonic() < deadline
        time.sleep(0.02)
