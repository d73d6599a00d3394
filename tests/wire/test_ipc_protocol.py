"""The IPC transport's flag protocol under every interleaving (docs/protocol.md#transports).

A hypothesis state machine drives one FFN and two attention ranks (gate on attention: two a2f messages
per exchange) through real ``IpcTransport``s on the simulated device of ``_ipc_sim``: the hosts
enqueue whole exchanges whenever they like (a host never waits for its device), the device runs any
stream's ready ops in any order, and either side may abort. Checked in stream order, as the model's
kernels would read the data: every message arrives exactly as sent, none is lost or overwritten by the
next one; with matched traffic every stream runs dry (no deadlock) and leaves every flag EMPTY; after
an abort, the aborted rank's stream never stays blocked, and once every rank aborted (as their
watchdogs do) every stream runs dry. With ``NUM_STAGES`` k > 1 (docs/pingpong.md) each attention
host enqueues in the stage baton's order: the sends of k exchanges are in flight before the first
result is received (exchange n's send follows the receive of n - k, the same stage one layer
earlier), which the slots per (stage, position) must carry without a loss.
"""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from torch.distributed import HashStore

from tests.wire._ipc_sim import EXPERTS, HIDDEN, FakeDriver, SimDevice, make_transport, open_all
from vllm_afd.wire.placement import A2F, F2A, Placement
from vllm_afd.wire.transports.slots import ABORT, EMPTY, FULL

MAX_ROWS = 3
MAX_EXCHANGES = 6
PEERS = (1, 2)  # the attention ranks' group ranks; AFD/transport index = group rank here


def rows_of(peer: int, exchange: int) -> int:
    return 1 + (peer + exchange) % MAX_ROWS


def hidden_of(peer: int, exchange: int) -> torch.Tensor:
    rows = rows_of(peer, exchange)
    return (torch.arange(rows * HIDDEN, dtype=torch.float32) + 100 * peer + 7 * exchange).view(rows, HIDDEN)


def logits_of(peer: int, exchange: int) -> torch.Tensor:
    return torch.full((rows_of(peer, exchange), EXPERTS), float(peer + exchange))


