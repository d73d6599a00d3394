"""Receives posted ahead (docs/protocol.md#receive-order): over gloo on CPU the FFN posts an exchange's receives as
soon as the previous exchange's completed, the attention a stage's f2a receive before its a2f send.

Real gloo connectors on loopback, in this process: the FFN end runs in a thread, the attention ranks in the test's
thread (their sends never block). What crosses must not change with the receives posted ahead (the rows each end
gets, stages 2 and 3, one and two attention peers, integrity on and off, router logits or none); nothing stays
posted after a step's last exchange, so the next step's payload and rows come through; a receive on an exchange
other than the one posted is the lost-peer error, at once; closing or re-forming with a receive still posted is
bounded and leaves nothing behind.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
import torch

from tests.connectors._harness import free_port, init_all, make_connector, make_placement, make_spec

from vllm_afd.wire.errors import AFDPeerLostError
from vllm_afd.wire.messages import RoutingSpec
from vllm_afd.wire.transports.gloo import GlooRecv

BF16 = torch.bfloat16
MAX_ROWS = 8
NUM_LAYERS = 3
ROUTING = RoutingSpec(8, torch.float32)
# Rows per attention rank in each stage, per step (8: the attention's max_rows); a step's rows differ from the last.
STEPS = [{0: [3, 8], 1: [1, 2], 2: [8, 5]}, {0: [2, 1], 1: [7, 8], 2: [1, 3]}, {0: [8, 8], 1: [4, 6], 2: [2, 2]}]
JOIN_S = 60.0


def rows(step: int, layer: int, stage: int, rank: int, num_rows: int, width: int = 64, dtype=BF16) -> torch.Tensor:
    """Rows that name their (step, layer, stage, attention rank), exactly representable in bf16."""
    base = 64 * step + 16 * layer + 4 * stage + rank
    return ((base + torch.arange(num_rows * width).reshape(num_rows, width)) % 251).to(dtype)


def counts_of(step: int, num_stages: int, num_attention: int) -> dict[int, list[int]]:
    return {stage: counts[:num_attention] for stage, counts in STEPS[step].items() if stage < num_stages}


def answer(hidden: torch.Tensor, layer: int) -> torch.Tensor:
    """The FFN's output of a batch (in bf16: doubling and adding a small integer stay exact)."""
    return hidden * 2 + layer


class Deployment:
    """1 FFN rank and ``num_attention`` attention ranks over gloo, paired and ready; ``close()`` when done."""

    def __init__(self, num_attention: int, num_stages: int, *, integrity: bool = False, routing: bool = False,
                 prepost: bool = True, reformable: bool = False) -> None:
        # startup_timeout_s: a receive that nothing answers ends within 20 s (the transfer bound), not a hang.
        spec = make_spec(free_port(), exchanges_per_stage=NUM_LAYERS, num_stages=num_stages, integrity=integrity,
                         router_logits_width=ROUTING.width if routing else None, startup_timeout_s=15.0)
        self.num_stages, self.routing = num_stages, ROUTING if routing else None
        self.ffn = make_connector(spec, make_placement("ffn", 0, num_attention, 1), integrity=integrity,
                                  reformable=reformable)
        self.attention = [make_connector(spec, make_placement("attention", k, num_attention, 1), integrity=integrity,
                                         max_rows=MAX_ROWS, reformable=reformable) for k in range(num_attention)]
        self.connectors = [self.ffn, *self.attention]
        init_all(self.connectors, timeout_s=JOIN_S)
        self.set_prepost(prepost)

    def set_prepost(self, prepost: bool) -> None:
        for connector in self.connectors:
            connector.transport.prepost_receives = prepost  # an instance attribute: this pairing's own transports

    def close(self) -> None:
        for connector in reversed(self.connectors):
            connector.close()


