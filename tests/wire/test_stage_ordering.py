"""Why k micro-batch stages cannot deadlock over a rendezvous transport (docs/pingpong.md#5).

Model: both transports are *rendezvous* for sends (gloo's TCP pair sends once the peer posted its
receive; an NCCL send kernel waits for the receiver's buffer). A transfer is posted by each side;
a send completes once its receive is posted, a receive once its send is posted. Each role is a
program of posts (never block) and waits (block until their transfer matched), exactly as
``AFDConnector`` issues them:

* attention (one baton handed round-robin over k stage threads, so one sequential program in
  (layer, stage) order): stage j sends a2f(l, j) and yields; when the baton comes back it waits
  that send, receives f2a(l, j), computes layer l+1 and sends a2f(l+1, j);
* FFN (layer-major, stage-minor): receives a2f(l, j), computes, sends f2a(l, j); every send waited
  at the end of the step.

A hypothesis state machine advances the two roles in any interleaving, over several steps of
random stage counts, layer counts and messages per exchange (1, or 2 with router logits), and
checks the claim: whenever neither role can move, both have finished. The blocking-send variant
(each send waited where it is issued, as before the stages) is the counter-example: with 2 or 3
stages every interleaving reaches a state where both roles wait forever.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

A2F, F2A = "a2f", "f2a"
ATTENTION, FFN = "attention", "ffn"


@dataclass(frozen=True)
class Op:
    """One transport action of a role: ``post`` a send or receive, or ``wait`` for one posted earlier."""

    kind: str  # "post" | "wait"
    direction: str  # "send" | "recv"
    channel: str
    index: int  # the transfer's position on its channel (positional protocol: no tags)


class Wire:
    """Posted transfers per (channel, direction); transfer n matches once both sides posted their n-th."""

    def __init__(self) -> None:
        self.posted = {(channel, direction): 0 for channel in (A2F, F2A) for direction in ("send", "recv")}

    def post(self, direction: str, channel: str) -> int:
        index = self.posted[(channel, direction)]
        self.posted[(channel, direction)] += 1
        return index

    def matched(self, direction: str, channel: str, index: int) -> bool:
        other = "recv" if direction == "send" else "send"
        return self.posted[(channel, other)] > index


class Program:
    """A role's ops, built as the connector issues them; indices count per channel and direction."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.counts = {(channel, direction): 0 for channel in (A2F, F2A) for direction in ("send", "recv")}

    def post(self, direction: str, channel: str) -> Op:
        op = Op("post", direction, channel, self.counts[(channel, direction)])
        self.counts[(channel, direction)] += 1
        self.ops.append(op)
        return op

    def wait(self, posted: Op) -> None:
        self.ops.append(Op("wait", posted.direction, posted.channel, posted.index))


def attention_program(steps: list[tuple[int, int]], messages: int, blocking_sends: bool) -> list[Op]:
    """Per step (stages k, layers L): the baton's order send(0, 0..k-1), then recv(l, j) + send(l+1, j)."""
    program = Program()
    for num_stages, num_layers in steps:
        pending: dict[int, list[Op]] = {}

        def send(stage: int, pending: dict = pending) -> None:
            sends = [program.post("send", A2F) for _ in range(messages)]
            if blocking_sends:
                for op in sends:
                    program.wait(op)
            else:
                pending[stage] = sends

        def recv(stage: int, pending: dict = pending) -> None:
            for op in pending.pop(stage, []):  # AFDConnector.recv_f2a waits the stage's pending send first
                program.wait(op)
            program.wait(program.post("recv", F2A))

        for stage in range(num_stages):
            send(stage)
        for _layer in range(1, num_layers):
            for stage in range(num_stages):
                recv(stage)
                send(stage)
        for stage in range(num_stages):
            recv(stage)
    return program.ops


def ffn_program(steps: list[tuple[int, int]], messages: int, blocking_sends: bool) -> list[Op]:
    """Per step: layer-major, stage-minor receive, compute, send; pending sends waited at the end."""
    program = Program()
    for num_stages, num_layers in steps:
        pending: list[Op] = []
        for _layer in range(num_layers):
            for _stage in range(num_stages):
                for _ in range(messages):
                    program.wait(program.post("recv", A2F))
                send = program.post("send", F2A)
                if blocking_sends:
                    program.wait(send)
                else:
                    pending.append(send)
        for op in pending:  # AFDConnector.wait_sends at the end of ffn/runner.py:_forward
            program.wait(op)
    return program.ops