def respond(hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The FFN's "MoE block": exact in float32 for these small integers."""
    return hidden * 2 + logits.sum(dim=-1, keepdim=True)


class IpcProtocolMachine(RuleBasedStateMachine):
    NUM_STAGES = 1  # the transports' num_stages and how many exchanges an attention host keeps in flight

    def __init__(self) -> None:
        super().__init__()
        self.sim = SimDevice()
        self.drivers = [FakeDriver(self.sim, pid=300 + i) for i in range(3)]
        # NOTE: the abort holder's own thread is slowed down; the simulated device re-arms the flags
        # itself (release_waits) whenever every stream is blocked, deterministically.
        self.transports = [make_transport(d, max_rows=MAX_ROWS, hold_period_s=3600.0, num_stages=self.NUM_STAGES)
                           for d in self.drivers]
        placements = [Placement("ffn", 0, 2, 1)] + [Placement("attention", j, 2, 1, dp_size=2) for j in range(2)]
        assert open_all(self.transports, placements, HashStore()) == [None, None, None]
        self.enqueued = [0, 0, 0]  # exchanges each host enqueued: FFN, attention group ranks 1 and 2
        self.checked: Counter[tuple[str, int]] = Counter()
        self.aborted: set[int] = set()
        self.alive: list[torch.Tensor] = []  # whatever the simulated device may still touch
        self.ffn_in = {p: (torch.zeros(MAX_ROWS, HIDDEN), torch.zeros(MAX_ROWS, EXPERTS)) for p in PEERS}
        self.ffn_out = {p: torch.zeros(MAX_ROWS, HIDDEN) for p in PEERS}  # persistent, as graph buffers are
        # Per attention peer: exchange -> (the tensor sent, the result expected in it), sent but not received.
        self.in_flight: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {p: {} for p in PEERS}

    def _on_device(self, rank: int, call) -> None:
        self.sim.streams[self.drivers[rank].stream].append(call)

    def _check(self, who: tuple[str, int], got: torch.Tensor, expected: torch.Tensor) -> None:
        if self.aborted:
            return  # after an abort the data is garbage by design
        assert torch.equal(got, expected), f"{who}: a message was lost or overwritten"
        self.checked[who] += 1

    # ---- hosts ----------------------------------------------------------------------------------

    @precondition(lambda self: not self.aborted)
    @rule(peer=st.sampled_from(PEERS))
    def attention_enqueues_an_exchange(self, peer: int) -> None:
        exchange, transport = self.enqueued[peer], self.transports[peer]
        if exchange >= self.NUM_STAGES:  # the baton: this stage's previous layer is received first
            self._attention_receives(peer, exchange - self.NUM_STAGES)
        hidden, logits = hidden_of(peer, exchange), logits_of(peer, exchange)
        transport.isend(A2F, hidden, 0).wait()  # IPC sends are stream work: the handle is complete at once
        transport.isend(A2F, logits, 0).wait()
        self.in_flight[peer][exchange] = (hidden, respond(hidden, logits))
        self.alive += [hidden, logits]
        self.enqueued[peer] += 1

    def _attention_receives(self, peer: int, exchange: int) -> None:
        hidden, expected = self.in_flight[peer].pop(exchange)
        self.transports[peer].recv(F2A, hidden, 0)  # into the tensor just sent, as the proxy does
        self._on_device(peer, lambda: self._check(("attention", peer), hidden, expected))

    @precondition(lambda self: not self.aborted)
    @rule()
    def ffn_enqueues_an_exchange(self) -> None:
        exchange, transport = self.enqueued[0], self.transports[0]
        for peer in PEERS:
            rows = rows_of(peer, exchange)
            hidden, logits = (buffer[:rows] for buffer in self.ffn_in[peer])
            transport.recv(A2F, hidden, peer)
            transport.recv(A2F, logits, peer)
            self._on_device(0, lambda p=peer, h=hidden: self._check(("ffn", p), h, hidden_of(p, exchange)))
            self._on_device(0, lambda p=peer, h=hidden, g=logits, r=rows: self.ffn_out[p][:r].copy_(respond(h, g)))
        for peer in PEERS:
            transport.send(F2A, self.ffn_out[peer][:rows_of(peer, exchange)], peer)
        self.enqueued[0] += 1

    # ---- device and failures --------------------------------------------------------------------

    @rule(rank=st.integers(0, 2), steps=st.integers(1, 12))
    def device_runs_a_stream(self, rank: int, steps: int) -> None:
        stream = self.drivers[rank].stream
        for _ in range(steps):
            if not self.sim.ready(stream):
                break
            self.sim.step(stream)

    @precondition(lambda self: len(self.aborted) < 3)
    @rule(rank=st.integers(0, 2))
    def a_rank_aborts(self, rank: int) -> None:
        transport = self.transports[rank]
        transport.abort()
        self.aborted.add(rank)

        self.sim.drain(release=[self.transports[r].release_waits for r in self.aborted])

        assert not self.sim.streams[self.drivers[rank].stream], "abort left one of this rank's waits pending"

    @invariant()
    def flags_hold_protocol_values(self) -> None:
        flags = self.transports[0]._flags
        if flags is not None:
            assert {flags.read(i) for i in range(0, 6 * self.NUM_STAGES * 16, 16)} <= {EMPTY, FULL, ABORT}

    def teardown(self) -> None:
        try:
            if not self.aborted:
                while self.enqueued[0] < max(self.enqueued[1:]):
                    self.ffn_enqueues_an_exchange()
                for peer in PEERS:
                    while self.enqueued[peer] < self.enqueued[0]:
                        self.attention_enqueues_an_exchange(peer)
                    for exchange in sorted(self.in_flight[peer]):  # the step's last layer, every stage
                        self._attention_receives(peer, exchange)
                assert self.sim.drain(), "matched exchanges deadlocked"
                assert all(self.checked[("attention", p)] == self.checked[("ffn", p)] == self.enqueued[0]
                           for p in PEERS), (self.checked, self.enqueued)
                flags = self.transports[0]._flags
                assert all(flags.read(i) == EMPTY
                           for i in range(0, 6 * self.NUM_STAGES * 16, 16)), "a step must end with flags EMPTY"
            else:
                for transport in self.transports:  # every watchdog fires in the end
                    transport.abort()
                assert self.sim.drain(release=[t.release_waits for t in self.transports]), "an abort left a wait"
        finally:
            for transport in self.transports:
                transport.close()


IpcProtocolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_ipc_flag_protocol = IpcProtocolMachine.TestCase


class IpcTwoStagesMachine(IpcProtocolMachine):
    NUM_STAGES = 2


class IpcThreeStagesMachine(IpcProtocolMachine):
    NUM_STAGES = 3


for _machine in (IpcTwoStagesMachine, IpcThreeStagesMachine):
    _machine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
test_ipc_flag_protocol_two_stages = IpcTwoStagesMachine.TestCase
test_ipc_flag_protocol_three_stages = IpcThreeStagesMachine.TestCase
