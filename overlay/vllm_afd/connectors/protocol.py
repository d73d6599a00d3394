"""The one AFD P2P protocol (AFD_SPEC.md §3.6, §4.3-4.5), parameterised by a transport backend.

``P2pProtocol`` owns everything both connectors share: rendezvous and handshake, the stage state set
by each control payload, the row checks that run before any byte is sent, the positional exchange
order (layer-major, stage-minor; hidden then router logits on ``a2e``, results on ``e2a``), the
control payload's length+bytes framing, the watchdog and the sticky failure. A ``P2pTransport`` only
moves contiguous tensors between ranks of three channels; gloo and NCCL differ only there.
"""

from __future__ import annotations

import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_afd.connectors.base import AFDConnectorBase, AFDControlPlane
from vllm_afd.connectors.channels import A2E, CONTROL, E2A, ChannelPlan, P2pSettings, P2pTransport
from vllm_afd.connectors.metadata import (
    AFDA2FTransferPayload,
    AFDControlPayload,
    AFDDPMetadata,
    AFDExpertRoutingSpec,
    AFDTransferContext,
    AFDTransferMetadata,
)
from vllm_afd.connectors.rendezvous import Rendezvous, RendezvousSpec
from vllm_afd.connectors.watchdog import STARTUP_DONE_KEY, FailureLatch, Watchdog, WatchdogSpec, terminate_process
from vllm_afd.errors import AFDPeerLostError, AFDProtocolError
from vllm_afd.handshake import Fingerprint
from vllm_afd.topology import afd_rank, attention_block, expand_dp_counts, rows

__all__ = ["P2pAFDConnector", "P2pProtocol"]

# A control body longer than this is garbage, not a payload (a real one is well under 1 KiB per stage).
MAX_CONTROL_BYTES = 1 << 20
# How long close() waits in total (watchdog thread, then the transport letting go), and for the watchdog.
CLOSE_JOIN_S = 5.0
WATCHDOG_JOIN_S = 1.0