class Run:
    """Two programs over one wire; ``advance`` executes a role's next op if it can."""

    def __init__(self, programs: dict[str, list[Op]]) -> None:
        self.programs = programs
        self.pc = {role: 0 for role in programs}
        self.wire = Wire()

    def done(self, role: str) -> bool:
        return self.pc[role] == len(self.programs[role])

    def can_advance(self, role: str) -> bool:
        if self.done(role):
            return False
        op = self.programs[role][self.pc[role]]
        return op.kind == "post" or self.wire.matched(op.direction, op.channel, op.index)

    def advance(self, role: str) -> None:
        op = self.programs[role][self.pc[role]]
        if op.kind == "post":
            assert self.wire.post(op.direction, op.channel) == op.index, "posts left issue order"
        self.pc[role] += 1

    def stuck(self) -> bool:
        return not any(self.can_advance(role) for role in self.programs)


step_shapes = st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3)), min_size=1, max_size=3)


class StageOrderingMachine(RuleBasedStateMachine):
    """Any interleaving of the two roles' programs with asynchronous sends never deadlocks."""

    @initialize(steps=step_shapes, messages=st.sampled_from([1, 2]))
    def deploy(self, steps: list[tuple[int, int]], messages: int) -> None:
        self.run = Run({ATTENTION: attention_program(steps, messages, blocking_sends=False),
                        FFN: ffn_program(steps, messages, blocking_sends=False)})

    @precondition(lambda self: self.run.can_advance(ATTENTION))
    @rule()
    def attention_moves(self) -> None:
        self.run.advance(ATTENTION)

    @precondition(lambda self: self.run.can_advance(FFN))
    @rule()
    def ffn_moves(self) -> None:
        self.run.advance(FFN)

    @precondition(lambda self: self.run.done(ATTENTION) and self.run.done(FFN))
    @rule()
    def both_finished(self) -> None:
        pass  # hypothesis needs a rule to take once the programs ran out

    @invariant()
    def stuck_only_when_finished(self) -> None:
        if self.run.stuck():
            assert self.run.done(ATTENTION) and self.run.done(FFN), (
                f"deadlock: attention at op {self.run.pc[ATTENTION]}, ffn at op {self.run.pc[FFN]}")

    def teardown(self) -> None:
        while not self.run.stuck():
            self.run.advance(ATTENTION if self.run.can_advance(ATTENTION) else FFN)
        assert self.run.done(ATTENTION) and self.run.done(FFN)
        assert self.run.wire.posted[(A2F, "send")] == self.run.wire.posted[(A2F, "recv")]
        assert self.run.wire.posted[(F2A, "send")] == self.run.wire.posted[(F2A, "recv")]


StageOrderingMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=120, deadline=None)
TestStageOrdering = StageOrderingMachine.TestCase


def reachable_deadlocks(programs: dict[str, list[Op]]) -> int:
    """Every interleaving, exhaustively (a state is the two program counters): how many stuck unfinished."""
    seen, frontier, deadlocks = set(), [(0, 0)], 0
    while frontier:
        state = frontier.pop()
        if state in seen:
            continue
        seen.add(state)
        run = Run(programs)
        for role, pc in zip((ATTENTION, FFN), state):  # replay the ops up to the state: posts are idempotent counts
            for _ in range(pc):
                run.advance(role)
        if run.stuck():
            deadlocks += not (run.done(ATTENTION) and run.done(FFN))
        for role in (ATTENTION, FFN):
            if run.can_advance(role):
                frontier.append((state[0] + (role == ATTENTION), state[1] + (role == FFN)))
    return deadlocks


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_asynchronous_sends_reach_no_deadlock_in_any_interleaving(num_stages):
    steps = [(num_stages, 3), (1, 2)]
    programs = {ATTENTION: attention_program(steps, 2, blocking_sends=False),
                FFN: ffn_program(steps, 2, blocking_sends=False)}

    assert reachable_deadlocks(programs) == 0


@pytest.mark.parametrize("num_stages", [2, 3])
def test_blocking_sends_on_the_attention_deadlock_with_more_than_one_stage(num_stages):
    steps = [(num_stages, 2)]
    programs = {ATTENTION: attention_program(steps, 1, blocking_sends=True),
                FFN: ffn_program(steps, 1, blocking_sends=True)}

    assert reachable_deadlocks(programs) > 0
    run = Run(programs)
    while not run.stuck():  # any order: the deadlock is certain, not a bad interleaving
        run.advance(ATTENTION if run.can_advance(ATTENTION) else FFN)
    assert not run.done(ATTENTION)
    assert programs[ATTENTION][run.pc[ATTENTION]] == Op("wait", "send", A2F, 1)  # a2f(0, 1) waits...
    assert programs[FFN][run.pc[FFN]] == Op("wait", "send", F2A, 0)  # ...for the FFN, blocked in f2a(0, 0)


def test_blocking_sends_are_fine_with_one_stage():
    programs = {ATTENTION: attention_program([(1, 3)], 2, blocking_sends=True),
                FFN: ffn_program([(1, 3)], 2, blocking_sends=True)}

    assert reachable_deadlocks(programs) == 0
