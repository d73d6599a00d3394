"""The one AFD P2P protocol (AFD_SPEC.md §3.6, §4.3-4.5), parameterised by a transport backend.

``P2pProtocol`` owns everything both connectors share: rendezvous and handshake, the stage state set
by each control payload, the row checks that run before any byte is sent, the positional exchange
order (layer-major, stage-minor; hidden then router logits on ``a2e``, results on ``e2a``), the
control payload's length+bytes framing, the watchdog and the sticky failure. A ``P2pTransport`` only
moves contiguous tensors between ranks of three channels; gloo and NCCL differ only there.

This module keeps the lifecycle, the control plane and the failure handling; the stage state lives in
steps.py, the row checks and the exchange order in exchange.py, and the vLLM-facing connector that
wraps a protocol in p2p.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from vllm_afd.connectors.base import AFDControlPlane
from vllm_afd.connectors.channels import CONTROL, ChannelPlan, P2pSettings, P2pTransport
from vllm_afd.connectors.exchange import P2pExchange
from vllm_afd.connectors.metadata import (
    AFDA2FTransferPayload,
    AFDControlPayload,
    AFDExpertRoutingSpec,
    AFDTransferContext,
)
from vllm_afd.connectors.rendezvous import Rendezvous, RendezvousSpec
from vllm_afd.connectors.steps import StepState
from vllm_afd.connectors.watchdog import STARTUP_DONE_KEY, FailureLatch, Watchdog, WatchdogSpec, terminate_process
from vllm_afd.errors import AFDPeerLostError, AFDProtocolError
from vllm_afd.handshake import Fingerprint
from vllm_afd.topology import afd_rank, attention_block

__all__ = ["P2pProtocol"]

# A control body longer than this is garbage, not a payload (a real one is well under 1 KiB per stage).
MAX_CONTROL_BYTES = 1 << 20
# How long close() waits in total (watchdog thread, then the transport letting go), and for the watchdog.
CLOSE_JOIN_S = 5.0
WATCHDOG_JOIN_S = 1.0


class P2pProtocol(AFDControlPlane):
    """One rank's side of the AFD protocol; see the module docstring."""

    def __init__(
        self,
        settings: P2pSettings,
        transport: P2pTransport,
        fingerprint: Callable[[], Fingerprint],
        *,
        terminate: Callable[[BaseException], None] | None = terminate_process,
    ) -> None:
        self.settings = settings
        self.transport = transport
        self._fingerprint = fingerprint
        self.plan = ChannelPlan.for_rank(
            settings.role, settings.role_rank, settings.num_attention_ranks, settings.num_ffn_ranks
        )
        self._latch = FailureLatch(transport.abort, terminate)
        self._lock = threading.Lock()
        self._initialized = False
        self._initializing = False
        self._closed = False
        self._store: Any = None
        self._watchdog: Watchdog | None = None
        self.fingerprints: dict[tuple[str, int], Fingerprint] = {}
        self.attention_tp = 1
        self.steps = StepState(settings)
        self._startup_flagged = False
        self.exchange = P2pExchange(settings, self.plan, transport, self.steps)

    # ---- lifecycle ------------------------------------------------------------------------------

    @property
    def is_initialized(self) -> bool:
        return self._initialized and not self._closed and self._latch.failure is None

    def init(self) -> None:
        """§3.6 steps 2-6; idempotent. Any failure releases what was taken and re-raises.

        ``close()`` from another thread cancels a running init (the rendezvous polls for it) and never
        waits for it: the lock only guards the state flags.
        """
        s = self.settings
        with self._lock:
            if self._initialized:
                return
            if self._closed:
                raise RuntimeError(
                    f"{s.connector_name}: init_afd_connector() after close(); expected a fresh connector. "
                    "A store serves one AFD run: restart both roles"
                )
            if self._initializing:
                raise RuntimeError(
                    f"{s.connector_name}: init_afd_connector() is already running on another thread; expected "
                    "one initialising caller. Call it once per connector"
                )
            self._initializing = True
        rendezvous = Rendezvous(
            RendezvousSpec(s.host, s.port, s.role, s.role_rank, s.num_attention_ranks, s.num_ffn_ranks,
                           s.rendezvous_timeout_s),
            cancelled=lambda: self._closed,
        )
        try:
            self._store = rendezvous.connect()
            # NOTE: the watchdog's own connection is opened before the fingerprints are published: a new
            # TCPStore connection can stall for seconds, and a stall here delays every rank alike
            # instead of making this rank look silent to peers that already heartbeat.
            watchdog_store = rendezvous.connect_client()
            rendezvous.claim()
            self.fingerprints = rendezvous.exchange_fingerprints(self._fingerprint())
            self.attention_tp = self.fingerprints[("attention", 0)].tp_size
            self._watchdog = Watchdog(watchdog_store, self._watchdog_spec(), self._latch)
            self._watchdog.start()
            try:
                self.transport.open(self._store, self.plan, max(rendezvous.remaining_s(), 0.1))
            except RuntimeError as exc:
                if rendezvous.remaining_s() < 0.5:  # group creation ran into the deadline
                    raise rendezvous.timeout_error("creating the data and control channels") from exc
                raise
            self._latch.check()  # a peer lost while the channels were built
            with self._lock:
                if self._closed:
                    raise RuntimeError(f"{s.connector_name}: close() was called during init_afd_connector()")
                self._initialized = True
        except BaseException:
            self._latch.close()  # the caller gets this exception: no termination fallback
            self._release()
            raise
        finally:
            self._initializing = False

    def close(self) -> None:
        """Idempotent; safe uninitialised, during and after a partial init; bounded by CLOSE_JOIN_S."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._latch.close()
        self._release()

    def _release(self) -> None:
        started = time.monotonic()
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.stop(WATCHDOG_JOIN_S)
        closer = threading.Thread(target=self.transport.close, name="afd-close", daemon=True)
        closer.start()
        closer.join(max(0.0, CLOSE_JOIN_S - (time.monotonic() - started)))
        # NOTE: dropping the last reference stops FFN rank 0's store server; peers notice at once.
        self._store = None

    def check_failed(self) -> None:
        self._latch.check()

    @property
    def failure(self) -> BaseException | None:
        return self._latch.failure

    # ---- control plane --------------------------------------------------------------------------

    def update_state_from_dp_metadata(self, payload: AFDControlPayload) -> None:
        self._require_ready("update_state_from_dp_metadata")
        s = self.settings
        self.steps.adopt(payload, self.attention_tp)
        if s.use_graph_buffers and s.role == "ffn":
            self.exchange.preallocate_buffers()
        watchdog = self._watchdog
        if watchdog is None:  # closed concurrently
            return
        # NOTE: a FULL-graph replay runs the exchanges inside the attention's graph: nothing to count.
        if s.exchanges_per_stage is not None and not (s.role == "attention" and payload.is_graph_replaying):
            watchdog.step_opened(payload.step_seq)
        else:
            watchdog.step_closed()

    def send_dp_metadata_list(self, payload: AFDControlPayload) -> None:
        self._require_ready("send_dp_metadata_list")
        s = self.settings
        if s.role != "attention" or s.role_rank >= s.num_ffn_ranks:
            return  # §3.3: only attention ranks < F transmit
        body = payload.encode()
        device = self.transport.control_device
        length = torch.tensor([len(body)], dtype=torch.int64).to(device)
        data = torch.frombuffer(bytearray(body), dtype=torch.uint8).to(device)
        dst = afd_rank("ffn", s.role_rank, s.num_ffn_ranks)
        self._transfer(lambda: self.transport.send(CONTROL, length, dst), "control send to ffn", s.role_rank)
        self._transfer(lambda: self.transport.send(CONTROL, data, dst), "control send to ffn", s.role_rank)

    def recv_dp_metadata_list(self) -> AFDControlPayload:
        self._require_ready("recv_dp_metadata_list")
        s = self.settings
        if s.role != "ffn" or self.plan.control_rank is None:
            raise RuntimeError(
                f"{s.connector_name}: recv_dp_metadata_list on {s.role} rank {s.role_rank}, which has no "
                "AFD control group to receive from; expected an FFN rank. Only FFN ranks receive payloads"
            )
        if self._watchdog is not None:
            self._watchdog.step_closed()  # the previous step ended when the FFN came back for more
        device = self.transport.control_device
        src = afd_rank("attention", s.role_rank, s.num_ffn_ranks)
        length = torch.empty(1, dtype=torch.int64, device=device)
        first = self._transfer(lambda: self.transport.recv(CONTROL, length, src), "control receive from attention",
                               s.role_rank, timed=False)
        num_bytes = int(length.item())
        self._require_ready("recv_dp_metadata_list")  # an abort may have left garbage behind
        if not 0 < num_bytes <= MAX_CONTROL_BYTES:
            raise AFDProtocolError(
                f"{s.connector_name}: control payload length {num_bytes} from attention rank {s.role_rank} "
                f"is not in 1..{MAX_CONTROL_BYTES}; expected the int64 byte length of §4.3. Run the same "
                "vllm_afd version on both roles"
            )
        data = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        second = self._transfer(lambda: self.transport.recv(CONTROL, data, src), "control receive from attention",
                                s.role_rank, timed=False)
        if first != second:
            raise RuntimeError(
                f"received AFD DP metadata fragments from different ranks (length from {first}, body from "
                f"{second}); expected both from attention rank {s.role_rank}"
            )
        return AFDControlPayload.decode(data.cpu().numpy().tobytes())

    def send_dp_metadata(self, stages: Mapping[int, Any], **flags: bool) -> AFDControlPayload:
        """§5.3: build the payload (a count list, AFDDPMetadata or vLLM DPMetadata per stage), update, send."""
        self._require_ready("send_dp_metadata")
        payload = self.steps.new_payload(stages, **flags)
        self.update_state_from_dp_metadata(payload)
        self.send_dp_metadata_list(payload)
        return payload

    def mark_startup_done(self) -> None:
        self._require_ready("mark_startup_done")
        if self.settings.role == "attention" and not self._startup_flagged:
            self._startup_flagged = True
            self._store.add(STARTUP_DONE_KEY, 1)

    def mark_step_done(self) -> None:
        if self._watchdog is not None:
            self._watchdog.step_closed()

    # ---- data plane (exchange.py) ---------------------------------------------------------------

    def send_attn_output(
        self, hidden: torch.Tensor, context: AFDTransferContext, router_logits: torch.Tensor | None = None
    ) -> None:
        self._require_ready("send_attn_output", "attention")
        self.exchange.send_attn_output(self._transfer, hidden, context, router_logits)

    def recv_ffn_output(self, ref_tensor: torch.Tensor, ubatch_idx: int = 0) -> torch.Tensor:
        self._require_ready("recv_ffn_output", "attention")
        out = self.exchange.recv_ffn_output(self._transfer, ref_tensor, ubatch_idx)
        self._count_exchange()
        return out

    def recv_attn_output(
        self, ubatch_idx: int = 0, routing_spec: AFDExpertRoutingSpec | None = None
    ) -> AFDA2FTransferPayload:
        self._require_ready("recv_attn_output", "ffn")
        return self.exchange.recv_attn_output(self._transfer, ubatch_idx, routing_spec)

    def send_ffn_output(self, output: torch.Tensor, context: AFDTransferContext) -> None:
        self._require_ready("send_ffn_output", "ffn")
        self.exchange.send_ffn_output(self._transfer, output, context)
        self._count_exchange()

    # ---- helpers --------------------------------------------------------------------------------

    def _require_ready(self, what: str, role: str | None = None) -> None:
        self._latch.check()
        s = self.settings
        if not self._initialized or self._closed:
            state = "closed" if self._closed else "not initialized"
            raise RuntimeError(
                f"{s.connector_name}.{what}: P2P connector is {state}; expected an initialised connector. "
                "Call init_afd_connector() first (a closed connector cannot be reused)"
            )
        if role is not None and s.role != role:
            raise RuntimeError(
                f"{s.connector_name}.{what} is a {role}-side call, but this is {s.role} rank {s.role_rank}; "
                "expected the matching role's method"
            )

    def _count_exchange(self) -> None:
        if self.steps.count_exchange():
            self.mark_step_done()

    def _transfer(self, call: Callable[[], Any], label: str, peer: int, *, timed: bool = True) -> Any:
        """One transport call; a transport error becomes the sticky AFDPeerLostError."""
        watchdog = self._watchdog
        if timed and watchdog is not None:
            watchdog.transfer_started()
        try:
            return call()
        except RuntimeError as exc:
            raise self._transport_failure(exc, f"{label} rank {peer}") from exc
        finally:
            if timed and watchdog is not None:
                watchdog.transfer_finished()

    def _transport_failure(self, exc: RuntimeError, what: str) -> BaseException:
        if self._closed:
            return RuntimeError(f"{self.settings.connector_name}: {what} interrupted by close() ({exc})")
        s = self.settings
        lost = AFDPeerLostError(
            f"AFD peer lost: {what} failed on {s.role} rank {s.role_rank} ({exc}); the peer process "
            "died or closed its connections. Check the other role's log, then restart both roles"
        )
        return self._latch.fail(lost, observed=True)

    def _watchdog_spec(self) -> WatchdogSpec:
        s = self.settings
        if s.role == "attention":
            data_ffn = self.plan.subgroup
            peers = [("ffn", data_ffn)] + ([("ffn", s.role_rank)] if s.role_rank < s.num_ffn_ranks else [])
            label = f"ffn peer rank {data_ffn}"
        else:
            block = list(attention_block(s.role_rank, s.num_attention_ranks, s.num_ffn_ranks))
            peers = [("attention", j) for j in block] + [("attention", s.role_rank)]
            label = f"attention peer ranks [{' '.join(map(str, block))}]"
        return WatchdogSpec(
            role=s.role,
            role_rank=s.role_rank,
            peers=tuple(dict.fromkeys(peers)),
            num_attention_ranks=s.num_attention_ranks,
            peer_timeout_s=s.peer_timeout_s,
            step_timeout_s=s.step_timeout_s,
            address=f"{s.host}:{s.port}",
            step_peer_label=label,
        )