@dataclass(frozen=True, slots=True)
class _Stage:
    # [A] published rows per attention rank (TP-expanded, before the >= 1 clamp).
    counts: tuple[int, ...]
    # Attention: rows this rank sends. FFN: rows it receives in total.
    own_rows: int
    # FFN: rows per peer in subgroup order; empty on attention ranks.
    peer_rows: tuple[int, ...]


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
        self.payload: AFDControlPayload | None = None
        self._stages: dict[int, _Stage] = {}
        self._num_exchanges = 0
        self._next_step_seq = 0
        self._startup_flagged = False
        self._routing_specs: set[tuple[int, torch.dtype]] = set()
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

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
        num_dp = s.num_attention_ranks // self.attention_tp
        stages: dict[int, _Stage] = {}
        for stage_idx, metadata in payload.dp_metadata_list.items():
            counts_dp = metadata.num_tokens_across_dp_cpu
            if len(counts_dp) != num_dp:
                raise AFDProtocolError(
                    f"{s.connector_name}: control payload stage {stage_idx} has {len(counts_dp)} DP "
                    f"counts {list(counts_dp)}; expected one per attention DP rank ({num_dp} = "
                    f"{s.num_attention_ranks} ranks / TP {self.attention_tp}). Publish "
                    "num_tokens_across_dp for every attention DP rank"
                )
            counts = tuple(expand_dp_counts(counts_dp, self.attention_tp))
            if s.role == "attention":
                stages[stage_idx] = _Stage(counts, rows(counts[s.role_rank]), ())
            else:
                block = attention_block(s.role_rank, s.num_attention_ranks, s.num_ffn_ranks)
                peer_rows = tuple(rows(counts[j]) for j in block)
                stages[stage_idx] = _Stage(counts, sum(peer_rows), peer_rows)
        self.payload, self._stages, self._num_exchanges = payload, stages, 0
        if s.use_graph_buffers and s.role == "ffn":
            self._preallocate_buffers()
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
        converted = {
            stage: AFDDPMetadata(tuple(value)) if isinstance(value, Sequence) else value
            for stage, value in stages.items()
        }
        payload = AFDControlPayload(converted, **flags, step_seq=self._next_step_seq)
        self._next_step_seq += 1
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

    # ---- data plane: attention ------------------------------------------------------------------

    def send_attn_output(
        self, hidden: torch.Tensor, context: AFDTransferContext, router_logits: torch.Tensor | None = None
    ) -> None:
        self._require_ready("send_attn_output", "attention")
        s = self.settings
        metadata = context.metadata
        stage = self._stage(metadata.stage_idx)
        self._check_tensor(hidden, "hidden states", s.hidden_size, s.dtype)
        if hidden.shape[0] != stage.own_rows:
            raise ValueError(
                f"AFD send rows ({hidden.shape[0]}) differ from the published count ({stage.own_rows}) for "
                f"attention rank {s.role_rank} (layer {metadata.layer_idx}, stage {metadata.stage_idx}); "
                "publish the padded, >= 1 row count this rank sends"
            )
        metadata.validate_tensor_shape(hidden.shape)
        if router_logits is not None:
            if not s.compute_gate_on_attention:
                raise ValueError(
                    f"{s.connector_name}: router logits given with compute_gate_on_attention=false; "
                    "expected hidden states only. Only MoE layers under compute_gate_on_attention=true send them"
                )
            self._check_tensor(router_logits, "router logits", s.num_routed_experts, None)
            if router_logits.shape[0] != hidden.shape[0]:
                raise ValueError(
                    f"router_logits and hidden_states must have equal token counts (router_logits "
                    f"{router_logits.shape[0]}, hidden_states {hidden.shape[0]}); pass this layer's logits"
                )
        label, peer = "a2e send to ffn", self.plan.subgroup
        self._transfer(lambda: self.transport.send(A2E, hidden.contiguous(), 0), label, peer)
        if router_logits is not None:
            self._transfer(lambda: self.transport.send(A2E, router_logits.contiguous(), 0), label, peer)

    def recv_ffn_output(self, ref_tensor: torch.Tensor, ubatch_idx: int = 0) -> torch.Tensor:
        self._require_ready("recv_ffn_output", "attention")
        s = self.settings
        stage = self._stage(ubatch_idx)
        shape = (ref_tensor.shape[0], s.hidden_size)
        if ref_tensor.shape[0] != stage.own_rows:
            raise ValueError(
                f"AFD receive rows ({ref_tensor.shape[0]}) differ from the published count "
                f"({stage.own_rows}) for attention rank {s.role_rank} (stage {ubatch_idx}); pass the "
                "tensor just sent as ref_tensor"
            )
        fits = (tuple(ref_tensor.shape) == shape and ref_tensor.dtype == s.dtype
                and ref_tensor.device == s.device and ref_tensor.is_contiguous())
        out = ref_tensor if fits else torch.empty(shape, dtype=s.dtype, device=s.device)
        self._transfer(lambda: self.transport.recv(E2A, out, 0), "e2a receive from ffn", self.plan.subgroup)
        self._count_exchange()
        return out

    # ---- data plane: FFN ------------------------------------------------------------------------

    def recv_attn_output(
        self, ubatch_idx: int = 0, routing_spec: AFDExpertRoutingSpec | None = None
    ) -> AFDA2FTransferPayload:
        self._require_ready("recv_attn_output", "ffn")
        s = self.settings
        stage = self._stage(ubatch_idx)
        if not stage.peer_rows:
            raise RuntimeError(f"P2P FFN rank has no Attention peers (ffn rank {s.role_rank})")
        if routing_spec is not None:
            self._routing_specs.add((routing_spec.router_logits_width, routing_spec.router_logits_dtype))
        hidden_parts, logit_parts = [], []
        for peer, num_rows in enumerate(stage.peer_rows, start=1):
            label = f"a2e receive from attention (subgroup rank {peer}) on"
            hidden = self._recv_buffer(ubatch_idx, peer, num_rows, s.hidden_size, s.dtype)
            self._transfer(lambda: self.transport.recv(A2E, hidden, peer), label, s.role_rank)
            hidden_parts.append(hidden)
            if routing_spec is not None:
                width, dtype = routing_spec.router_logits_width, routing_spec.router_logits_dtype
                logits = self._recv_buffer(ubatch_idx, peer, num_rows, width, dtype)
                self._transfer(lambda: self.transport.recv(A2E, logits, peer), label, s.role_rank)
                logit_parts.append(logits)
        metadata = AFDTransferMetadata.create_ffn_metadata(0, ubatch_idx, stage.peer_rows)
        return AFDA2FTransferPayload(
            _concat(hidden_parts), AFDTransferContext(metadata), _concat(logit_parts) if logit_parts else None
        )

    def send_ffn_output(self, output: torch.Tensor, context: AFDTransferContext) -> None:
        self._require_ready("send_ffn_output", "ffn")
        s = self.settings
        metadata = context.metadata
        self._check_tensor(output, "FFN output", s.hidden_size, s.dtype)
        metadata.validate_tensor_shape(output.shape)
        num_peers = self.plan.subgroup_size - 1
        if num_peers == 1:
            parts: Sequence[torch.Tensor] = [output]
        elif len(metadata.seq_lens) == num_peers:
            parts = output.split(metadata.seq_lens)
        elif output.shape[0] % num_peers == 0:
            parts = output.split(output.shape[0] // num_peers)
        else:
            raise ValueError(
                f"cannot evenly split FFN output across Attention peers ({output.shape[0]} rows, "
                f"{num_peers} peers, seq_lens {metadata.seq_lens}); pass the context recv_attn_output returned"
            )
        for peer, part in enumerate(parts, start=1):
            label = f"e2a send to attention (subgroup rank {peer}) from"
            self._transfer(lambda: self.transport.send(E2A, part.contiguous(), peer), label, s.role_rank)
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

    def _stage(self, stage_idx: int) -> _Stage:
        try:
            return self._stages[stage_idx]
        except KeyError:
            raise RuntimeError(
                f"{self.settings.connector_name}: no published state for stage {stage_idx} (stages "
                f"{sorted(self._stages)}); expected a control payload for this step before its first "
                "exchange. Publish with send_dp_metadata / update_state_from_dp_metadata"
            ) from None

    def _check_tensor(self, tensor: torch.Tensor, what: str, width: int | None, dtype: torch.dtype | None) -> None:
        s = self.settings
        problems = []
        if tensor.dim() != 2:
            problems.append(f"rank {tensor.dim()}, expected 2-D [rows, {width or 'width'}]")
        elif width is not None and tensor.shape[1] != width:
            problems.append(f"width {tensor.shape[1]}, expected {width}")
        if tensor.device != s.device:
            problems.append(f"device {tensor.device}, expected {s.device}")
        if dtype is not None and tensor.dtype != dtype:
            problems.append(f"dtype {tensor.dtype}, expected {dtype}")
        if problems:
            raise ValueError(
                f"{s.connector_name}: {what} of shape {list(tensor.shape)} cannot be sent: "
                f"{'; '.join(problems)}. Pass the model's [rows, hidden] tensor on the connector's device"
            )

    def _recv_buffer(self, stage_idx: int, peer: int, num_rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        s = self.settings
        if not s.use_graph_buffers:
            return torch.empty((num_rows, width), dtype=dtype, device=s.device)
        key = (stage_idx, peer, num_rows, width, dtype)
        buffer = self._buffers.get(key)
        if buffer is None:  # never evicted: a replayed graph finds the address it recorded
            buffer = self._buffers[key] = torch.empty((num_rows, width), dtype=dtype, device=s.device)
        return buffer

    def _preallocate_buffers(self) -> None:
        s = self.settings
        for stage_idx, stage in self._stages.items():
            for peer, num_rows in enumerate(stage.peer_rows, start=1):
                self._recv_buffer(stage_idx, peer, num_rows, s.hidden_size, s.dtype)
                for width, dtype in self._routing_specs:
                    self._recv_buffer(stage_idx, peer, num_rows, width, dtype)

    def _count_exchange(self) -> None:
        per_stage = self.settings.exchanges_per_stage
        self._num_exchanges += 1
        if per_stage is not None and self._num_exchanges == per_stage * len(self._stages):
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


def _concat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class P2pAFDConnector(AFDConnectorBase):
    """Shared body of both P2P connectors: the contract of base.py delegated to one ``P2pProtocol``."""

    def __init__(self, rank: int, local_rank: int, vllm_config: Any, afd_config: Any, role_rank: int) -> None:
        super().__init__(rank, local_rank, vllm_config, afd_config, role_rank)
        from vllm_afd.connectors.fingerprint import build_fingerprint, settings_from_config

        device = self.make_device(vllm_config, local_rank)
        fingerprint = build_fingerprint(vllm_config, afd_config, afd_config.role, role_rank)
        settings = settings_from_config(vllm_config, afd_config, fingerprint, device, type(self).__name__)
        self.protocol = P2pProtocol(settings, self.make_transport(settings), lambda: fingerprint)
        self.control_plane = self.protocol

    @classmethod
    @abstractmethod
    def make_device(cls, vllm_config: Any, local_rank: int) -> torch.device:
        """The device exchanged tensors live on."""

    @classmethod
    @abstractmethod
    def make_transport(cls, settings: P2pSettings) -> P2pTransport:
        """A closed transport for ``settings`` (no communication)."""

    def init_afd_connector(self) -> None:
        self.protocol.init()

    @property
    def is_initialized(self) -> bool:
        return self.protocol.is_initialized

    def close(self) -> None:
        self.protocol.close()

    def check_failed(self) -> None:
        self.protocol.check_failed()

    @property
    def dp_size(self) -> int:
        """DP size of this rank's role (the ops need the attention's to pick the counts source)."""
        return self.protocol.settings.dp_size

    def send_attn_output(self, hidden_states: Any, context: Any, router_logits: Any = None) -> None:
        self.protocol.send_attn_output(hidden_states, context, router_logits)

    def recv_ffn_output(self, ref_tensor: Any, ubatch_idx: int = 0) -> Any:
        return self.protocol.recv_ffn_output(ref_tensor, ubatch_idx)

    def recv_attn_output(self, ubatch_idx: int = 0, routing_spec: Any = None) -> Any:
        return self.protocol.recv_attn_output(ubatch_idx, routing_spec)

    def send_ffn_output(self, output: Any, context: Any) -> None:
        self.protocol.send_ffn_output(output, context)