def in_thread(body: Any, *args: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``body(*args)`` in a daemon thread; its return value or exception lands in the returned dict."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = body(*args)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def joined(thread: threading.Thread, outcome: dict[str, Any], timeout_s: float = JOIN_S) -> Any:
    thread.join(timeout_s)
    assert not thread.is_alive(), f"not finished within {timeout_s:g} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def open_step(d: Deployment, counts: dict[int, list[int]]) -> None:
    """Publish ``counts`` on every attention rank while the FFN takes the payload (a control send waits for it)."""
    thread, outcome = in_thread(d.ffn.next_step)
    for connector in d.attention:
        connector.publish(counts)
    joined(thread, outcome)


def ffn_steps(d: Deployment, num_steps: int) -> list[dict[str, Any]]:
    """The FFN's half of ``num_steps`` steps: per step the batches received and, after each receive, the stage
    whose receives are posted ahead (None: nothing) and whether they really are posted (gloo handles)."""
    ffn, steps = d.ffn, []
    for _ in range(num_steps):
        payload = ffn.next_step()
        batches, ahead = [], []
        for layer in range(NUM_LAYERS):
            for stage in payload.stages:
                batch = ffn.recv_a2f(stage, d.routing)
                posted = ffn._posted_a2f
                ahead.append(None if posted is None else
                             (posted.stage, all(isinstance(h, GlooRecv) for _, m, s in posted.peers for h in m + s)))
                logits = None if batch.router_logits is None else batch.router_logits.clone()
                batches.append((batch.hidden_states.clone(), logits))
                ffn.send_f2a(stage, answer(batch.hidden_states, layer))
        ffn.wait_sends()
        steps.append({"batches": batches, "ahead": ahead, "posted": len(ffn.transport._posted)})
    return steps


def attention_step(d: Deployment, step: int) -> list[torch.Tensor]:
    """Every attention rank's half of one step, the stages interleaved as the stage threads do: each layer sends
    every stage, then receives every stage (into the tensor it sent). Returns the answers in receive order."""
    counts = counts_of(step, d.num_stages, len(d.attention))
    for connector in d.attention:
        connector.publish(counts)
    answers = []
    for layer in range(NUM_LAYERS):
        sent = {}
        for stage in counts:
            for k, connector in enumerate(d.attention):
                n = counts[stage][k]
                hidden = sent[stage, k] = rows(step, layer, stage, k, n)
                logits = None if d.routing is None else rows(step, layer, stage, k, n, ROUTING.width, torch.float32)
                connector.send_a2f(stage, hidden, logits)
        for stage in counts:
            for k, connector in enumerate(d.attention):
                answers.append(connector.recv_f2a(stage, sent[stage, k]).clone())
    return answers


def run_steps(d: Deployment, num_steps: int) -> tuple[list[dict[str, Any]], list[list[torch.Tensor]]]:
    thread, outcome = in_thread(ffn_steps, d, num_steps)
    answers = [attention_step(d, step) for step in range(num_steps)]
    return joined(thread, outcome), answers


def expected(num_steps: int, num_stages: int, num_attention: int, routing: bool) -> tuple[list, list]:
    """(the FFN's batches, the attention's answers) per step, in the order ``ffn_steps`` / ``attention_step`` list
    them."""
    batches, answers = [], []
    for step in range(num_steps):
        counts = counts_of(step, num_stages, num_attention)
        step_batches, step_answers = [], []
        for layer in range(NUM_LAYERS):
            for stage, per_rank in counts.items():
                hidden = torch.cat([rows(step, layer, stage, k, n) for k, n in enumerate(per_rank)])
                logits = (torch.cat([rows(step, layer, stage, k, n, ROUTING.width, torch.float32)
                                     for k, n in enumerate(per_rank)]) if routing else None)
                step_batches.append((hidden, logits))
            for stage, per_rank in counts.items():
                step_answers.extend(answer(rows(step, layer, stage, k, n), layer) for k, n in enumerate(per_rank))
        batches.append(step_batches)
        answers.append(step_answers)
    return batches, answers


def same(got: list, want: list) -> bool:
    """Nested lists/tuples of tensors (or None) equal bit for bit."""
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    if want is None:
        return got is None
    return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize(("num_attention", "num_stages", "integrity", "routing"), [
    (1, 2, False, False), (1, 3, True, True), (2, 2, True, False), (2, 3, False, True), (2, 3, True, True)])
def test_posted_ahead_or_not_every_end_gets_the_same_rows_and_nothing_stays_posted(num_attention, num_stages,
                                                                                    integrity, routing):
    d = Deployment(num_attention, num_stages, integrity=integrity, routing=routing)
    try:
        results = {}
        for prepost in (True, False, True):  # toggled between steps: posting ahead is each end's own business
            d.set_prepost(prepost)
            results.setdefault(prepost, []).append(run_steps(d, len(STEPS)))
        leftovers = [(len(c.transport._posted), getattr(c, "_posted_f2a", None)) for c in d.attention]
    finally:
        d.close()
    want_batches, want_answers = expected(len(STEPS), num_stages, num_attention, routing)

    for prepost, runs in results.items():
        for ffn_side, answers in runs:
            assert same([s["batches"] for s in ffn_side], want_batches), prepost
            assert same(answers, want_answers), prepost
    exchanges = NUM_LAYERS * num_stages
    order = [stage for _ in range(NUM_LAYERS) for stage in range(num_stages)]
    for ffn_side, _ in results[True]:
        for step in ffn_side:
            # Posted ahead after every exchange but the step's last (the next step's rows are not known yet), as gloo
            # receives, for the exchange that follows; after the step nothing is left in the transport.
            assert step["ahead"] == [(order[n + 1], True) for n in range(exchanges - 1)] + [None]
            assert step["posted"] == 0
    for ffn_side, _ in results[False]:
        assert all(step["ahead"] == [None] * exchanges for step in ffn_side)
    assert leftovers == [(0, {})] * num_attention


def test_receives_posted_ahead_with_two_peers_land_in_disjoint_slots_joined_by_one_copy():
    d = Deployment(2, 2, routing=True)
    try:
        open_step(d, {0: [3, 2], 1: [1, 1]})
        for k, connector in enumerate(d.attention):
            for stage, n in ((0, (3, 2)[k]), (1, 1)):
                connector.send_a2f(stage, rows(0, 0, stage, k, n), rows(0, 0, stage, k, n, 8, torch.float32))
        d.ffn.recv_a2f(0, ROUTING)
        posted = d.ffn._posted_a2f
        (_, first, _), (_, second, _) = posted.peers
        batch = d.ffn.recv_a2f(1, ROUTING)
    finally:
        d.close()

    assert posted.slots and posted.stage == 1 and posted.max_rows == MAX_ROWS
    # Peer 1's receive starts max_rows rows after peer 0's (a surplus of peer 0 cannot reach peer 1's rows) ...
    lane = posted.lanes[0]
    assert first[0].wait().data_ptr() == lane.data_ptr()
    assert second[0].wait().data_ptr() == lane[MAX_ROWS:].data_ptr()
    # ... and the batch handed out is the joined copy, the peers' rows back to back.
    assert batch.hidden_states.data_ptr() == posted.joined[0].data_ptr()
    assert torch.equal(batch.hidden_states, torch.cat([rows(0, 0, 1, 0, 1), rows(0, 0, 1, 1, 1)]))


@pytest.mark.parametrize(("stage", "routing"), [(0, None), (1, ROUTING)], ids=["other stage", "other routing"])
def test_a_receive_other_than_the_one_posted_ahead_is_the_lost_peer_error_at_once(stage, routing):
    d = Deployment(1, 2)
    try:
        open_step(d, {0: [2], 1: [3]})
        d.attention[0].send_a2f(0, rows(0, 0, 0, 0, 2))
        d.attention[0].send_a2f(1, rows(0, 0, 1, 0, 3))
        d.ffn.recv_a2f(0)  # posts stage 1 (routing None) ahead
        started = time.monotonic()
        with pytest.raises(AFDPeerLostError, match="the receives posted ahead expect stage 1, routing None") as raised:
            d.ffn.recv_a2f(stage, routing)
        elapsed = time.monotonic() - started
        failure = d.ffn.failure
        # The FFN's abort let go of its receives posted ahead too (stage 1's, filled and never waited), so its a2f
        # pair closed: the attention's next send, which no receive will take, fails at once, not at the transfer bound.
        d.attention[0].send_a2f(0, rows(0, 1, 0, 0, 2))
        started = time.monotonic()
        with pytest.raises(AFDPeerLostError, match="a2f send to ffn rank"):
            d.attention[0].recv_f2a(0, rows(0, 1, 0, 0, 2))
        noticed_s = time.monotonic() - started
    finally:
        started_close = time.monotonic()
        d.close()
        close_s = time.monotonic() - started_close

    assert elapsed < 1.0 and failure is raised.value
    assert noticed_s < 5.0, noticed_s
    assert close_s < 10.0, close_s


def test_a_step_cut_short_with_receives_posted_is_a_lost_peer_at_the_next_step_on_both_ends():
    d = Deployment(1, 2)
    try:
        open_step(d, {0: [2], 1: [3]})
        d.attention[0].send_a2f(0, rows(0, 0, 0, 0, 2))  # posts its answer's receive first
        d.ffn.recv_a2f(0)  # posts stage 1 ahead
        # Both ends leave the step here; neither waits for a peer to notice.
        started = time.monotonic()
        with pytest.raises(AFDPeerLostError, match="the receives of stage 1 still posted: the previous step ended "
                                                   "after 0 of its 6 exchanges"):
            joined(*in_thread(d.ffn.next_step), timeout_s=5.0)  # not the control receive: it waits unbounded
        with pytest.raises(AFDPeerLostError, match=r"the f2a receives of stages \[0\] still posted"):
            d.attention[0].publish({0: [1], 1: [1]})
        elapsed = time.monotonic() - started
    finally:
        d.close()

    assert elapsed < 1.0


def test_closing_with_receives_posted_is_bounded_and_drops_them():
    d = Deployment(2, 2)
    open_step(d, {0: [2, 1], 1: [3, 1]})
    for k, connector in enumerate(d.attention):
        connector.send_a2f(0, rows(0, 0, 0, k, (2, 1)[k]))
    d.ffn.recv_a2f(0)
    posted = [len(c.transport._posted) for c in d.connectors]
    transports = [c.transport for c in d.connectors]

    started = time.monotonic()
    d.close()
    elapsed = time.monotonic() - started

    assert posted == [2, 1, 1]  # the FFN: stage 1 from both peers; each attention rank: its stage 0 answer
    assert elapsed < 10.0, elapsed
    assert [len(t._posted) for t in transports] == [0, 0, 0]
    # A receive dropped by close() is an error when waited, never a receive that returns an unfilled buffer.
    (_, messages, _), _ = d.ffn._posted_a2f.peers
    with pytest.raises(RuntimeError, match="dropped by the transport's abort"):
        messages[0].wait()


def test_re_forming_with_receives_posted_pairs_again_and_the_next_steps_cross_intact():
    d = Deployment(1, 2, integrity=True, reformable=True)
    try:
        open_step(d, counts_of(0, 2, 1))
        d.attention[0].send_a2f(0, rows(0, 0, 0, 0, STEPS[0][0][0]))
        d.ffn.recv_a2f(0)
        old = [c.transport for c in d.connectors]
        assert [len(t._posted) for t in old] == [2, 2]  # data and seal: stage 1 on the FFN, stage 0 on the attention
        for connector in d.connectors:
            connector.fail(AFDPeerLostError("test: the pairing is lost mid-step"))

        started = time.monotonic()
        threads = [in_thread(connector.reform, 30.0) for connector in d.connectors]
        for thread, outcome in threads:
            joined(thread, outcome)
        reform_s = time.monotonic() - started
        ffn_side, answers = run_steps(d, 2)
    finally:
        d.close()
    want_batches, want_answers = expected(2, 2, 1, False)

    assert reform_s < 30.0, reform_s
    assert [len(t._posted) for t in old] == [0, 0]
    assert d.ffn._posted_a2f is None and d.ffn.reformations == 1
    assert same([s["batches"] for s in ffn_side], want_batches) and same(answers, want_answers)


def test_a_failed_wait_on_a_posted_receive_keeps_nothing_of_the_pairing_alive():
    d = Deployment(1, 1)
    port = d.ffn.spec.port
    open_step(d, {0: [2]})
    thread, outcome = in_thread(d.ffn.recv_a2f, 0)
    d.attention[0].close()  # the peer goes while the FFN waits on its posted receive
    thread.join(JOIN_S)
    error = outcome.get("error")  # kept, with its traceback, as the FFN loop keeps it while it re-forms
    d.ffn.close()

    # FFN rank 0's store is down once its connector let go: a re-formed pairing can host it on the same port.
    deadline, bound = time.monotonic() + 10.0, False
    while not bound and time.monotonic() < deadline:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore binds: TIME_WAIT is no owner
            try:
                probe.bind(("127.0.0.1", port))
                probe.listen()
                bound = True
            except OSError:
                time.sleep(0.1)
    assert isinstance(error, AFDPeerLostError) and error.__traceback__ is not None
    assert bound, f"port {port} still taken: something of the failed pairing keeps the store alive"
